"""The inbound plaintext listener (15006): connections redirected into the pod without HBONE.

The original destination is the target; `admit()` applies the self-call guard, finds our workload
and authorizes without a peer identity (so only address, port and negated-identity rules can
allow). A rejection closes the connection (there is no protocol to answer in); a denial is recorded
with the `DENY` flag, and its client sees the connection closed (end of stream), never reset: what it
sent, or still sends until it closes its side, is read and dropped first (`close_refused`). An admitted connection is carried to the app from the client's own address
where the listener is transparent, and stays under re-authorization while it is open.
"""

from __future__ import annotations

import asyncio

from hbone.address import canonical_addr, format_addr, parse_ip
from hbone.relay import Inbox, RelayResult
from ztunnel.decisions.admission import InboundRequest, Reject
from ztunnel.logs.lines import Bare
from ztunnel.proxy.connections import carry
from ztunnel.proxy.context import ProxyContext
from ztunnel.proxy.telemetry import (
    ConnectionRecord,
    Peer,
    connection_failed,
    log_policy_decision,
    record_denial,
    trace_id,
)
from ztunnel.proxy.upstream import describe
from ztunnel.sockets import original_dst

# How long a connection the policy refused stays half-closed while what its client still sends is
# dropped: time for a client to see the end and close, short enough that a refusal costs little.
REFUSED_LINGER = 2.0


async def close_refused(transport: asyncio.Transport, inbox: Inbox, linger: float = REFUSED_LINGER) -> None:
    """Close a refused connection so that its client reads the end of it (a FIN), not a reset.

    Closing a socket that holds unread bytes makes the kernel reset the connection, and a client
    sends before it reads: so the end is sent first, then whatever arrives is read and dropped
    until the client closes its side (or `linger` seconds pass), and only then is the socket closed.
    """
    if not transport.is_closing() and transport.can_write_eof():
        transport.write_eof()
    try:
        async with asyncio.timeout(linger):
            while True:
                inbox.take()
                await inbox.wait_data()
    except (EOFError, TimeoutError):
        pass
    finally:
        transport.close()


class InboundPassthrough:
    def __init__(self, ctx: ProxyContext) -> None:
        self.ctx = ctx

    async def handle(self, transport: asyncio.Transport, inbox: Inbox) -> asyncio.Future[RelayResult] | None:
        """A connection accepted on 15006: to our app, at its original destination's port."""
        src = canonical_addr(transport.get_extra_info("peername"))
        dst = original_dst(transport.get_extra_info("socket"))
        return await self.forward(transport, inbox, src, dst)

    async def forward(
        self, transport: asyncio.Transport, inbox: Inbox, src: tuple[str, int], dst: tuple[str, int]
    ) -> asyncio.Future[RelayResult] | None:
        """The accepted connection from `src` to its original destination `dst`, admitted (else
        closed) and carried to the app; the carried future, or None when it was closed."""
        ctx = self.ctx
        src_s, dst_s = format_addr(*src), format_addr(*dst)
        request = InboundRequest(peer=(parse_ip(src[0]), src[1]), local=(parse_ip(dst[0]), dst[1]))
        decision = await ctx.admit(request)
        if isinstance(decision, Reject) and decision.plan is None:
            connection_failed(src_s, dst_s, "inbound", decision.reason)
            transport.close()
            return None
        plan = decision.plan
        assert plan is not None
        record = ConnectionRecord(
            ctx.metrics,
            direction="inbound",
            src_addr=src_s,
            dst_addr=dst_s,
            src=Peer(plan.src_workload),
            dst=Peer(plan.local),
            service=plan.service,
            spans=(("inbound", {"id": trace_id(None), "peer": Bare(src_s)}),),
            registry=ctx.connections,
            dump_as=(None, format_addr(*plan.app), "TCP"),
        )
        log_policy_decision(decision, src_s, dst_s, info=ctx.config.authz_policy_info_logging)
        if isinstance(decision, Reject):
            record_denial(record, decision)
            ctx.tasks.track(close_refused(transport, inbox))  # its own task: the denial is decided
            return None
        try:
            app, app_inbox = await ctx.connect_tcp(
                plan.app, source_ip=plan.source_ip, transparent=plan.transparent
            )
        except Exception as e:
            transport.close()
            record.finish(received=0, sent=0, error=f"connect to app: {describe(e)}", flags="CONNECT")
            return None
        return ctx.hold(
            carry(
                transport,
                app,
                record,
                down_inbox=inbox,
                up_inbox=app_inbox,
                tracker=ctx.tracker,
                authorized=(plan.connection, plan.local.uid),
            )
        )
