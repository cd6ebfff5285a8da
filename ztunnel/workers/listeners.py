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

from ztunnel.config import Config
from ztunnel.identity import SecretManager
from ztunnel.metrics import Metrics
from ztunnel.proxy.instance import ProxyInstance
from ztunnel.sockets import SocketFactory, SocketOptions, socket_options
from ztunnel.state import ProxyState


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


class ClaimingFactory(SocketFactory):
    """A socket factory whose listeners are claims (for a proxy that is only bound, never served):
    each one's lock is kept in `locks`. (Once the listen plan names the addresses, `claim` each.)"""

    def __init__(self, options: SocketOptions) -> None:
        super().__init__(options)
        self._plain = SocketFactory(options)
        self.locks: list[socket.socket] = []

    def listener(self, host: str, port: int, *, transparent: bool = False) -> socket.socket:
        sock, lock = claim(self._plain, host, port, transparent=transparent)
        self.locks.append(lock)
        return sock


async def claim_listeners(config: Config, secrets: SecretManager) -> list[socket.socket]:
    """Claim every listener address of the dedicated workload; the locks to keep for our lifetime.
    OSError (naming the address) when one is taken."""
    assert config.workload_info is not None
    factory = ClaimingFactory(socket_options(config))
    probe = ProxyInstance(
        config,
        ProxyState(),
        secrets,
        Metrics(config.istio_version, process_metrics=False),
        config.workload_info,
        factory,
    )
    try:
        socks = probe.bind_listeners()
    except OSError:
        for lock in factory.locks:
            lock.close()
        raise
    finally:
        await probe.drain(0, graceful=False)  # it has served nothing
    for sock in socks.values():
        sock.close()  # the workers bind these addresses with SO_REUSEPORT; the locks stay
    return factory.locks
