"""`python -m controlplane`: the same as `ztunnel control-plane`, without the proxy's CLI."""

from __future__ import annotations

import argparse
import logging
import sys

from controlplane import add_arguments


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m controlplane", description="development control plane")
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s\t%(levelname)s\t%(name)s\t%(message)s")
    from controlplane.server import ControlPlaneStartError, run

    try:
        return run(
            args.config,
            args.listen,
            args.tls,
            args.ca_dir,
            auth_token=args.auth_token,
            cluster_id=args.cluster_id,
            kube=args.kube,
            max_recv_msg_size=args.max_recv_msg_size,
        )
    except ControlPlaneStartError as e:
        print(f"control-plane: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
