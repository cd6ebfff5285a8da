"""The upstream of every outbound connection (of 15001 and of SOCKS5 alike), and why one fails.

`Upstreams.open` takes the source and the destination: the source workload (waiting for it), the
route (`route()`), a workload hostname's address, then the connection by the route's protocol:
plain TCP, an HBONE stream from the pool (to the workload, or to its waypoint with the original
destination as `:authority`), or double HBONE through a network gateway (TLS + HTTP/2 inside a
pooled stream). The HBONE connections come from a `Tunnels` (`HboneTunnels`: TCP, TLS 1.3,
HTTP/2): with `ProxyContext.connect_tcp` and the system resolver, where this module meets the
network. Failures are classified once, by type, into an `UpstreamFailure` naming the access log's
error, its response flag and the kind of failure (what a SOCKS5 client is told). As the reference,
every HTTP/2-level failure of an HBONE upstream (no SETTINGS after TLS, a reset CONNECT stream, a
closed or GOAWAY'd connection) is `H2_HANDSHAKE_FAILURE`.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import socket
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol as TypingProtocol

from hbone.address import canonical_host, format_addr, parse_ip
from hbone.client import HboneConnection
from hbone.errors import (
    CertificateRevoked,
    ConnectionClosed,
    H2HandshakeError,
    HboneError,
    HttpStatusError,
    StreamResetError,
    TlsHandshakeError,
)
from hbone.identity import Identity, uri_of
from hbone.inner import open_inner
from hbone.pool import Pool, PooledConnection, PoolKey
from hbone.relay import Inbox
from hbone.stream import HboneStream
from hbone.tls import TlsCredentials
from mesh.model import IPAddress, Workload
from ztunnel.decisions.rejection import RejectionKind, kind_of_status
from ztunnel.decisions.route import NoRoute, Protocol, Route, pick_resolved, route
from ztunnel.metrics.traffic import UNKNOWN
from ztunnel.proxy import baggage
from ztunnel.proxy.context import CONNECT_TIMEOUT, ProxyContext
from ztunnel.proxy.telemetry import ConnectionRecord, Peer, connection_failed, new_span_id, new_trace_id

# How `workloadState` spells an outbound connection's protocol (as the reference).
DUMP_PROTOCOL = {Protocol.TCP: "TCP", Protocol.HBONE: "HBONE", Protocol.DOUBLE_HBONE: "DOUBLEHBONE"}

NETWORK_POLICY_HINT = "connection timed out, maybe a NetworkPolicy is blocking HBONE port 15008"


@dataclass(frozen=True, slots=True)
class UpstreamFailure:
    """Why an upstream could not be established: the access log's error and response flag, and its
    kind (what a SOCKS5 client is told)."""

    error: str
    flags: str
    kind: RejectionKind


@dataclass(slots=True)
class Upstream:
    transport: asyncio.Transport
    inbox: Inbox | None  # bytes that arrived before the relay starts (TCP upstreams)
    record: ConnectionRecord


def traceparent(trace: str) -> str:
    """A W3C `traceparent` of trace `trace` (32 hex digits) with a new span id, not sampled."""
    return f"00-{trace}-{new_span_id()}-00"


def describe(e: BaseException) -> str:
    if isinstance(e, TimeoutError):
        return "connection timed out"
    return str(e) or type(e).__name__


def classify_upstream_error(e: BaseException, protocol: Protocol) -> UpstreamFailure:
    """The one mapping from an exception raised while establishing an upstream to its failure."""
    if isinstance(e, HttpStatusError):
        return UpstreamFailure(str(e), "CONNECT", kind_of_status(e.status))
    if isinstance(e, ConnectionRefusedError):
        return UpstreamFailure(describe(e), "CONNECT", RejectionKind.REFUSED)
    if isinstance(e, TimeoutError):
        if protocol is Protocol.HBONE:
            return UpstreamFailure(NETWORK_POLICY_HINT, "NETWORK_POLICY", RejectionKind.UNREACHABLE)
        return UpstreamFailure(describe(e), "CONNECT", RejectionKind.UNREACHABLE)
    if isinstance(e, CertificateRevoked):  # a CRL in force lists the server's chain
        return UpstreamFailure(str(e), "CERT_REVOKED", RejectionKind.FAILED)
    if isinstance(e, TlsHandshakeError):  # IdentityMismatch included
        return UpstreamFailure(str(e), "TLS_FAILURE", RejectionKind.FAILED)
    if isinstance(e, H2HandshakeError):  # TLS done, but no HTTP/2 connection came of it
        return UpstreamFailure(str(e), "H2_HANDSHAKE_FAILURE", RejectionKind.FAILED)
    if isinstance(e, StreamResetError | ConnectionClosed):  # the HTTP/2 layer failed the CONNECT
        return UpstreamFailure(str(e), "H2_HANDSHAKE_FAILURE", RejectionKind.UNREACHABLE)
    if isinstance(e, OSError):
        return UpstreamFailure(describe(e), "CONNECT", RejectionKind.UNREACHABLE)
    if isinstance(e, HboneError):
        return UpstreamFailure(str(e), "CONNECT", RejectionKind.FAILED)
    return UpstreamFailure(describe(e), "CONNECT", RejectionKind.FAILED)


class Tunnels(TypingProtocol):
    """The HBONE edge of the outbound side: what makes the connections the pool holds and the inner
    connection of double HBONE. `HboneTunnels` makes them for real (TCP, TLS 1.3, HTTP/2); the
    listeners' playbook tests give a fake peer instead."""

    async def dial(self, key: PoolKey) -> PooledConnection:
        """A new HBONE connection to `key.dst`, as `key.src_identity`, to one of `key.dst_identities`."""
        ...

    async def inner(
        self, outer: HboneStream, credentials: TlsCredentials, expected: tuple[Identity, ...]
    ) -> PooledConnection:
        """Double HBONE: TLS to one of `expected` and HTTP/2 inside the established `outer` stream."""
        ...


