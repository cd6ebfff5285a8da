from ztunnel.cli import main

raise SystemExit(main())
