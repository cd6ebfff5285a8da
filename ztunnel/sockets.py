"""How the proxy makes its sockets: listeners, outgoing connections, and the Linux socket options
the reference relies on.

A `SocketFactory` is per proxy instance; in in-pod mode each pod's is a `NetnsSocketFactory`
(`ztunnel.inpod.netns`), which creates its sockets inside the pod's network namespace.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import random
import socket
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hbone.address import canonical_addr, canonical_host

if TYPE_CHECKING:
    from ztunnel.config.settings import Config

SOL_IP = 0
SOL_IPV6 = 41
SO_ORIGINAL_DST = 80
IP6T_SO_ORIGINAL_DST = 80
IP_TRANSPARENT = 19
IPV6_TRANSPARENT = 75
SO_MARK = 36
# Bind to an address but pick the port at connect(): without it, bind((ip, 0)) searches every port in
# use, TIME_WAIT sockets included, on each new connection.
IP_BIND_ADDRESS_NO_PORT = 24

SockAddr = tuple[str, int]


def original_dst(sock: socket.socket) -> SockAddr:
    """The destination the app dialled before iptables redirected it; the local address otherwise."""
    try:
        raw = sock.getsockopt(SOL_IP, SO_ORIGINAL_DST, 16)
        port, packed = struct.unpack_from("!2xH4s", raw)
        return socket.inet_ntop(socket.AF_INET, packed), port
    except OSError:
        pass
    try:
        raw = sock.getsockopt(SOL_IPV6, IP6T_SO_ORIGINAL_DST, 28)
        port, packed = struct.unpack_from("!2xH4x16s", raw)
        return canonical_host(socket.inet_ntop(socket.AF_INET6, packed)), port
    except OSError:
        return canonical_addr(sock.getsockname())


@dataclass(frozen=True)
class SocketOptions:
    keepalive: bool = True
    keepalive_time: int = 180
    keepalive_interval: int = 180
    keepalive_retries: int = 9
    mark: int | None = None
    reuseport: bool = False
    backlog: int = 1024
    # TCP_USER_TIMEOUT in milliseconds (USER_TIMEOUT_ENABLED), on the sockets that get keepalive.
    user_timeout_ms: int | None = None
    # IPV6_ENABLED: the wildcard is the dual-stack `[::]`; without IPv6 it is `0.0.0.0`.
    ipv6: bool = True
    # The source ports outgoing connections take in turn (see `SourcePorts`); None: the kernel's
    # ephemeral range of this process's namespace, less its reserved ports.
    source_ports: tuple[int, int] | None = None


# Explicit source ports tried per connection before the kernel is left to pick one.
PORT_ATTEMPTS = 8


class SourcePorts:
    """The source ports of a factory's outgoing connections: each the next of the range, in turn.

    Left to itself, `connect()` searches the ephemeral range for a free port and skips every port
    with a TIME_WAIT socket to the same destination: once those outnumber the even ports (half the
    range: ~14,000 by default, reached by a proxy making a few hundred connections a second to one
    destination) the search walks all of them on every connection, and a connection costs
    milliseconds of kernel time. A port bound explicitly (SO_REUSEADDR) may reuse a TIME_WAIT
    socket's address pair when that connection had TCP timestamps (PAWS keeps old segments out), so
    taking the ports in turn keeps the cost flat. A port in use otherwise fails the bind (EADDRINUSE)
    or the connect (EADDRNOTAVAIL), and the next is tried.
    """

    def __init__(self, low: int, high: int, reserved: frozenset[int] = frozenset()) -> None:
        self.low, self.span = low, max(high - low + 1, 0)
        self.reserved = reserved
        self.usable = self.span > len(reserved)
        self._next = random.randrange(self.span) if self.span else 0

    def take(self) -> int:
        while True:
            port = self.low + self._next
            self._next = (self._next + 1) % self.span
            if port not in self.reserved:
                return port

    @classmethod
    def of_this_namespace(cls) -> SourcePorts:
        """The ephemeral range of the namespace this process runs in, without its reserved ports."""
        low, high = 32768, 60999
        with contextlib.suppress(OSError, ValueError), open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
        reserved: set[int] = set()
        with (
            contextlib.suppress(OSError, ValueError),
            open("/proc/sys/net/ipv4/ip_local_reserved_ports") as f,
        ):
            for part in f.read().strip().split(","):
                if part:
                    a, _, b = part.partition("-")
                    reserved.update(range(max(int(a), low), min(int(b or a), high) + 1))
        return cls(low, high, frozenset(reserved))


def user_timeout_ms(cfg: Config) -> int | None:
    """TCP_USER_TIMEOUT with USER_TIMEOUT_ENABLED: as long as keepalive takes to give up on a peer
    (the first probe's idle time, then every retry's interval)."""
    if not cfg.user_timeout_enabled:
        return None
    return int((cfg.keepalive_time + cfg.keepalive_retries * cfg.keepalive_interval) * 1000)


def socket_options(cfg: Config, *, workers: bool = False) -> SocketOptions:
    """The proxy sockets' options. `workers`: the listeners are shared by several data-plane worker
    processes, so they join with SO_REUSEPORT whatever `INPOD_PORT_REUSE` says (only ours join in
    dedicated mode: the supervisor holds each address exclusively first, see ztunnel/workers/)."""
    shared = cfg.proxy_mode == "shared"
    return SocketOptions(
        keepalive=cfg.keepalive_enabled,
        keepalive_time=int(cfg.keepalive_time),
        keepalive_interval=int(cfg.keepalive_interval),
        keepalive_retries=cfg.keepalive_retries,
        mark=cfg.packet_mark,
        reuseport=workers or (cfg.inpod_port_reuse if shared else False),
        backlog=128 if shared else SocketOptions.backlog,
        user_timeout_ms=user_timeout_ms(cfg),
        ipv6=cfg.ipv6_enabled,
    )


def _transparent_option(family: int) -> tuple[int, int]:
    return (SOL_IPV6, IPV6_TRANSPARENT) if family == socket.AF_INET6 else (SOL_IP, IP_TRANSPARENT)


def is_transparent(sock: socket.socket) -> bool:
    """Whether IP_TRANSPARENT is on for `sock` (whether a best-effort attempt succeeded)."""
    try:
        return bool(sock.getsockopt(*_transparent_option(sock.family)))
    except OSError:
        return False


class SocketFactory:
    """Creates the sockets of one proxy instance (listeners and outgoing TCP)."""

    def __init__(self, options: SocketOptions | None = None) -> None:
        self.options = options or SocketOptions()
        ports = self.options.source_ports
        self.source_ports = SourcePorts(*ports) if ports else SourcePorts.of_this_namespace()

    def _new(self, family: int, kind: int = socket.SOCK_STREAM) -> socket.socket:
        sock = socket.socket(family, kind)
        if self.options.mark is not None:
            sock.setsockopt(socket.SOL_SOCKET, SO_MARK, self.options.mark)
        return sock

    def listener(self, host: str, port: int, *, transparent: bool = False) -> socket.socket:
        """A bound, listening, non-blocking socket; `host` "" or "::" means the dual-stack wildcard."""
        if host == "" and not self.options.ipv6:
            family, bind_host = socket.AF_INET, "0.0.0.0"
        elif host in ("", "::"):
            family, bind_host = socket.AF_INET6, "::"
        else:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            bind_host = host
        try:
            sock = self._new(family)
        except OSError:
            if host not in ("", "::"):
                raise
            family, bind_host = socket.AF_INET, "0.0.0.0"
            sock = self._new(family)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if self.options.reuseport:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6 and bind_host == "::":
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            if transparent:
                try:
                    sock.setsockopt(*_transparent_option(family), 1)
                except OSError:
                    pass  # best effort, as the reference: it only decides source spoofing
            # Accepted sockets inherit these from their listener (Linux copies the listener's socket
            # state into each child): set once here, not with five syscalls per accepted connection.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._keepalive(sock)
            sock.bind((bind_host, port))
            sock.listen(self.options.backlog)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        return sock

    def datagram(self, family: int) -> socket.socket:
        """A fresh, unbound, non-blocking UDP socket, made as this factory makes all of its sockets
        (the pod's namespace, the mark): the DNS proxy's listeners and its upstream queries."""
        sock = self._new(family, socket.SOCK_DGRAM)
        sock.setblocking(False)
        return sock

    def _keepalive(self, sock: socket.socket) -> None:
        o = self.options
        if o.user_timeout_ms is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, o.user_timeout_ms)
        if not o.keepalive:
            return
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, o.keepalive_time)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, o.keepalive_interval)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, o.keepalive_retries)

    async def connect(
        self,
        addr: SockAddr,
        *,
        source_ip: str | None = None,
        transparent: bool = False,
        timeout: float = 10.0,
    ) -> socket.socket:
        """A connected non-blocking TCP socket to `addr`, optionally from `source_ip`; `transparent`
        lets that be an address of another host (the client's: IP_TRANSPARENT).

        Raises TimeoutError after `timeout`, or the OSError of the connect (e.g. ConnectionRefusedError).
        """
        host, port = addr
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        if source_ip is not None and (":" in source_ip) != (family == socket.AF_INET6):
            source_ip = None
        bind_ip = source_ip if source_ip is not None else ("::" if family == socket.AF_INET6 else "0.0.0.0")
        ports = self.source_ports
        for attempt in range(PORT_ATTEMPTS + 1):
            explicit = attempt < PORT_ATTEMPTS and ports.usable
            sock = self._new(family)
            bound = False
            try:
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._keepalive(sock)
                if transparent and source_ip is not None:
                    sock.setsockopt(*_transparent_option(family), 1)
                if explicit:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    try:
                        sock.bind((bind_ip, ports.take()))
                    except OSError as e:
                        if e.errno != errno.EADDRINUSE:
                            raise
                        sock.close()
                        continue  # the port is someone else's: the next one
                    bound = True
                elif source_ip is not None:
                    sock.setsockopt(SOL_IP, IP_BIND_ADDRESS_NO_PORT, 1)
                    sock.bind((source_ip, 0))
                await connect_nonblocking(sock, (host, port), timeout)
            except OSError as e:
                sock.close()
                if bound and e.errno == errno.EADDRNOTAVAIL:
                    continue  # this address pair is in use (not reusable): the next port
                raise
            except BaseException:
                sock.close()
                raise
            return sock
        raise OSError(errno.EADDRNOTAVAIL, f"Connect call failed {addr!r}: no source port")


async def connect_nonblocking(sock: socket.socket, addr: SockAddr, timeout: float) -> None:
    """Connect a non-blocking socket to a numeric address: `connect()`, then wait for writability.

    `loop.sock_connect` would first resolve the address; uvloop does that on its thread pool even for
    an IP literal, a thread hop that cost more than the connect itself (~100 µs per connection).
    Raises the connect's OSError (ConnectionRefusedError, ...), or TimeoutError after `timeout`.
    """
    err = sock.connect_ex(addr)
    if err == errno.EINPROGRESS and _established(sock):
        # A local destination (a pod's own address, loopback) completes its handshake inside the
        # connect() call: no need to wait a loop iteration for writability.
        err = 0
    if err == errno.EINPROGRESS:
        loop = asyncio.get_running_loop()
        fd = sock.fileno()
        writable = loop.create_future()
        loop.add_writer(fd, _settle, writable, None)
        timer = loop.call_later(timeout, _settle, writable, TimeoutError())
        try:
            await writable
        finally:
            timer.cancel()
            loop.remove_writer(fd)
        err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    if err:
        # Worded as asyncio's sock_connect words it (access logs and operators' alerts keep matching).
        raise OSError(err, f"Connect call failed {addr!r}")


def _established(sock: socket.socket) -> bool:
    try:
        sock.getpeername()
    except OSError:
        return False  # ENOTCONN: still in progress
    return True


def _settle(fut: asyncio.Future[None], exc: BaseException | None) -> None:
    if not fut.done():
        if exc is None:
            fut.set_result(None)
        else:
            fut.set_exception(exc)
