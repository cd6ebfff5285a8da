"""One proxy instance: the listeners of one workload, built by one factory, served and drained.

`build_proxy` is the one way to make a `ProxyInstance` (a dedicated proxy, in-pod mode's own
inbound listener, each pod's proxy). It binds the listeners of the `listen_plan` (a port conflict
is an `OSError` for the caller to report), then fixes the admission rules (whether the app sees the
client's own address depends on what binding allowed), then builds the one `ProxyContext`, and only
then the listeners (`outbound`, `inbound`, `inbound_passthrough`, `socks5_listener`), which receive
that context and nothing of this module. This is the one module that imports the listeners.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

from hbone.address import canonical_addr
from hbone.identity import Identity
from hbone.relay import Inbox
from hbone.settings import H2Settings
from mesh.model import Workload
from ztunnel import dns
from ztunnel.config.settings import Config, WorkloadInfo, illegal_ports
from ztunnel.decisions.admission import AdmissionRules
from ztunnel.dns.resolver import ResolverSettings
from ztunnel.identity.certificates import SecretManager
from ztunnel.metrics.families import Metrics
from ztunnel.metrics.registry import GaugeCell
from ztunnel.proxy.connections import NO_CONTEXT, ConnectionTracker
from ztunnel.proxy.context import ProxyContext
from ztunnel.proxy.inbound import Inbound
from ztunnel.proxy.inbound_passthrough import InboundPassthrough
from ztunnel.proxy.local import LocalWorkload
from ztunnel.proxy.outbound import Outbound
from ztunnel.proxy.plan import (
    DNS,
    INBOUND,
    INBOUND_PLAINTEXT,
    OUTBOUND,
    SOCKS5,
    ListenSpec,
    bind_address,
    check_transparent,
    listen_plan,
)
from ztunnel.proxy.socks5_listener import Socks5Listener
from ztunnel.proxy.tasks import TaskSet
from ztunnel.proxy.telemetry import ConnectionRecord
from ztunnel.proxy.upstream import Upstreams
from ztunnel.sockets import SocketFactory, is_transparent
from ztunnel.state.store import ProxyState

log = logging.getLogger("ztunnel.proxy")

Handler = Callable[[asyncio.Transport, Inbox], Awaitable[asyncio.Future[Any] | None]]


@dataclass(frozen=True)
class ProxyInputs:
    """What every proxy of a process shares."""

    config: Config
    state: ProxyState
    secrets: SecretManager
    metrics: Metrics


def build_proxy(
    inputs: ProxyInputs, info: WorkloadInfo, sockets: SocketFactory, *, inbound_only: bool = False
) -> ProxyInstance:
    """The proxy of workload `info`, its listeners bound by `sockets` (not yet accepting: `serve`).

    `inbound_only`: just HBONE on 15008 (in-pod mode's listener for ztunnel's own workload)."""
    config = inputs.config
    local = LocalWorkload(config, inputs.state, info)
    plan = listen_plan(config, inbound_only=inbound_only)
    try:
        listening, dns_server = _bind(inputs, local, sockets, plan)
    except BaseException:
        local.close()
        raise
    ctx = proxy_context(
        inputs,
        local,
        sockets,
        spoof_source=not inbound_only and _spoofs_source(config, listening),
        resolver=dns_server.settings if dns_server is not None else None,
    )
    return ProxyInstance(ctx, listening, dns_server)


def proxy_context(
    inputs: ProxyInputs,
    local: LocalWorkload,
    sockets: SocketFactory,
    *,
    spoof_source: bool,
    resolver: ResolverSettings | None = None,
) -> ProxyContext:
    """The context of `local`'s proxy: its rules fixed from the configuration and from what binding
    allowed (`spoof_source`: the app may see the client's own address), its shared pieces new.
    `resolver`: its DNS server's, else the configured one. `build_proxy` makes it once the listeners
    are bound; the listeners' in-process tests make it with sockets of their own."""
    config = inputs.config
    return ProxyContext(
        config=config,
        state=inputs.state,
        secrets=inputs.secrets,
        metrics=inputs.metrics,
        sockets=sockets,
        info=local.info,
        bind=bind_address(config),
        settings=H2Settings(
            stream_window=config.http2_stream_window_size,
            connection_window=config.http2_connection_window_size,
            frame_size=config.http2_frame_size,
        ),
        rules=AdmissionRules(
            network=config.network,
            illegal_ports=illegal_ports(config),
            localhost_app_tunnel=config.localhost_app_tunnel,
            spoof_source=spoof_source,
        ),
        resolver=resolver if resolver is not None else dns.resolver_settings(config, ()),
        local=local,
        tracker=ConnectionTracker(inputs.state),
        tasks=TaskSet(),
        connections=set(),
    )


def _bind(
    inputs: ProxyInputs,
    local: LocalWorkload,
    sockets: SocketFactory,
    plan: tuple[ListenSpec, ...],
) -> tuple[dict[str, socket.socket], dns.DnsServer | None]:
    """Every listener of `plan`, in its order; on a failure none is left open."""
    config = inputs.config
    listening: dict[str, socket.socket] = {}
    dns_server = None
    try:
        for spec in plan:
            if spec.name == DNS:
                dns_server = dns.dns_server(config, inputs.state, local, sockets, inputs.metrics)
                dns_server.bind()
                continue
            sock = listening[spec.name] = sockets.listener(spec.host, spec.port, transparent=spec.transparent)
            check_transparent(config, spec, sock)
    except BaseException:
        for s in listening.values():
            s.close()
        raise
    return listening, dns_server


def _spoofs_source(config: Config, listening: dict[str, socket.socket]) -> bool:
    """Original source preservation where the reply routing for it exists: in pods, whose
    redirection the node agent writes, or when asked for with ENABLE_ORIG_SRC=true."""
    inbound = listening.get(INBOUND)
    orig_src = config.enable_orig_src
    return (
        inbound is not None
        and is_transparent(inbound)
        and (orig_src is True or (orig_src is None and config.proxy_mode == "shared"))
    )


class _Accepted(Inbox):
    """An accepted connection: hands itself to a handler task as soon as it is made."""

    __slots__ = ("_handler", "_sockets_open", "_tasks")

    def __init__(self, tasks: TaskSet, handler: Handler, sockets_open: GaugeCell):
        super().__init__()
        self._tasks = tasks
        self._handler = handler
        self._sockets_open = sockets_open

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        transport = cast(asyncio.Transport, transport)
        # Open until its handling ends: at once when it failed, else when the carried connection does.
        self._sockets_open.inc()
        self._tasks.track(self._handler(transport, self)).add_done_callback(self._handled)

    def _handled(self, task: asyncio.Future[asyncio.Future[Any] | None]) -> None:
        # A bug in one connection's handling must cost that connection only. (A done callback
        # rather than a wrapping coroutine: one coroutine frame less per connection.)
        carried = None
        if task.cancelled():
            if self.transport is not None:
                self.transport.abort()
        elif (error := task.exception()) is not None:
            log.error("connection handling failed", exc_info=error)
            if self.transport is not None:
                self.transport.abort()
        else:
            carried = task.result()
        if carried is not None and not carried.done():
            carried.add_done_callback(self._closed, context=NO_CONTEXT)
        else:
            self._sockets_open.dec()

    def _closed(self, _: object) -> None:
        self._sockets_open.dec()


class ProxyInstance:
    """Bound listeners of one workload (made by `build_proxy`): `serve` them, `drain` them."""

    def __init__(
        self, ctx: ProxyContext, listening: dict[str, socket.socket], dns_server: dns.DnsServer | None
    ) -> None:
        self.ctx = ctx
        self.secrets = ctx.secrets
        self.dns = dns_server
        self.addresses: dict[str, tuple[str, int]] = {
            name: canonical_addr(s.getsockname()) for name, s in listening.items()
        }
        if dns_server is not None:
            self.addresses[DNS] = dns_server.address
        self._listening = listening  # bound, not yet served
        self._servers: list[asyncio.AbstractServer] = []
        self._upstreams = Upstreams(ctx)
        self._inbound = Inbound(ctx)
        self._handlers: dict[str, Handler] = {
            OUTBOUND: Outbound(ctx, self._upstreams).handle,
            INBOUND_PLAINTEXT: InboundPassthrough(ctx).handle,
            SOCKS5: Socks5Listener(ctx, self._upstreams).handle,
        }

    def identity(self, w: Workload | None = None) -> Identity:
        return self.ctx.local.identity(w)

    def own_identity(self) -> Identity:
        """This proxy's identity now: as its workload in the store says, else as configured."""
        return self.ctx.local.own_identity()

    def connections_dump(self) -> dict[str, list[dict[str, str | None]]]:
        """The open connections by direction, as `workloadState` lists a pod's."""
        out: dict[str, list[dict[str, str | None]]] = {"inbound": [], "outbound": []}
        for record in self.ctx.connections:
            dump = record.dump()
            if dump is not None:
                out[record.direction].append(dump)
        for entries in out.values():
            entries.sort(key=lambda e: (e["src"] or "", e["originalDst"] or ""))
        return out

    async def serve(self) -> None:
        """Start accepting on the bound listeners (and the DNS server)."""
        listening, self._listening = self._listening, {}
        if listening:
            # The inbound listener needs our certificate; fetch it before accepting.
            with contextlib.suppress(Exception):
                await self.ctx.credentials()
        if self.dns is not None:
            await self.dns.start()
        loop = asyncio.get_running_loop()
        tasks = self.ctx.tasks
        for name, sock in listening.items():
            if name == INBOUND:
                await self._inbound.server.serve(sock)  # closed by its shutdown
                continue
            handler = self._handlers[name]
            # istio_tcp_sockets_open: accepts towards a destination count as the source's.
            gauge = self.ctx.metrics.sockets_open("destination" if name == INBOUND_PLAINTEXT else "source")
            self._servers.append(
                await loop.create_server(lambda h=handler, g=gauge: _Accepted(tasks, h, g), sock=sock)  # type: ignore[misc]
            )

    async def drain(self, deadline: float, *, graceful: bool = True, end: str | None = None) -> Drained:
        """Stop accepting, let connections finish for up to `deadline` seconds, then cut the rest.
        HBONE peers get a GOAWAY; a non-graceful drain cuts everything at once.

        `end` (a deleted pod's drain: the reason its access-log lines give): every carried connection
        is also ended at once, gracefully, each peer reading what was in flight, then the end of it
        (`ConnectionRecord.carrier`), as is one carried later while the drain runs, and the pool's
        HBONE connections close once their streams have ended (GOAWAY); the deadline then bounds the
        peers' own ends. What that did is counted (`ztunnel_pod_drain_connections_total`) and
        returned."""
        for sock in self._listening.values():
            sock.close()  # bound but never served
        self._listening = {}
        if self.dns is not None:
            await self.dns.close()
        for server in self._servers:
            server.close()
        self._upstreams.drain()
        inbound = self._inbound.server
        drained = Drained()
        if graceful:
            goaway = asyncio.ensure_future(inbound.shutdown(graceful=True))
            if end is None:
                await asyncio.wait([*self.ctx.tasks.pending(), goaway], timeout=deadline)
            else:
                await asyncio.sleep(0)  # the inbound GOAWAYs go out before the streams' ends
                drained = await self._end_all(end, goaway, deadline)
            goaway.cancel()
        await inbound.shutdown(graceful=False)
        # Every task still running now, also connections carried since the drain began.
        pending = self.ctx.tasks.pending()
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.wait(pending, timeout=1.0)
        await self._upstreams.close()
        self.ctx.tracker.close()
        self.ctx.local.close()
        return drained

    async def _end_all(self, reason: str, goaway: asyncio.Future[None], deadline: float) -> Drained:
        """End every carried connection gracefully, and those carried later on (their handlers were
        under way), and close the pool's HBONE connections once idle, until all is done or the
        deadline; then count what closed and what is left to cut."""
        loop = asyncio.get_running_loop()
        until = loop.time() + deadline
        ended: list[ConnectionRecord] = []
        seen: set[ConnectionRecord] = set()
        while True:
            for record in list(self.ctx.connections):
                if record.carrier is not None and record not in seen:
                    seen.add(record)
                    ended.append(record)
                    record.carrier.end(reason)
            self._upstreams.close_gracefully()
            waits = self.ctx.tasks.pending()
            if not goaway.done():
                waits.append(goaway)
            left = until - loop.time()
            if left <= 0 or not waits:
                break
            await asyncio.wait(waits, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        return self._count_ended(ended)

    def _count_ended(self, ending: list[ConnectionRecord]) -> Drained:
        """Of the connections a drain ended, those closed by now and those still open (to be cut)."""
        counts = self.ctx.metrics.pod_drain()
        drained = Drained()
        for record in ending:
            cut = record in self.ctx.connections
            counts.cell((record.direction, "cut" if cut else "closed")).inc()
            if cut:
                drained.cut += 1
            else:
                drained.closed += 1
        return drained


@dataclass
class Drained:
    """What a drain that ended the connections did: closed within the deadline, cut at it."""

    closed: int = 0
    cut: int = 0
