"""The outbound listener (15001): a redirected connection to its original destination.

The destination comes from `SO_ORIGINAL_DST`; one addressed to the proxy's own ports is refused (it
would loop). The rest is `Upstreams.open` (route, connect) and carrying both sides to the end.
"""

from __future__ import annotations

import asyncio

from hbone.address import canonical_addr, format_addr, parse_ip
from hbone.relay import Inbox, RelayResult
from ztunnel.decisions.route import RECURSIVE_CALL, is_self_call
from ztunnel.proxy.connections import carry
from ztunnel.proxy.context import ProxyContext
from ztunnel.proxy.telemetry import connection_failed
from ztunnel.proxy.upstream import UpstreamFailure, Upstreams
from ztunnel.sockets import original_dst


class Outbound:
    def __init__(self, ctx: ProxyContext, upstreams: Upstreams) -> None:
        self.ctx = ctx
        self.upstreams = upstreams

    async def handle(self, transport: asyncio.Transport, inbox: Inbox) -> asyncio.Future[RelayResult] | None:
        """A connection accepted on 15001: to its original destination."""
        src = canonical_addr(transport.get_extra_info("peername"))
        dst = original_dst(transport.get_extra_info("socket"))
        return await self.forward(transport, inbox, src, dst)

    async def forward(
        self, transport: asyncio.Transport, inbox: Inbox, src: tuple[str, int], dst: tuple[str, int]
    ) -> asyncio.Future[RelayResult] | None:
        """The accepted connection from `src`, to its original destination `dst`: refused when that is
        one of our own ports, else its upstream opened and both carried; the carried future, or None
        when it was closed."""
        if is_self_call(parse_ip(dst[0]), dst[1], self.ctx.rules.illegal_ports, ours=False):
            connection_failed(format_addr(*src), format_addr(*dst), "outbound", RECURSIVE_CALL)
            transport.close()
            return None
        up = await self.upstreams.open(src, dst, inbox)
        if isinstance(up, UpstreamFailure):
            transport.close()
            return None
        return self.ctx.hold(carry(transport, up.transport, up.record, down_inbox=inbox, up_inbox=up.inbox))
