"""The one front door: `ztunnel [proxy|version|demo|control-plane|cni-agent|config]`.

Bad input ends with a single line naming what is wrong and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import TYPE_CHECKING

from ztunnel import __version__

if TYPE_CHECKING:
    import argparse

# The proxy's own command lines (the node image's, Istio's chart's): run without argparse, which so is
# not in the proxy's memory.
PROXY_COMMANDS: tuple[list[str], ...] = ([], ["proxy"], ["proxy", "ztunnel"])


def _version() -> int:
    from ztunnel.control import build_info

    info = build_info()
    fields = ", ".join(f"{k[0].upper()}{k[1:]}:{v!r}" for k, v in info.items())
    print(f"version.BuildInfo{{{fields}}}")
    print(f"ztunnel-py {__version__}")
    print(f"build: {info['pythonBuild']}")
    return 0


def build_parser(config_view: bool = True) -> argparse.ArgumentParser:
    """The parser of every command; `config_view` False leaves the `config` command's arguments out
    (and their module unloaded: a proxy's processes never hold it)."""
    import argparse

    from cni import add_arguments as add_agent_arguments
    from controlplane import add_arguments as add_control_plane_arguments

    parser = argparse.ArgumentParser(prog="ztunnel", description="Istio ambient-mesh node proxy, in Python")
    sub = parser.add_subparsers(dest="command", metavar="{proxy,version,demo,control-plane,cni-agent,config}")
    proxy = sub.add_parser("proxy", help="run the node proxy, configured by environment variables (default)")
    # Istio's chart runs `ztunnel proxy ztunnel`, as the reference names its one proxy kind.
    proxy.add_argument("kind", nargs="?", choices=["ztunnel"], default="ztunnel", help=argparse.SUPPRESS)
    sub.add_parser("version", help="print version information")
    demo = sub.add_parser("demo", help="end-to-end demo on loopback")
    demo.add_argument("--keep", action="store_true", help="leave the demo running and print how to use it")
    demo.add_argument("--kube", action="store_true", help="feed the control plane Kubernetes manifests")
    control_plane = sub.add_parser("control-plane", help="development xDS and CA fed by a file")
    add_control_plane_arguments(control_plane)
    agent = sub.add_parser("cni-agent", help="the node agent of in-pod mode (ZDS server, pod redirection)")
    add_agent_arguments(agent)
    config = sub.add_parser(
        "config", help="a running proxy's configuration, as istioctl ztunnel-config shows it"
    )
    if config_view:
        from ztunnel.admin.configview import add_arguments as add_config_view_arguments

        add_config_view_arguments(config)
    return parser


def _fatal(message: str) -> int:
    """A command's last word on stderr, after the log lines written before it (each process's
    writer thread writes those a moment later): exit code 1."""
    for handler in logging.root.handlers:
        handler.flush()
    print(message, file=sys.stderr)
    return 1


def _setup_logging(command: str) -> bool:
    from ztunnel.logs.lines import setup_logging

    try:
        setup_logging(os.environ.get("LOG_FORMAT", "plain"), os.environ.get("LOG_LEVEL", "info"))
    except ValueError as e:
        _fatal(f"ztunnel: {command}: LOG_FORMAT or LOG_LEVEL: {e}")
        return False
    return True


def _control_plane(args: argparse.Namespace) -> int:
    from controlplane.server import ControlPlaneStartError, run_with_arguments

    if not _setup_logging("control-plane"):
        return 1
    try:
        return run_with_arguments(args)
    except ControlPlaneStartError as e:
        return _fatal(f"ztunnel: control-plane: {e}")


def _cni_agent(args: argparse.Namespace) -> int:
    from cni.agent import AgentError
    from cni.daemon import run_agent

    if not _setup_logging("cni-agent"):
        return 1
    try:
        return run_agent(args)
    except AgentError as e:
        return _fatal(f"ztunnel: cni-agent: {e}")


def _run_without_docstrings() -> None:
    """`ztunnel proxy` runs as `python -OO`: without the docstrings every process of the proxy would
    otherwise hold (about 1.7 MiB of a proxy's memory at rest; the asserts go too, checks of what
    cannot happen). This process is replaced by the same command under -OO (the same pid), unless
    it runs so already or `PYTHONOPTIMIZE` is set (`PYTHONOPTIMIZE=0`: keep them)."""
    if sys.flags.optimize >= 2 or "PYTHONOPTIMIZE" in os.environ:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    with contextlib.suppress(OSError):  # then it runs as it was started
        os.execv(sys.executable, [sys.executable, "-OO", *sys.orig_argv[1:]])


def main(argv: list[str] | None = None) -> int:
    own_argv = argv is None  # this process's command line: `proxy` may re-execute it
    argv = sys.argv[1:] if argv is None else argv
    if argv in PROXY_COMMANDS:
        return _run_proxy(own_argv)
    parser = build_parser(config_view=argv[:1] == ["config"])
    if argv[0] == "help":
        parser.print_help()
        return 0
    args = parser.parse_args(argv)
    if args.command == "config":
        from ztunnel.admin.configview import run as run_config_view

        return run_config_view(args)
    if args.command == "proxy":
        return _run_proxy(own_argv)
    from ztunnel.lifecycle import StartupError

    try:
        if args.command == "version":
            return _version()
        if args.command == "demo":
            from ztunnel.demo import run_demo

            return run_demo(keep=args.keep, kube=args.kube)
        if args.command == "control-plane":
            return _control_plane(args)
        return _cni_agent(args)
    except StartupError as e:
        return _fatal(f"ztunnel: {e}")
    except KeyboardInterrupt:
        return 130


def _run_proxy(own_argv: bool) -> int:
    if own_argv:
        _run_without_docstrings()
    from ztunnel.lifecycle import StartupError
    from ztunnel.start import run_proxy

    try:
        return run_proxy(dict(os.environ))
    except StartupError as e:
        return _fatal(f"ztunnel: {e}")
    except KeyboardInterrupt:
        return 130
