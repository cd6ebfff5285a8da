"""Dedicated mode: the supervisor holds each listener address exclusively before any worker binds.

It binds every address itself without `SO_REUSEPORT` (so any other holder of the address is an
error naming it) and keeps, for its lifetime, an abstract Unix socket named after the address as a
lock (so a second proxy starting at the same moment cannot slip in while our workers bind); only
then do the workers join the address with `SO_REUSEPORT`. In-pod mode does neither: a new ztunnel
binding beside the old one during an upgrade (`INPOD_PORT_REUSE`) is the point there.
"""

from __future__ import annotations

import errno
import socket

from ztunnel.config.settings import Config
from ztunnel.proxy.plan import DNS, check_transparent, listen_plan
from ztunnel.sockets import SocketFactory, socket_options


def claim(
    factory: SocketFactory, host: str, port: int, *, transparent: bool = False
) -> tuple[socket.socket, socket.socket]:
    """Bind `host:port` exclusively: the listening socket (to close once checked: the workers bind
    the address) and the lock that keeps other ztunnels off it. OSError naming the address if taken."""
    where = f"{host or '[::]'}:{port}"
    try:
        sock = factory.listener(host, port, transparent=transparent)
    except OSError as e:
        raise OSError(e.errno, f"{where}: {e.strerror or e}") from None
    lock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        lock.bind(f"\0ztunnel-listener {where}")
    except OSError as e:
        lock.close()
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise OSError(e.errno, f"{where}: in use by another ztunnel") from None
        raise OSError(e.errno, f"{where}: {e.strerror or e}") from None
    return sock, lock


async def claim_listeners(config: Config) -> list[socket.socket]:
    """Claim every TCP listener address of the dedicated workload's listen plan; the locks to keep
    for our lifetime. OSError (naming the address) when one is taken. (The DNS proxy's address is
    left to the workers, as before: it is not exclusive.)"""
    factory = SocketFactory(socket_options(config))
    locks: list[socket.socket] = []
    try:
        for spec in listen_plan(config):
            if spec.name == DNS:
                continue
            sock, lock = claim(factory, spec.host, spec.port, transparent=spec.transparent)
            locks.append(lock)
            try:
                check_transparent(config, spec, sock)
            finally:
                sock.close()  # the workers bind these addresses with SO_REUSEPORT; the locks stay
    except OSError:
        for lock in locks:
            lock.close()
        raise
    return locks
