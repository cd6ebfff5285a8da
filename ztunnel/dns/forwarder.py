"""Forwarding what the proxy does not answer itself to the nameservers of ztunnel's own
`/etc/resolv.conf`, through the proxy's socket factory (so a pod's queries leave from the pod's
namespace, marked, and are not captured again).

The client's query goes upstream as it came, under a fresh random ID, over the client's transport
(a truncated UDP answer is relayed as such: the client retries over TCP). The search list is not
applied: the client already did.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import random
import socket
from dataclasses import dataclass

from ztunnel.sockets import SocketFactory

log = logging.getLogger("ztunnel.dns")

RESOLV_CONF = "/etc/resolv.conf"
DNS_PORT = 53
# The resolver defaults (glibc's and the reference's resolver library) where resolv.conf says nothing.
DEFAULT_TIMEOUT = 5.0
DEFAULT_ATTEMPTS = 2
TCP_CONNECT_TIMEOUT = 5.0
MAX_MESSAGE = 65535


class UpstreamError(Exception):
    """No upstream gave an answer: the client gets SERVFAIL."""


@dataclass(frozen=True)
class UpstreamConfig:
    nameservers: tuple[tuple[str, int], ...] = ()
    search: tuple[str, ...] = ()
    timeout: float = DEFAULT_TIMEOUT
    attempts: int = DEFAULT_ATTEMPTS
    rotate: bool = False


def parse_resolv_conf(text: str) -> UpstreamConfig:
    """`nameserver`, `search`/`domain` and `options timeout:N attempts:N rotate`; the rest is ignored."""
    nameservers: list[tuple[str, int]] = []
    search: tuple[str, ...] = ()
    timeout, attempts, rotate = DEFAULT_TIMEOUT, DEFAULT_ATTEMPTS, False
    for line in text.splitlines():
        tokens = line.split("#", 1)[0].split(";", 1)[0].split()
        if len(tokens) < 2:
            continue
        key, values = tokens[0], tokens[1:]
        if key == "nameserver":
            try:
                ip = ipaddress.ip_address(values[0].split("%", 1)[0])
            except ValueError:
                log.warning("resolv.conf: ignoring nameserver %r: not an IP address", values[0])
                continue
            nameservers.append((str(ip), DNS_PORT))
        elif key in ("search", "domain"):
            search = tuple(v.rstrip(".").lower() for v in values)  # the last line wins
        elif key == "options":
            for option in values:
                name, _, value = option.partition(":")
                try:
                    if name == "timeout":
                        timeout = float(max(1, min(int(value), 30)))
                    elif name == "attempts":
                        attempts = max(1, min(int(value), 5))
                except ValueError:
                    continue
                if name == "rotate":
                    rotate = True
    return UpstreamConfig(tuple(nameservers), search, timeout, attempts, rotate)


def read_resolv_conf(path: str = RESOLV_CONF) -> UpstreamConfig:
    """The upstream configuration; an unreadable file means no nameservers (forwarding answers SERVFAIL)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return parse_resolv_conf(f.read())
    except OSError as e:
        log.warning("cannot read %s: %s; queries the DNS proxy does not answer will fail", path, e)
        return UpstreamConfig()


class Forwarder:
    def __init__(
        self,
        upstream: UpstreamConfig,
        sockets: SocketFactory,
        connect_timeout: float = TCP_CONNECT_TIMEOUT,
    ) -> None:
        self.upstream = upstream
        self.sockets = sockets
        self.connect_timeout = connect_timeout
        self._next = 0

    def _servers(self) -> list[tuple[str, int]]:
        servers = list(self.upstream.nameservers)
        if self.upstream.rotate and servers:
            self._next = (self._next + 1) % len(servers)
            servers = servers[self._next :] + servers[: self._next]
        return servers

    async def forward(self, query: bytes, tcp: bool) -> bytes:
        """The upstream's reply to `query` (its own ID restored), or UpstreamError."""
        servers = self._servers()
        if not servers:
            raise UpstreamError("no nameservers in resolv.conf")
        errors: list[str] = []
        for _ in range(self.upstream.attempts):
            for server in servers:
                upstream_id = random.getrandbits(16).to_bytes(2, "big")
                message = upstream_id + query[2:]
                try:
                    async with asyncio.timeout(self.upstream.timeout):
                        reply = await (self._tcp(server, message) if tcp else self._udp(server, message))
                except (OSError, TimeoutError, asyncio.IncompleteReadError) as e:
                    errors.append(f"{server[0]}: {type(e).__name__} {e}".rstrip())
                    continue
                return query[:2] + reply[2:]
        raise UpstreamError("; ".join(errors[-len(servers) :]))

    async def _udp(self, server: tuple[str, int], message: bytes) -> bytes:
        family = socket.AF_INET6 if ":" in server[0] else socket.AF_INET
        loop = asyncio.get_running_loop()
        sock = self.sockets.datagram(family)
        try:
            # Connected: only the server's datagrams arrive, and a refusal shows as ECONNREFUSED.
            sock.connect(server)
            await loop.sock_sendall(sock, message)
            while True:
                reply = await loop.sock_recv(sock, MAX_MESSAGE)
                if len(reply) >= 12 and reply[:2] == message[:2] and reply[2] & 0x80:
                    return reply
        finally:
            sock.close()

    async def _tcp(self, server: tuple[str, int], message: bytes) -> bytes:
        sock = await self.sockets.connect(server, timeout=self.connect_timeout)
        reader, writer = await asyncio.open_connection(sock=sock)
        try:
            writer.write(len(message).to_bytes(2, "big") + message)
            await writer.drain()
            while True:
                size = int.from_bytes(await reader.readexactly(2), "big")
                reply = await reader.readexactly(size)
                if len(reply) >= 12 and reply[:2] == message[:2] and reply[2] & 0x80:
                    return reply
        finally:
            writer.close()
