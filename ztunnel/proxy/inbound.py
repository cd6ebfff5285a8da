"""The inbound HBONE listener (15008): each CONNECT stream admitted, authorized and delivered.

The TLS and HTTP/2 side is `hbone.server.HboneServer`; each request it hands over is described as an
`InboundRequest` and judged by `admit()` (pure, in `ztunnel.decisions.admission`). A rejection before
authorization is a "connection failed" warning and its status (400/503); a denial is a 401 and a
recorded connection with the `DENY` flag. An admitted stream gets its app connection (503 when
that fails), then the 200 (with the destination's baggage), the PROXY v2 header for an application
tunnel, and the relay, under re-authorization while it is open.
"""

from __future__ import annotations

import asyncio

from hbone.address import format_addr, parse_ip
from hbone.h2conn import H2Session
from hbone.identity import Identity, uri_of
from hbone.server import ConnectRequest, HboneServer
from mesh.model import Workload
from ztunnel.decisions.admission import InboundRequest, Reject, forwarded_host
from ztunnel.decisions.rejection import RejectionKind, http_status
from ztunnel.logs.lines import Bare
from ztunnel.proxy import baggage
from ztunnel.proxy.connections import carry
from ztunnel.proxy.context import ProxyContext
from ztunnel.proxy.proxyprotocol import encode_tunnel_header
from ztunnel.proxy.telemetry import (
    ConnectionRecord,
    Peer,
    connection_failed,
    log_policy_decision,
    record_denial,
    trace_id,
)
from ztunnel.proxy.upstream import describe


class Inbound:
    def __init__(self, ctx: ProxyContext) -> None:
        self.ctx = ctx
        self.server = HboneServer(
            credentials=ctx.credentials,
            handler=self.handle,
            settings=ctx.settings,
            own_trust_domain=ctx.local.trust_domain,
            on_tls_error=self._tls_error,
            on_session=self._session_opened,
        )
        self._sockets_open = ctx.metrics.sockets_open("destination")

    def _session_opened(self, session: H2Session) -> None:
        self._sockets_open.inc()
        session.closed.add_done_callback(lambda _: self._sockets_open.dec())

    def _tls_error(self, peer: tuple[str, int], local: tuple[str, int], error: Exception) -> None:
        connection_failed(format_addr(*peer), format_addr(*local), "inbound", f"tls: {error}")

    async def handle(self, req: ConnectRequest) -> None:
        ctx = self.ctx
        src_s, local_s = format_addr(*req.peer_addr), format_addr(*req.local_addr)
        identity = req.peer_identity
        request = InboundRequest(
            peer=(parse_ip(req.peer_addr[0]), req.peer_addr[1]),
            local=(parse_ip(req.local_addr[0]), req.local_addr[1]),
            method=req.method,
            authority=req.authority,
            identity=identity,
            headers=req.headers,
        )
        decision = await ctx.admit(request)
        if isinstance(decision, Reject) and decision.plan is None:
            connection_failed(src_s, local_s, "inbound", decision.reason)
            req.respond(decision.status)
            return
        plan = decision.plan
        assert plan is not None
        local = plan.local
        # The client's trace (its `traceparent`) names this connection in our logs too.
        span = ("inbound", {"id": trace_id(req.headers.get("traceparent")), "peer": Bare(src_s)})
        record = ConnectionRecord(
            ctx.metrics,
            direction="inbound",
            src_addr=src_s,
            dst_addr=local_s,
            src=self._peer_from_baggage(plan.src_workload, identity, req.headers.get("baggage")),
            dst=Peer(local, uri_of(ctx.local.identity(local))),
            service=plan.service,
            hbone_addr=req.authority,
            mtls=True,
            spans=(span,),
            registry=ctx.connections,
            dump_as=(forwarded_host(req.headers.get("forwarded")), format_addr(*plan.app), "HBONE"),
        )
        req.headers.clear()  # read by now; a held connection need not keep them
        log_policy_decision(decision, src_s, local_s, info=ctx.config.authz_policy_info_logging)
        if isinstance(decision, Reject):
            req.respond(decision.status)
            record_denial(record, decision)
            return
        try:
            app, app_inbox = await ctx.connect_tcp(
                plan.app, source_ip=plan.source_ip, transparent=plan.transparent
            )
        except asyncio.CancelledError:
            # The client reset the stream (or its connection went) while the app was dialled.
            record.finish(received=0, sent=0, error="connect to app: cancelled, the stream was reset")
            raise
        except Exception as e:
            req.respond(http_status(RejectionKind.REFUSED))
            record.finish(received=0, sent=0, error=f"connect to app: {describe(e)}", flags="CONNECT")
            return
        headers = []
        if ctx.config.enable_response_baggage:
            bag = baggage.encode(local)
            if bag:
                headers.append(("baggage", bag))
        req.respond(200, headers)
        if plan.proxy_header is not None:
            # The app learns who connected, to what, and the client's identity.
            client, target = plan.proxy_header
            app.write(encode_tunnel_header(client, target, str(identity) if identity else None))
        ctx.hold(
            carry(
                req.stream,
                app,
                record,
                up_inbox=app_inbox,
                tracker=ctx.tracker,
                authorized=(plan.connection, local.uid),
            )
        )

    def _peer_from_baggage(self, w: Workload | None, identity: Identity | None, header: str | None) -> Peer:
        ident = uri_of(identity) if identity else None
        if w is not None or not self.ctx.config.enable_response_baggage:
            return Peer(w, ident)
        b = baggage.parse(header)
        return Peer(
            None,
            ident,
            name=b.workload_name,
            namespace=b.namespace,
            cluster=b.cluster_id,
            canonical_service=b.service_name,
            canonical_revision=b.service_version,
        )
