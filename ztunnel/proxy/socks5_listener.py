"""The SOCKS5 listener (15080): the sans-I/O handshake of `ztunnel.proxy.socks5_codec`, then the upstream
of an outbound connection.

The client's CONNECT target (an address, or a name: a mesh name as the DNS proxy would answer it, so
it reaches the service's VIP, any other by the system resolver) goes through the same upstream
logic as a redirected connection on 15001. A name is looked up in the client's family first (A on
the IPv4 listener), then in the other one, so a service of either family is reached; a name with
neither is answered "host unreachable" and logged. Success is replied only once the upstream is established,
so a client learns of a refused or denied destination from the reply code: the kind of the
upstream's failure, as `ztunnel.decisions.rejection`'s table tells it.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket

from hbone.address import canonical_addr, canonical_host, format_addr
from hbone.relay import Inbox, RelayResult
from mesh.model import IPAddress, Workload
from ztunnel.decisions.rejection import socks5_reply
from ztunnel.dns.resolver import RDTYPE_A, RDTYPE_AAAA, Authoritative, ResolverSettings, resolve
from ztunnel.proxy.connections import carry
from ztunnel.proxy.context import ProxyContext
from ztunnel.proxy.socks5_codec import ConnectRequested, HandshakeFailed, Reply, Socks5Handshake, encode_reply
from ztunnel.proxy.telemetry import connection_failed
from ztunnel.proxy.upstream import UpstreamFailure, Upstreams
from ztunnel.state.store import ProxyState

log = logging.getLogger("ztunnel.proxy")

HANDSHAKE_TIMEOUT = 10.0


def reply_for(failure: UpstreamFailure) -> Reply:
    return Reply(socks5_reply(failure.kind))


class NoAddress(OSError):
    """A name that resolves to no address of either family: the client is answered
    `Reply.HOST_UNREACHABLE`, and the log says which name."""


def mesh_address(
    state: ProxyState, client: Workload, host: str, family: int, settings: ResolverSettings
) -> IPAddress | None:
    """The address a mesh name stands for, as the DNS proxy would answer it: the A records first, then
    the AAAA ones (the reverse for a client on IPv6), so that a service of one family is reached from
    either; None for a name the mesh does not know. NoAddress when it has records of neither family."""
    name = host.lower().rstrip(".")
    order = (RDTYPE_AAAA, RDTYPE_A) if family == 6 else (RDTYPE_A, RDTYPE_AAAA)
    for rdtype in order:
        answer = resolve(state, client, name, rdtype, settings)
        if not isinstance(answer, Authoritative):
            return None
        if answer.addresses:
            return answer.addresses[0]
    raise NoAddress(f"{host} is a mesh name with no IPv4 or IPv6 address")


class Socks5Listener:
    def __init__(self, ctx: ProxyContext, upstreams: Upstreams) -> None:
        self.ctx = ctx
        self.upstreams = upstreams

    async def handle(self, transport: asyncio.Transport, inbox: Inbox) -> asyncio.Future[RelayResult] | None:
        src = canonical_addr(transport.get_extra_info("peername"))
        request = await self._handshake(transport, inbox, src)
        if request is None:
            transport.close()
            return None
        try:
            dst_ip = await self._resolve(request.host, ipaddress.ip_address(src[0]).version)
        except (OSError, UnicodeError) as e:
            connection_failed(
                format_addr(*src), format_addr(request.host, request.port), "outbound", f"dns: {e}"
            )
            transport.write(encode_reply(Reply.HOST_UNREACHABLE))
            transport.close()
            return None
        up = await self.upstreams.open(src, (dst_ip, request.port))
        if isinstance(up, UpstreamFailure):
            transport.write(encode_reply(reply_for(up)))
            transport.close()
            return None
        transport.write(encode_reply(Reply.SUCCEEDED))
        return self.ctx.hold(carry(transport, up.transport, up.record, down_inbox=inbox, up_inbox=up.inbox))

    async def _handshake(
        self, transport: asyncio.Transport, inbox: Inbox, src: tuple[str, int]
    ) -> ConnectRequested | None:
        """The client's CONNECT, or None when the handshake failed, timed out or was abandoned.
        Bytes the client sent after its request are put back in `inbox` for the relay."""
        hs = Socks5Handshake()
        try:
            async with asyncio.timeout(HANDSHAKE_TIMEOUT):
                while True:
                    await inbox.wait_data()
                    events = hs.receive(inbox.take())
                    out = hs.data_to_send()
                    if out:
                        transport.write(out)
                    for ev in events:
                        if isinstance(ev, HandshakeFailed):
                            log.debug("socks5 handshake failed from %s: %s", format_addr(*src), ev.reason)
                            return None
                        if hs.leftover:
                            inbox.buffer[:0] = hs.leftover
                        return ev
        except (EOFError, TimeoutError):
            return None

    async def _resolve(self, host: IPAddress | str, family: int) -> str:
        if not isinstance(host, str):
            return canonical_host(str(host))
        local = await self.ctx.local.local_workload()
        if local is not None:
            mesh = mesh_address(self.ctx.state, local, host, family, self.ctx.resolver)
            if mesh is not None:
                return str(mesh)
        loop = asyncio.get_running_loop()
        fam = socket.AF_INET6 if family == 6 else socket.AF_INET
        try:
            infos = await loop.getaddrinfo(host, None, family=fam, type=socket.SOCK_STREAM)
        except OSError:
            infos = await loop.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        return canonical_host(str(infos[0][4][0]))
