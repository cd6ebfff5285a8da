"""The one front door: `ztunnel [proxy|version|demo]` (CONTRACT §2).

Bad input ends with a single line naming what is wrong and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys

from ztunnel import __version__


def _version() -> int:
    from ztunnel.app import build_info

    info = build_info()
    fields = ", ".join(f"{k[0].upper()}{k[1:]}:{v!r}" for k, v in info.items())
    print(f"version.BuildInfo{{{fields}}}")
    print(f"ztunnel-py {__version__}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ztunnel", description="Istio ambient-mesh node proxy, in Python")
    sub = parser.add_subparsers(dest="command", metavar="{proxy,version,demo}")
    sub.add_parser("proxy", help="run the node proxy, configured by environment variables (default)")
    sub.add_parser("version", help="print version information")
    demo = sub.add_parser("demo", help="end-to-end demo on loopback")
    demo.add_argument("--keep", action="store_true", help="leave the demo running and print how to use it")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if not argv or argv[0] == "help":
        if argv and argv[0] == "help":
            parser.print_help()
            return 0
        argv = ["proxy"]
    args = parser.parse_args(argv)
    from ztunnel.app import StartupError

    try:
        if args.command == "version":
            return _version()
        if args.command == "demo":
            from ztunnel.demo import run_demo

            return run_demo(keep=args.keep)
        from ztunnel.app import run_proxy

        return run_proxy(dict(os.environ))
    except StartupError as e:
        print(f"ztunnel: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