class HboneTunnels:
    """`Tunnels` over the network: the proxy's sockets, its certificates and HTTP/2 settings."""

    def __init__(self, ctx: ProxyContext) -> None:
        self.ctx = ctx

    async def dial(self, key: PoolKey) -> HboneConnection:
        ctx = self.ctx
        sock = await ctx.sockets.connect(key.dst, source_ip=key.src_ip, timeout=CONNECT_TIMEOUT)
        credentials = await ctx.secrets.credentials(key.src_identity)
        return await HboneConnection.open(
            sock,
            credentials,
            key.dst_identities,
            ctx.settings,
            max_streams=ctx.config.pool_max_streams_per_connection,
        )

    async def inner(
        self, outer: HboneStream, credentials: TlsCredentials, expected: tuple[Identity, ...]
    ) -> HboneConnection:
        ctx = self.ctx
        return await open_inner(
            outer, credentials, expected, ctx.settings, max_streams=ctx.config.pool_max_streams_per_connection
        )


class Upstreams:
    """The upstreams of one proxy's outbound connections, and the HBONE pool they share.

    `tunnels` makes the HBONE connections (`HboneTunnels` unless given); `clock` is the pool's, which
    releases a connection not checked out for `POOL_UNUSED_RELEASE_TIMEOUT`."""

    def __init__(
        self,
        ctx: ProxyContext,
        *,
        tunnels: Tunnels | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ctx = ctx
        config = ctx.config
        self.tunnels = tunnels if tunnels is not None else HboneTunnels(ctx)
        # Every HBONE connection dialled for the pool, while it lives (`close_gracefully`).
        self._dialed: weakref.WeakSet[PooledConnection] = weakref.WeakSet()
        self.pool: Pool[PooledConnection] = Pool(
            self._dial,
            max_streams=config.pool_max_streams_per_connection,
            idle_timeout=config.pool_unused_release_timeout,
            clock=clock,
        )

    async def open(
        self, src: tuple[str, int], dst: tuple[str, int], early: Inbox | None = None
    ) -> Upstream | UpstreamFailure:
        """Resolve and establish the upstream of an outbound connection: the source workload (waiting
        for it), the route, a workload hostname's address, then the connection itself.

        `early`: the accepted connection's inbox. On an HBONE route what the app has sent by the time
        the CONNECT goes out rides with it (one TLS record, one write, and no round trip before the
        first bytes); the server holds them until it answers 200 and drops them otherwise (then
        the app's connection is closed anyway)."""
        ctx = self.ctx
        src_s, dst_s = format_addr(*src), format_addr(*dst)
        local = await ctx.local.local_workload()
        if local is None:
            err = f"unknown source workload: {ctx.info.namespace}/{ctx.info.name}"
            connection_failed(src_s, dst_s, "outbound", err)
            return UpstreamFailure(err, "-", RejectionKind.FAILED)
        dst_ip = parse_ip(dst[0])
        # XDS_ON_DEMAND: an address the store lacks (and its waypoint) is asked for first (a no-op
        # otherwise).
        await ctx.state.fetch_destination(ctx.config.network, dst_ip, local.namespace)
        r = route(ctx.state, local, (dst_ip, dst[1]), network=ctx.config.network, source_ip=parse_ip(src[0]))
        if isinstance(r, NoRoute):
            connection_failed(src_s, dst_s, "outbound", r.reason)
            return UpstreamFailure(r.reason, "-", RejectionKind.UNREACHABLE)
        if r.needs_dns:
            # A workload known by hostname only.
            hostname = str(r.next_hop[0])
            ctx.metrics.dns().on_demand.cell(
                on_demand_labels(local, uri_of(ctx.local.identity(local)), hostname)
            ).inc()
            try:
                r = r.resolved(await self._resolve_workload(hostname, dst_ip.version))
            except OSError as e:
                err = f"dns: failed to resolve {hostname}: {describe(e)}"
                connection_failed(src_s, dst_s, "outbound", err)
                return UpstreamFailure(err, "-", RejectionKind.UNREACHABLE)
        mtls = r.protocol is not Protocol.TCP
        own = ctx.local.identity(local)
        trace = new_trace_id()  # sent on in `traceparent`: the server proxy logs it too
        next_hop_s = format_addr(*r.next_hop)
        record = ConnectionRecord(
            ctx.metrics,
            direction="outbound",
            src_addr=src_s,
            dst_addr=next_hop_s,
            src=Peer(local, uri_of(own) if mtls else None),
            dst=Peer(r.workload, _workload_uri(r.workload) if (mtls and r.workload) else None),
            service=r.service,
            hbone_addr=r.authority,
            mtls=mtls,
            spans=(("outbound", {"id": trace}),),
            registry=ctx.connections,
            dump_as=(dst_s, next_hop_s, DUMP_PROTOCOL[r.protocol]),
        )
        try:
            transport, inbox = await self._establish(r, src, local, own, trace, early)
        except Exception as e:
            fail = classify_upstream_error(e, r.protocol)
            record.finish(received=0, sent=0, error=fail.error, flags=fail.flags)
            return fail
        return Upstream(transport, inbox, record)

    async def _establish(
        self, r: Route, src: tuple[str, int], local: Workload, own: Identity, trace: str, early: Inbox | None
    ) -> tuple[asyncio.Transport, Inbox | None]:
        """Connect by the route's protocol: TCP, HBONE (pooled), or double HBONE."""
        next_hop = (str(r.next_hop[0]), r.next_hop[1])
        if r.protocol is Protocol.TCP:
            return await self.ctx.connect_tcp(next_hop)
        assert r.authority is not None
        key = PoolKey(
            src_identity=own,
            dst_identities=_identities(r.expected_identities),
            dst=next_hop,
            src_ip=self.ctx.bind,
        )
        forwarded = f'for="{format_addr(*src)}"'
        if r.service is not None:
            forwarded += f";host={r.service.hostname}"
        headers = [("forwarded", forwarded), ("traceparent", traceparent(trace))]
        bag = baggage.encode(local)
        if bag:
            headers.insert(0, ("baggage", bag))
        # Double HBONE: the app's bytes belong inside the inner tunnel, which is not up yet.
        early_data = early.forward_early() if early is not None and r.protocol is Protocol.HBONE else b""
        stream = await self.pool.connect(key, r.authority, headers, early_data)
        if r.protocol is Protocol.DOUBLE_HBONE:
            stream = await self._inner_tunnel(stream, r, own, headers)
        stream.pause_reading()
        return stream, None

    async def _inner_tunnel(
        self, outer: HboneStream, r: Route, own: Identity, headers: list[tuple[str, str]]
    ) -> HboneStream:
        """Inside the gateway's stream: TLS to the final SANs, HTTP/2, and the inner CONNECT with
        `x-forwarded-network`. The inner connection carries this one stream only."""
        assert r.inner_authority is not None
        ctx = self.ctx
        try:
            credentials = await ctx.secrets.credentials(own)
        except BaseException:
            outer.abort()
            raise
        inner = await self.tunnels.inner(outer, credentials, _identities(r.final_identities))
        try:
            stream = await inner.connect(
                r.inner_authority, [*headers, ("x-forwarded-network", ctx.config.network)]
            )
        except BaseException:
            inner.abort()
            raise
        inner.close()  # closes (GOAWAY, TLS close_notify, outer END_STREAM) once the stream ends
        return stream

    async def _resolve_workload(self, hostname: str, version: int) -> IPAddress:
        """A workload's hostname by the system resolver: A and AAAA (A only without IPv6), one
        answer at random, of the dialled family when there is one."""
        family = socket.AF_UNSPEC if self.ctx.config.ipv6_enabled else socket.AF_INET
        infos = await asyncio.get_running_loop().getaddrinfo(
            hostname, None, family=family, type=socket.SOCK_STREAM
        )
        addresses = [ipaddress.ip_address(canonical_host(str(info[4][0]))) for info in infos]
        chosen = pick_resolved(addresses, version)
        if chosen is None:
            raise OSError(f"no addresses for {hostname}")
        return chosen

    async def _dial(self, key: PoolKey) -> PooledConnection:
        conn = await self.tunnels.dial(key)
        self._dialed.add(conn)
        return conn

    def drain(self) -> None:
        """No new HBONE connections: connections still being established use the pooled ones."""
        self.pool.drain()

    def close_gracefully(self) -> None:
        """Every HBONE connection of the pool takes no new stream and closes (GOAWAY) once its
        streams have ended (a deleted pod's: they carry its identity)."""
        for conn in list(self._dialed):
            conn.close()

    async def close(self) -> None:
        await self.pool.close()


# Held connections keep these values for their lifetime: one shared copy each, not one per connection.
@functools.lru_cache(maxsize=4096)
def on_demand_labels(local: Workload, principal: str, hostname: str) -> tuple[str, ...]:
    """The `istio_on_demand_dns_total` labels: the source workload's, then the hostname."""
    src = Peer(local, principal)
    return tuple(
        v or UNKNOWN
        for v in (
            src.workload_name,
            src.app,
            src.version,
            src.ns,
            principal,
            src.app,
            src.version,
            src.cluster_id,
            hostname,
        )
    )


@functools.lru_cache(maxsize=4096)
def _identities(uris: tuple[str, ...]) -> tuple[Identity, ...]:
    return tuple(i for i in map(Identity.try_parse, uris) if i is not None)


@functools.lru_cache(maxsize=4096)
def _workload_uri(workload: Workload) -> str:
    return workload.identity_uri
