"""The `ztunnel cni-agent` process: binds its two sockets (refusing to start beside a live agent),
reloads the pods, installs and keeps chained the plugin, and runs the `Agent` until SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import stat
from dataclasses import dataclass
from pathlib import Path

import uvloop

from cni.agent import Agent, AgentConfig, AgentError, make_parent
from cni.install import (
    ChainKeeper,
    InstallConfig,
    InstallError,
    install_plugin,
    uninstall,
)

log = logging.getLogger("cni.agent")

CHAIN_CHECK_INTERVAL = 1.0  # how soon a primary CNI's rewrite of its configuration is chained again
_MAX_UNIX_PATH = 107


def run_agent(args: argparse.Namespace) -> int:
    """Run the agent until SIGTERM or SIGINT (exit 0); with `--uninstall`, remove the plugin and exit.
    Raises AgentError when it cannot start."""
    config = AgentConfig.from_args(args)
    if getattr(args, "uninstall", False):
        assert config.install is not None
        try:
            changed = uninstall(config.install)
        except InstallError as e:
            raise AgentError(str(e)) from None
        log.info("uninstalled ztunnel-cni (%d file(s) changed)", len(changed))
        return 0
    return uvloop.run(_main(config))


async def _keep_chained(keeper: ChainKeeper) -> None:
    failing = False
    while True:
        await asyncio.sleep(CHAIN_CHECK_INTERVAL)
        try:
            keeper.ensure()
            failing = False
        except InstallError as e:
            if not failing:  # once per failure, not once a second
                log.error("cannot keep ztunnel-cni chained: %s", e)
            failing = True


async def _main(config: AgentConfig) -> int:
    # The sockets first: binding refuses to start a second agent, before it touches any pod.
    zds_listener = bind_unix(config.zds_socket, socket.SOCK_SEQPACKET, "--zds-socket")
    listeners = [zds_listener]
    agent = Agent(config)
    try:
        cni_listener = bind_unix(config.cni_socket, socket.SOCK_STREAM, "--cni-socket")
        listeners.append(cni_listener)
        agent.reload()
        # Chained only once the CNI socket is bound: the runtime may call the plugin at once.
        keeper = _install(config.install) if config.install is not None else None
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        keeping = loop.create_task(_keep_chained(keeper)) if keeper is not None else None
        try:
            await agent.serve(zds_listener.sock, cni_listener.sock, stop)
        finally:
            if keeping is not None:
                keeping.cancel()
    finally:
        for listener in listeners:
            close_listener(listener)
        agent.close()
    log.info("cni agent stopped")
    return 0


def _install(install: InstallConfig) -> ChainKeeper:
    """Copy the plugin and chain it; the plugin stays installed when the agent stops (an upgrade's
    new agent takes over), `--uninstall` removes it."""
    keeper = ChainKeeper(install)
    try:
        install_plugin(install)
        keeper.ensure()
    except InstallError as e:
        raise AgentError(str(e)) from None
    return keeper


# -- the listening sockets ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Listener:
    sock: socket.socket
    path: Path
    inode: int  # of the socket file we bound, to remove only ours at exit


def bind_unix(path: Path, kind: int, option: str) -> Listener:
    if len(os.fsencode(path)) > _MAX_UNIX_PATH:
        raise AgentError(f"{option} {path}: longer than the {_MAX_UNIX_PATH} bytes a unix socket path allows")
    make_parent(path, option)
    _remove_stale(path, kind, option)
    sock = socket.socket(socket.AF_UNIX, kind | socket.SOCK_CLOEXEC)
    try:
        sock.bind(str(path))
        os.chmod(path, 0o600)  # enrolling pods and receiving their namespaces is for root only
        sock.listen(128)
        inode = path.lstat().st_ino
    except OSError as e:
        sock.close()
        raise AgentError(f"{option} {path}: cannot listen: {e.strerror or e}") from None
    return Listener(sock, path, inode)


def _remove_stale(path: Path, kind: int, option: str) -> None:
    """Remove a socket file left by a previous agent; refuse a live one or a file that is no socket."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    except OSError as e:
        raise AgentError(f"{option} {path}: {e.strerror}") from None
    if not stat.S_ISSOCK(mode):
        raise AgentError(f"{option} {path}: exists and is not a socket")
    with socket.socket(socket.AF_UNIX, kind) as probe:
        probe.settimeout(0.5)
        try:
            probe.connect(str(path))
        except OSError:
            pass  # nobody listening: stale
        else:
            raise AgentError(f"{option} {path}: another process is listening on it")
    try:
        path.unlink()
    except OSError as e:
        raise AgentError(f"{option} {path}: cannot remove the stale socket: {e.strerror}") from None


def close_listener(listener: Listener) -> None:
    """Close our listening socket and remove its file, unless another agent has replaced it since."""
    listener.sock.close()
    with contextlib.suppress(OSError):
        if listener.path.lstat().st_ino == listener.inode:
            listener.path.unlink()
