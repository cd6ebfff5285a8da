"""One proxy instance: the listeners of one workload and the flows behind them (SPEC §3, §4).

Outbound (15001) and SOCKS5 (15080) resolve a route and carry the app's bytes by TCP, inside an
HBONE stream from the pool (to the workload or its waypoint), or by double HBONE through a network
gateway (a TLS + HTTP/2 session inside a pooled stream); inbound HBONE (15008) validates each
CONNECT (our address, an address we are the waypoint of, or a service hostname), authorizes it and
delivers it to the app, through a PROXY v2 application tunnel where the workload has one; inbound
plaintext (15006) authorizes by address only. Every carried connection gets a `ConnectionRecord`
(metrics and the access log) and is tracked so that a drain can wait for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import ipaddress
import logging
import secrets as pyrandom
import socket
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import cast

from hbone.client import HboneConnection
from hbone.errors import HboneError, HttpStatusError
from hbone.identity import Identity
from hbone.inner import open_inner
from hbone.pool import Pool, PoolKey
from hbone.relay import Inbox, RelayResult, relay
from hbone.server import ConnectRequest, HboneServer
from hbone.settings import H2Settings
from hbone.stream import HboneStream
from hbone.tls import WorkloadCertificate, server_context
from policy import Connection, Deny, authorize
from xds.model import AppTunnelProtocol, IPAddress, Service, Workload
from ztunnel import baggage
from ztunnel.config import (
    HBONE_PORT,
    INBOUND_PLAINTEXT_PORT,
    OUTBOUND_PORT,
    Config,
    WorkloadInfo,
    illegal_ports,
)
from ztunnel.identity import SecretManager
from ztunnel.metrics import Metrics
from ztunnel.proxy.connections import ConnectionTracker
from ztunnel.proxy.telemetry import ConnectionRecord, Peer, connection_failed
from ztunnel.proxyprotocol import encode_tunnel_header
from ztunnel.route import (
    NoRoute,
    Protocol,
    Route,
    format_addr,
    hostname_target,
    is_waypoint_for,
    pick_resolved,
    route,
)
from ztunnel.sockets import SocketFactory, canonical_addr, canonical_ip, is_transparent, original_dst
from ztunnel.socks5 import ConnectRequest as SocksConnect
from ztunnel.socks5 import HandshakeFailed, Reply, Socks5Handshake, encode_reply
from ztunnel.state import ProxyState

log = logging.getLogger("ztunnel.proxy")

LOCAL_WORKLOAD_WAIT = 5.0
CONNECT_TIMEOUT = 10.0
NETWORK_POLICY_HINT = "connection timed out, maybe a NetworkPolicy is blocking HBONE port 15008"


def addr_str(addr: tuple[str, int]) -> str:
    return format_addr(_ip(addr[0]), addr[1])


def traceparent() -> str:
    return f"00-{pyrandom.token_hex(16)}-{pyrandom.token_hex(8)}-00"


@dataclass
class UpstreamFailure:
    """Why an upstream could not be established, with the SOCKS5 reply that tells a client so."""

    error: str
    flags: str
    reply: Reply


class _Accepted(Inbox):
    """An accepted connection: hands itself to a handler task as soon as it is made."""

    def __init__(
        self, instance: ProxyInstance, handler: Callable[[asyncio.Transport, Inbox], Awaitable[None]]
    ):
        super().__init__()
        self._instance = instance
        self._handler = handler

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        with contextlib.suppress(OSError):
            self._instance.sockets.tune_accepted(sock)
        self._instance.track(self._handler(transport, self)).add_done_callback(self._handled)

    def _handled(self, task: asyncio.Future[None]) -> None:
        # A bug in one connection's handling must cost that connection only. (A done callback
        # rather than a wrapping coroutine: one coroutine frame less per held connection.)
        if self.transport is None:
            return
        if task.cancelled():
            self.transport.abort()
        elif (error := task.exception()) is not None:
            log.error("connection handling failed", exc_info=error)
            self.transport.abort()


class ProxyInstance:
    def __init__(
        self,
        config: Config,
        state: ProxyState,
        secrets: SecretManager,
        metrics: Metrics,
        info: WorkloadInfo,
        sockets: SocketFactory,
    ) -> None:
        self.config = config
        self.state = state
        self.secrets = secrets
        self.metrics = metrics
        self.info = info
        self.sockets = sockets
        # PROXY_BIND_ADDRESS is for dedicated proxies sharing a host; a pod's proxy binds the wildcard
        # inside the pod's namespace.
        self.bind = config.proxy_bind_address if config.proxy_mode == "dedicated" else None
        self.illegal = illegal_ports(config)
        self.settings = H2Settings(
            stream_window=config.http2_stream_window_size,
            connection_window=config.http2_connection_window_size,
            frame_size=config.http2_frame_size,
        )
        self.pool = Pool(
            self._dial_hbone,
            max_streams=config.pool_max_streams_per_connection,
            idle_timeout=config.pool_unused_release_timeout,
        )
        self.hbone_server = HboneServer(
            context=self._server_context,
            handler=self._inbound,
            settings=self.settings,
            own_trust_domain=self._trust_domain,
            on_tls_error=self._inbound_tls_error,
        )
        self._servers: list[asyncio.AbstractServer] = []
        self._refresher: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._state_waiters: set[asyncio.Future[None]] = set()
        self._server_cert: WorkloadCertificate | None = None
        self._server_ctx: ssl.SSLContext | None = None
        self.addresses: dict[str, tuple[str, int]] = {}
        self.spoof_source = False  # decided when the listeners are bound
        self.tracker = ConnectionTracker(state)
        self._local: Workload | None = None
        self._local_known = False  # `_local` is current until the store changes
        self._unsubscribe = state.subscribe(self._state_changed)

    # -- identity ----------------------------------------------------------------------------

    def _state_changed(self) -> None:
        self._local_known = False
        for fut in self._state_waiters:
            if not fut.done():
                fut.set_result(None)
        self._state_waiters.clear()

    def find_local_workload(self) -> Workload | None:
        """The proxy's own workload, looked up once per store change (not per connection)."""
        if not self._local_known:
            i = self.info
            self._local = self.state.find_local_workload(
                i.name, i.namespace, i.service_account, self.config.node_name
            )
            self._local_known = True
        return self._local

    async def local_workload(self, timeout: float = LOCAL_WORKLOAD_WAIT) -> Workload | None:
        """The proxy's own workload, waiting up to `timeout` for it to appear (SPEC §3.1 step 3)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (w := self.find_local_workload()) is None:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return None
            fut = loop.create_future()
            self._state_waiters.add(fut)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(fut, remaining)
        return w

    def identity(self, w: Workload | None = None) -> Identity:
        td = (w.trust_domain if w else "") or self.config.trust_domain
        return Identity(td, self.info.namespace, self.info.service_account)

    def _trust_domain(self) -> str:
        return self.identity(self.find_local_workload()).trust_domain

    async def certificate(self) -> WorkloadCertificate:
        cert = await self.secrets.get(self.identity(self.find_local_workload()))
        if cert is not self._server_cert:
            self._server_cert = cert
            self._server_ctx = server_context(cert)
        return cert

    def _server_context(self) -> ssl.SSLContext:
        if self._server_ctx is None:
            raise RuntimeError("no certificate yet for the inbound listener")
        return self._server_ctx

    # -- lifecycle ----------------------------------------------------------------------------

    def track(self, coro: Awaitable[None]) -> asyncio.Future[None]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def bind_listeners(self, *, inbound_only: bool = False) -> dict[str, socket.socket]:
        """Bind every listener now (a port conflict is a start-up error, SPEC §1.3).

        `inbound_only`: just HBONE on 15008, for in-pod mode's "self" listener (ztunnel's own
        workload in its own namespace), which never spoofs the client's address (SPEC §1.1, §4.4)."""
        host = self.bind or ""
        orig_src = self.config.enable_orig_src
        transparent = orig_src is not False
        socks: dict[str, socket.socket] = {}
        try:
            if inbound_only:
                socks["inbound"] = self.sockets.listener(host, HBONE_PORT)
                self.addresses["inbound"] = canonical_addr(socks["inbound"].getsockname())
                return socks
            socks["outbound"] = self.sockets.listener(host, OUTBOUND_PORT, transparent=transparent)
            socks["inbound_plaintext"] = self.sockets.listener(
                host, INBOUND_PLAINTEXT_PORT, transparent=transparent
            )
            socks["inbound"] = self.sockets.listener(host, HBONE_PORT, transparent=transparent)
            if orig_src and not is_transparent(socks["inbound"]):
                raise PermissionError(
                    errno.EPERM, "ENABLE_ORIG_SRC=true but IP_TRANSPARENT was refused (needs CAP_NET_ADMIN)"
                )
            if self.config.enable_socks5:
                shost, sport = self.config.socks5_address
                socks["socks5"] = self.sockets.listener(shost, sport)
        except BaseException:
            for s in socks.values():
                s.close()
            raise
        # Original source preservation (SPEC §4.4) where the reply routing for it exists: in pods,
        # whose redirection the node agent writes, or when asked for with ENABLE_ORIG_SRC=true.
        self.spoof_source = is_transparent(socks["inbound"]) and (
            orig_src is True or (orig_src is None and self.config.proxy_mode == "shared")
        )
        for name, s in socks.items():
            self.addresses[name] = canonical_addr(s.getsockname())
        return socks

    async def serve(self, socks: dict[str, socket.socket]) -> None:
        """Start the accept loops on sockets from `bind_listeners`."""
        loop = asyncio.get_running_loop()
        # The inbound listener needs our certificate; fetch it before accepting.
        with contextlib.suppress(Exception):
            await self.certificate()
        self._refresher = asyncio.get_running_loop().create_task(self._refresh_certificate())
        handlers = {
            "outbound": self._outbound,
            "inbound_plaintext": self._inbound_plaintext,
            "socks5": self._socks5,
        }
        for name, sock in socks.items():
            if name == "inbound":
                await self.hbone_server.serve(sock)  # closed by hbone_server.shutdown
            else:
                handler = handlers[name]
                self._servers.append(
                    await loop.create_server(lambda h=handler: _Accepted(self, h), sock=sock)  # type: ignore[misc]
                )

    async def _refresh_certificate(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                await self.certificate()
            await asyncio.sleep(5.0 if self._server_cert is None else 30.0)

    async def drain(self, deadline: float, *, graceful: bool = True) -> None:
        """Stop accepting, let connections finish for up to `deadline` seconds, then cut the rest
        (SPEC §12.1). HBONE peers get a GOAWAY; a non-graceful drain cuts everything at once."""
        if self._refresher is not None:
            self._refresher.cancel()
        for server in self._servers:
            server.close()
        current = asyncio.current_task()
        pending = [t for t in self._tasks if not t.done() and t is not current]
        if graceful:
            inbound = asyncio.ensure_future(self.hbone_server.shutdown(graceful=True))
            await asyncio.wait([*pending, inbound], timeout=deadline)
            inbound.cancel()
        await self.hbone_server.shutdown(graceful=False)
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.wait(pending, timeout=1.0)
        await self.pool.close()
        self.tracker.close()
        with contextlib.suppress(ValueError):
            self._unsubscribe()

    # -- outbound -----------------------------------------------------------------------------

    async def _dial_hbone(self, key: PoolKey) -> HboneConnection:
        sock = await self.sockets.connect(key.dst, source_ip=key.src_ip, timeout=CONNECT_TIMEOUT)
        cert = await self.secrets.get(key.src_identity)
        return await HboneConnection.open(
            sock,
            cert,
            key.dst_identities,
            self.settings,
            max_streams=self.config.pool_max_streams_per_connection,
        )

    async def _outbound(self, transport: asyncio.Transport, inbox: Inbox) -> None:
        src = canonical_addr(transport.get_extra_info("peername"))
        dst = original_dst(transport.get_extra_info("socket"))
        if _ip(dst[0]).is_loopback and dst[1] in self.illegal:
            connection_failed(
                addr_str(src), addr_str(dst), "outbound", "attempted recursive call to ourselves"
            )
            transport.close()
            return
        up = await self.open_upstream(src, dst)
        if isinstance(up, UpstreamFailure):
            transport.close()
            return
        (upstream, up_inbox), record = up
        await self._carry(transport, upstream, record, down_inbox=inbox, up_inbox=up_inbox)

    async def _carry(
        self,
        downstream: asyncio.Transport,
        upstream: asyncio.Transport,
        record: ConnectionRecord,
        *,
        down_inbox: Inbox | None = None,
        up_inbox: Inbox | None = None,
        authorized: tuple[Connection, str] | None = None,
    ) -> None:
        """Relay until both directions end, then complete the record (metrics and access log).

        `authorized` (what authorization saw, and the local workload's uid) keeps an inbound
        connection under the policy tracker, which cuts it if a policy change now denies it.
        """
        result: RelayResult | None = None
        rejected: list[str] = []
        tracked = None
        if authorized is not None:

            def reject(error: str) -> None:
                rejected.append(error)
                downstream.abort()
                upstream.abort()

            tracked = self.tracker.register(*authorized, reject)
        try:
            result = await relay(
                downstream,
                upstream,
                a_inbox=down_inbox,
                b_inbox=up_inbox,
                on_a_to_b=record.received,
                on_b_to_a=record.sent,
            )
        finally:
            if tracked is not None:
                self.tracker.unregister(tracked)
            if result is None:  # cancelled (drain deadline) or crashed
                record.finish(received=0, sent=0, error="connection closed: drain deadline")
            elif rejected:
                record.finish(received=result.a_to_b, sent=result.b_to_a, error=rejected[0], flags="DENY")
            else:
                # Resets and broken pipes during the copy are normal TCP endings (SPEC §2.7).
                record.finish(received=result.a_to_b, sent=result.b_to_a)

    async def open_upstream(
        self, src: tuple[str, int], dst: tuple[str, int]
    ) -> tuple[tuple[asyncio.Transport, Inbox | None], ConnectionRecord] | UpstreamFailure:
        """Resolve and establish the upstream of an outbound connection (SPEC §3.1 steps 3-6)."""
        src_s, dst_s = addr_str(src), addr_str(dst)
        local = await self.local_workload()
        if local is None:
            err = f"unknown source workload: {self.info.namespace}/{self.info.name}"
            connection_failed(src_s, dst_s, "outbound", err)
            return UpstreamFailure(err, "-", Reply.GENERAL_FAILURE)
        dst_ip = _ip(dst[0])
        r = route(
            self.state,
            local,
            (dst_ip, dst[1]),
            network=self.config.network,
            source_ip=_ip(src[0]),
        )
        if isinstance(r, NoRoute):
            connection_failed(src_s, dst_s, "outbound", r.reason)
            return UpstreamFailure(r.reason, "-", Reply.HOST_UNREACHABLE)
        if r.needs_dns:
            # A workload known by hostname only (SPEC §3.2 B).
            hostname = str(r.next_hop[0])
            try:
                r = r.resolved(await self._resolve_workload(hostname, dst_ip.version))
            except OSError as e:
                err = f"dns: failed to resolve {hostname}: {describe(e)}"
                connection_failed(src_s, dst_s, "outbound", err)
                return UpstreamFailure(err, "-", Reply.HOST_UNREACHABLE)
        mtls = r.protocol is not Protocol.TCP
        own = self.identity(local)
        record = ConnectionRecord(
            self.metrics,
            direction="outbound",
            src_addr=src_s,
            dst_addr=format_addr(*r.next_hop),
            src=Peer(local, _uri(own) if mtls else None),
            dst=Peer(r.workload, _workload_uri(r.workload) if (mtls and r.workload) else None),
            service=r.service,
            hbone_addr=r.authority,
            mtls=mtls,
        )
        try:
            upstream = await self._establish(r, src, local, own)
        except Exception as e:
            fail = classify_upstream_error(e, r.protocol)
            record.finish(received=0, sent=0, error=fail.error, flags=fail.flags)
            return fail
        return upstream, record

    async def _establish(
        self, r: Route, src: tuple[str, int], local: Workload, own: Identity
    ) -> tuple[asyncio.Transport, Inbox | None]:
        """Connect by the route's protocol: TCP, HBONE (pooled), or double HBONE (SPEC §3.1 step 6)."""
        next_hop = (str(r.next_hop[0]), r.next_hop[1])
        if r.protocol is Protocol.TCP:
            return await self.connect_tcp(next_hop)
        assert r.authority is not None
        key = PoolKey(
            src_identity=own,
            dst_identities=_identities(r.expected_identities),
            dst=next_hop,
            src_ip=self.bind,
        )
        forwarded = f'for="{addr_str(src)}"'
        if r.service is not None:
            forwarded += f";host={r.service.hostname}"
        headers = [("forwarded", forwarded), ("traceparent", traceparent())]
        bag = baggage.encode(local)
        if bag:
            headers.insert(0, ("baggage", bag))
        stream = await self.pool.connect(key, r.authority, headers)
        if r.protocol is Protocol.DOUBLE_HBONE:
            stream = await self._inner_tunnel(stream, r, own, headers)
        stream.pause_reading()
        return stream, None

    async def _inner_tunnel(
        self, outer: HboneStream, r: Route, own: Identity, headers: list[tuple[str, str]]
    ) -> HboneStream:
        """Inside the gateway's stream: TLS to the final SANs, HTTP/2, and the inner CONNECT with
        `x-forwarded-network` (SPEC §2.9). The inner connection carries this one stream only."""
        assert r.inner_authority is not None
        try:
            cert = await self.secrets.get(own)
        except BaseException:
            outer.abort()
            raise
        inner = await open_inner(
            outer,
            cert,
            _identities(r.final_identities),
            self.settings,
            max_streams=self.config.pool_max_streams_per_connection,
        )
        try:
            stream = await inner.connect(
                r.inner_authority, [*headers, ("x-forwarded-network", self.config.network)]
            )
        except BaseException:
            inner.abort()
            raise
        inner.close()  # closes (GOAWAY, TLS close_notify, outer END_STREAM) once the stream ends
        return stream

    async def connect_tcp(
        self, addr: tuple[str, int], *, source_ip: str | None = None, transparent: bool = False
    ) -> tuple[asyncio.Transport, Inbox]:
        """A TCP connection from this proxy (from `source_ip`, else its bind address, with its socket
        options; `transparent`: `source_ip` is the client's); what arrives before it is relayed waits
        in its `Inbox`."""
        sock = await self.sockets.connect(
            addr, source_ip=source_ip or self.bind, transparent=transparent, timeout=CONNECT_TIMEOUT
        )
        transport, inbox = await asyncio.get_running_loop().create_connection(Inbox, sock=sock)
        transport.pause_reading()
        return transport, inbox

    # -- SOCKS5 -------------------------------------------------------------------------------

    async def _socks5(self, transport: asyncio.Transport, inbox: Inbox) -> None:
        src = canonical_addr(transport.get_extra_info("peername"))
        hs = Socks5Handshake()
        request: SocksConnect | None = None
        try:
            async with asyncio.timeout(10.0):
                while request is None:
                    await inbox.wait_data()
                    events = hs.receive(inbox.take())
                    out = hs.data_to_send()
                    if out:
                        transport.write(out)
                    for ev in events:
                        if isinstance(ev, HandshakeFailed):
                            log.debug("socks5 handshake failed from %s: %s", addr_str(src), ev.reason)
                            transport.close()
                            return
                        request = ev
        except (EOFError, TimeoutError):
            transport.close()
            return
        assert request is not None
        leftover = hs.leftover
        try:
            dst_ip = await self._resolve(request.host, ipaddress.ip_address(src[0]).version)
        except OSError as e:
            connection_failed(addr_str(src), f"{request.host}:{request.port}", "outbound", f"dns: {e}")
            transport.write(encode_reply(Reply.HOST_UNREACHABLE))
            transport.close()
            return
        up = await self.open_upstream(src, (dst_ip, request.port))
        if isinstance(up, UpstreamFailure):
            transport.write(encode_reply(up.reply))
            transport.close()
            return
        (upstream, up_inbox), record = up
        # Ours (CONTRACT §4): success is only replied once the upstream is established.
        transport.write(encode_reply(Reply.SUCCEEDED))
        if leftover:
            inbox.buffer[:0] = leftover
        await self._carry(transport, upstream, record, down_inbox=inbox, up_inbox=up_inbox)

    async def _resolve_workload(self, hostname: str, version: int) -> IPAddress:
        """A workload's hostname by the system resolver: A and AAAA (A only without IPv6), one
        answer at random, of the dialled family when there is one (SPEC §3.2 B)."""
        family = socket.AF_UNSPEC if self.config.ipv6_enabled else socket.AF_INET
        infos = await asyncio.get_running_loop().getaddrinfo(
            hostname, None, family=family, type=socket.SOCK_STREAM
        )
        addresses = [ipaddress.ip_address(canonical_ip(str(info[4][0]))) for info in infos]
        chosen = pick_resolved(addresses, version)
        if chosen is None:
            raise OSError(f"no addresses for {hostname}")
        return chosen

    async def _resolve(self, host: IPAddress | str, family: int) -> str:
        if not isinstance(host, str):
            return canonical_ip(str(host))
        loop = asyncio.get_running_loop()
        fam = socket.AF_INET6 if family == 6 else socket.AF_INET
        try:
            infos = await loop.getaddrinfo(host, None, family=fam, type=socket.SOCK_STREAM)
        except OSError:
            infos = await loop.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        return canonical_ip(str(infos[0][4][0]))

    # -- inbound HBONE ------------------------------------------------------------------------

    def _inbound_tls_error(self, peer: tuple[str, int], local: tuple[str, int], error: Exception) -> None:
        connection_failed(addr_str(peer), addr_str(local), "inbound", f"tls: {error}")  # canonical already

    async def _inbound(self, req: ConnectRequest) -> None:
        src_s, local_s = addr_str(req.peer_addr), addr_str(req.local_addr)
        if req.method != "CONNECT":
            connection_failed(src_s, local_s, "inbound", f"invalid method: {req.method}")
            req.respond(400)
            return
        target = parse_authority(req.authority)
        if target is None:
            connection_failed(src_s, local_s, "inbound", f"invalid authority: {req.authority!r}")
            req.respond(400)
            return
        local = await self.local_workload()
        if local is None:
            connection_failed(src_s, local_s, "inbound", "unknown local workload")
            req.respond(503)
            return
        local_ip = _ip(req.local_addr[0])
        host, port = target
        tunnel = local.application_tunnel
        service: Service | None = None
        tunnel_target: tuple[IPAddress, int]
        if isinstance(host, str):
            # A hostname authority (inner tunnel through a network gateway, SPEC §4.3): always valid,
            # delivered to our IP on the service's target port.
            found = hostname_target(self.state, local, host, port)
            if found is None:
                connection_failed(src_s, local_s, "inbound", f"unknown service or port: {req.authority}")
                req.respond(503)
                return
            service, resolved_port = found
            tunnel_target = (_service_vip(service, self.config.network) or local_ip, port)
            port = resolved_port
        elif (
            host != local_ip
            and tunnel is None
            and not is_waypoint_for(self.state, local, local_ip, host, self.config.network)
        ):
            err = f"ip mismatch: {local_ip} != {host}"
            connection_failed(src_s, local_s, "inbound", err)
            req.respond(400)
            return
        else:
            tunnel_target = (host, port)
        if port in self.illegal:
            connection_failed(src_s, local_s, "inbound", f"illegal port: {port}")
            req.respond(503)
            return
        # A sandwiched waypoint's app listens on its tunnel port whatever the destination was.
        forward_port = tunnel.port if tunnel is not None and tunnel.port else port
        peer_ip = _ip(req.peer_addr[0])
        via_gateway = (req.headers.get("x-forwarded-network") or "").lower() not in (
            "",
            self.config.network.lower(),
        )
        src_workload = None if via_gateway else self.state.workload_by_addr(self.config.network, peer_ip)
        identity = req.peer_identity
        src_peer = self._peer_from_baggage(src_workload, identity, req.headers.get("baggage"))
        record = ConnectionRecord(
            self.metrics,
            direction="inbound",
            src_addr=src_s,
            dst_addr=local_s,
            src=src_peer,
            dst=Peer(local, _uri(self.identity(local))),
            service=service or self._inbound_service(local, port, req.headers.get("forwarded")),
            hbone_addr=req.authority,
            mtls=True,
        )
        conn = Connection(
            src_ip=peer_ip,
            src_port=req.peer_addr[1],
            dst_ip=local_ip,
            dst_port=forward_port,
            src_principal=_uri(identity) if identity else None,
            src_namespace=identity.namespace if identity else None,
            src_service_account=identity.service_account if identity else None,
            dst_network=self.config.network,
        )
        req.headers.clear()  # read by now; a held connection need not keep them
        decision = authorize(self.state.policies_for(local), conn)
        _log_notes(decision.notes)
        if isinstance(decision, Deny):
            req.respond(401)
            record.finish(
                received=0,
                sent=0,
                error=f"connection closed due to policy rejection: {decision.reason}",
                flags="DENY",
            )
            return
        proxy_tunnel = tunnel is not None and tunnel.protocol is AppTunnelProtocol.PROXY
        app_addr, app_source, spoof = str(local_ip), None, self.spoof_source
        if proxy_tunnel and self.config.localhost_app_tunnel:
            loopback = "::1" if local_ip.version == 6 else "127.0.0.1"
            app_addr, app_source, spoof = loopback, loopback, False
        elif spoof:
            app_source = str(peer_ip)
        try:
            app, app_inbox = await self.connect_tcp(
                (app_addr, forward_port), source_ip=app_source, transparent=spoof
            )
        except Exception as e:
            req.respond(503)
            record.finish(received=0, sent=0, error=f"connect to app: {describe(e)}", flags="CONNECT")
            return
        headers = []
        if self.config.enable_response_baggage:
            bag = baggage.encode(local)
            if bag:
                headers.append(("baggage", bag))
        req.respond(200, headers)
        if proxy_tunnel:
            # The app learns who connected, to what, and the client's identity (SPEC §4.1 step 8).
            client = (peer_ip, req.peer_addr[1])
            app.write(encode_tunnel_header(client, tunnel_target, str(identity) if identity else None))
        await self._carry(req.stream, app, record, up_inbox=app_inbox, authorized=(conn, local.uid))

    def _peer_from_baggage(self, w: Workload | None, identity: Identity | None, header: str | None) -> Peer:
        ident = _uri(identity) if identity else None
        if w is not None or not self.config.enable_response_baggage:
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

    def _inbound_service(self, local: Workload, port: int, forwarded: str | None) -> Service | None:
        """The service a connection was meant for: `forwarded` host= among ours, else by target port."""
        services = self.state.services_of_workload(local)
        host = None
        for part in (forwarded or "").split(";"):
            k, _, v = part.strip().partition("=")
            if k.lower() == "host":
                host = v.strip('"')
        for svc in services:
            if host and svc.hostname == host:
                return svc
        for svc in services:
            if any(t == port for _, t in svc.ports):
                return svc
        return None

    # -- inbound plaintext --------------------------------------------------------------------

    async def _inbound_plaintext(self, transport: asyncio.Transport, inbox: Inbox) -> None:
        src = canonical_addr(transport.get_extra_info("peername"))
        dst = original_dst(transport.get_extra_info("socket"))
        src_s, dst_s = addr_str(src), addr_str(dst)
        if dst[1] in self.illegal:
            connection_failed(src_s, dst_s, "inbound", "attempted recursive call to ourselves")
            transport.close()
            return
        local = await self.local_workload()
        if local is None:
            connection_failed(src_s, dst_s, "inbound", "unknown local workload")
            transport.close()
            return
        src_ip = _ip(src[0])
        dst_ip = _ip(dst[0])
        record = ConnectionRecord(
            self.metrics,
            direction="inbound",
            src_addr=src_s,
            dst_addr=dst_s,
            src=Peer(self.state.workload_by_addr(self.config.network, src_ip)),
            dst=Peer(local),
            service=self._inbound_service(local, dst[1], None),
        )
        conn = Connection(
            src_ip=src_ip, src_port=src[1], dst_ip=dst_ip, dst_port=dst[1], dst_network=self.config.network
        )
        decision = authorize(self.state.policies_for(local), conn)
        _log_notes(decision.notes)
        if isinstance(decision, Deny):
            transport.close()
            record.finish(
                received=0,
                sent=0,
                error=f"connection closed due to policy rejection: {decision.reason}",
                flags="DENY",
            )
            return
        try:
            app, app_inbox = await self.connect_tcp(
                dst, source_ip=src[0] if self.spoof_source else None, transparent=self.spoof_source
            )
        except Exception as e:
            transport.close()
            record.finish(received=0, sent=0, error=f"connect to app: {describe(e)}", flags="CONNECT")
            return
        await self._carry(
            transport, app, record, down_inbox=inbox, up_inbox=app_inbox, authorized=(conn, local.uid)
        )


def _service_vip(service: Service, network: str) -> IPAddress | None:
    """The service's VIP in our network, IPv4 first: the target a hostname authority stands for."""
    vips = sorted((v.address for v in service.vips if v.network == network), key=lambda ip: ip.version)
    return vips[0] if vips else None


# Held connections keep these values for their lifetime: one shared copy each, not one per connection.
@functools.lru_cache(maxsize=4096)
def _identities(uris: tuple[str, ...]) -> tuple[Identity, ...]:
    return tuple(i for i in map(Identity.try_parse, uris) if i is not None)


@functools.lru_cache(maxsize=4096)
def _ip(text: str) -> IPAddress:
    return ipaddress.ip_address(text)


@functools.lru_cache(maxsize=4096)
def _uri(identity: Identity) -> str:
    return str(identity)


@functools.lru_cache(maxsize=4096)
def _workload_uri(workload: Workload) -> str:
    return workload.identity_uri


def _log_notes(notes: tuple[str, ...]) -> None:
    for note in notes:
        log.debug("%s", note)


def parse_authority(authority: str) -> tuple[IPAddress | str, int] | None:
    """`ip:port`, `[v6]:port` or `host:port`; None when it is neither."""
    host, sep, port_s = authority.rpartition(":")
    if not sep or not port_s.isdigit() or not host:
        return None
    port = int(port_s)
    if port > 65535:
        return None
    if host.startswith("[") and host.endswith("]"):
        try:
            return ipaddress.IPv6Address(host[1:-1]), port
        except ValueError:
            return None
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        if ":" in host or not all(c.isalnum() or c in "-._" for c in host):
            return None
        return host, port
    if ip.version == 6:
        return None  # a bare IPv6 literal must be bracketed
    return ip, port


def describe(e: BaseException) -> str:
    if isinstance(e, TimeoutError):
        return "connection timed out"
    return str(e) or type(e).__name__


def classify_upstream_error(e: BaseException, protocol: Protocol) -> UpstreamFailure:
    if isinstance(e, HttpStatusError):
        status = e.status
        reply = {401: Reply.NOT_ALLOWED, 503: Reply.CONNECTION_REFUSED}.get(status, Reply.GENERAL_FAILURE)
        return UpstreamFailure(str(e), "CONNECT", reply)
    if isinstance(e, ConnectionRefusedError):
        return UpstreamFailure(describe(e), "CONNECT", Reply.CONNECTION_REFUSED)
    if isinstance(e, TimeoutError):
        if protocol is Protocol.HBONE:
            return UpstreamFailure(NETWORK_POLICY_HINT, "NETWORK_POLICY", Reply.HOST_UNREACHABLE)
        return UpstreamFailure(describe(e), "CONNECT", Reply.HOST_UNREACHABLE)
    if isinstance(e, OSError):
        return UpstreamFailure(describe(e), "CONNECT", Reply.HOST_UNREACHABLE)
    if isinstance(e, HboneError):
        name = type(e).__name__
        flags = "TLS_FAILURE" if "Tls" in name or "Identity" in name else "CONNECT"
        return UpstreamFailure(str(e), flags, Reply.GENERAL_FAILURE)
    return UpstreamFailure(describe(e), "CONNECT", Reply.GENERAL_FAILURE)
