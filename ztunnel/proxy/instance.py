"""One proxy instance: the listeners of one workload, their lifecycle and the workload's identity.

A `ProxyInstance` binds the listeners (a port conflict is a start-up error), serves them, and drains
them. The flows live one module per listener: `outbound` (15001, and the upstream SOCKS5 uses),
`socks5` (15080), `inbound` (15008, HBONE) and `inbound_passthrough` (15006, plaintext); what they
share is here: the proxy's own workload and identity, its server certificate, the TCP dialler with
the proxy's socket options, `admit()` with this proxy's rules, and the task set a drain waits for.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any, cast

from prometheus_client import Gauge

from hbone.address import canonical_addr
from hbone.identity import Identity
from hbone.relay import Inbox
from hbone.settings import H2Settings
from hbone.tls import TlsCredentials
from xds.model import Workload
from ztunnel import dns
from ztunnel.admission import (
    UNKNOWN_LOCAL,
    AdmissionRules,
    Admit,
    InboundRequest,
    Reject,
    admit,
    parse_authority,
)
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
from ztunnel.proxy.connections import NO_CONTEXT, ConnectionTracker
from ztunnel.proxy.inbound import Inbound
from ztunnel.proxy.inbound_passthrough import InboundPassthrough
from ztunnel.proxy.outbound import CONNECT_TIMEOUT, Outbound
from ztunnel.proxy.socks5 import Socks5
from ztunnel.proxy.telemetry import ConnectionRecord
from ztunnel.sockets import SocketFactory, is_transparent
from ztunnel.state import ProxyState

log = logging.getLogger("ztunnel.proxy")

LOCAL_WORKLOAD_WAIT = 5.0


class _Accepted(Inbox):
    """An accepted connection: hands itself to a handler task as soon as it is made."""

    __slots__ = ("_handler", "_instance", "_sockets_open")

    def __init__(
        self,
        instance: ProxyInstance,
        handler: Callable[[asyncio.Transport, Inbox], Awaitable[asyncio.Future[Any] | None]],
        sockets_open: Gauge,
    ):
        super().__init__()
        self._instance = instance
        self._handler = handler
        self._sockets_open = sockets_open

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        transport = cast(asyncio.Transport, transport)
        # Open until its handling ends: at once when it failed, else when the carried connection does.
        self._sockets_open.inc()
        self._instance.track(self._handler(transport, self)).add_done_callback(self._handled)

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
        self._servers: list[asyncio.AbstractServer] = []
        # Handlers running, and connections carried: what a drain waits for, then cancels.
        self._tasks: set[asyncio.Future[Any]] = set()
        self._state_waiters: set[asyncio.Future[None]] = set()
        self.addresses: dict[str, tuple[str, int]] = {}
        # What admission depends on; whether the app sees the client's own address is decided when
        # the listeners are bound.
        self.rules = AdmissionRules(
            network=config.network,
            illegal_ports=self.illegal,
            localhost_app_tunnel=config.localhost_app_tunnel,
        )
        self.tracker = ConnectionTracker(state)
        # Every connection carried now, for `/config_dump` (records leave it when they finish).
        self.open_connections: set[ConnectionRecord] = set()
        self._local: Workload | None = None
        self._local_known = False  # `_local` is current until the store changes
        self._unsubscribe = state.subscribe(self._state_changed)
        self.outbound = Outbound(self)
        self.inbound = Inbound(self)
        # The DNS proxy of this workload, made when the listeners are bound (off with DNS capture off).
        self.dns: dns.DnsServer | None = None
        self._handlers: dict[
            str, Callable[[asyncio.Transport, Inbox], Awaitable[asyncio.Future[Any] | None]]
        ] = {
            "outbound": self.outbound.handle,
            "inbound_plaintext": InboundPassthrough(self).handle,
            "socks5": Socks5(self).handle,
        }

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
        """The proxy's own workload, waiting up to `timeout` for it to appear."""
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
        """This proxy's identity as workload `w` (its trust domain) states it, else as configured."""
        td = (w.trust_domain if w else "") or self.config.trust_domain
        return Identity(td, self.info.namespace, self.info.service_account)

    def own_identity(self) -> Identity:
        """This proxy's identity now: as its workload in the store says, else as configured."""
        return self.identity(self.find_local_workload())

    def trust_domain(self) -> str:
        return self.own_identity().trust_domain

    async def admit(self, request: InboundRequest) -> Admit | Reject:
        """`admit()` with this proxy's rules, waiting (up to 5 s) for its own workload to be known.
        What can be refused without the workload is refused at once."""
        local = self.find_local_workload()
        if self.state.demander is not None:
            await self._fetch_authority(request, local)
        if local is None:
            early = admit(self.state, None, request, self.rules)
            if not (isinstance(early, Reject) and early.reason == UNKNOWN_LOCAL):
                return early
            local = await self.local_workload()
        return admit(self.state, local, request, self.rules)

    def connections_dump(self) -> dict[str, list[dict[str, str]]]:
        """The open connections by direction, as `workloadState` lists a pod's."""
        out: dict[str, list[dict[str, str]]] = {"inbound": [], "outbound": []}
        for record in self.open_connections:
            dump = record.dump()
            if dump is not None:
                out[record.direction].append(dump)
        for entries in out.values():
            entries.sort(key=lambda e: (e["src"], e["originalDst"]))
        return out

    async def _fetch_authority(self, request: InboundRequest, local: Workload | None) -> None:
        """XDS_ON_DEMAND: what a CONNECT's authority names (another address, or a service hostname)
        is asked for before admission looks it up."""
        target = parse_authority(request.authority or "")
        if target is None:
            return
        host = target[0]
        if isinstance(host, str):
            namespace = local.namespace if local is not None else self.info.namespace
            await self.state.fetch_hostname(namespace, host)
        elif host != request.local[0]:
            await self.state.fetch_address(self.config.network, host)

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

    async def credentials(self) -> TlsCredentials:
        """Our own certificate with its TLS contexts (waiting for an in-flight fetch): what the
        inbound listener serves, looked up on every handshake so a rotation is served at once."""
        return await self.secrets.credentials(self.own_identity())

    # -- lifecycle ----------------------------------------------------------------------------

    def track(
        self, coro: Awaitable[asyncio.Future[Any] | None]
    ) -> asyncio.Future[asyncio.Future[Any] | None]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def hold(self, carried: asyncio.Future[Any]) -> asyncio.Future[Any]:
        """A carried connection (`connections.carry`'s future): a drain waits for it, then cuts it."""
        self._tasks.add(carried)
        carried.add_done_callback(self._tasks.discard, context=NO_CONTEXT)
        return carried

    def bind_listeners(self, *, inbound_only: bool = False) -> dict[str, socket.socket]:
        """Bind every listener now (a port conflict is a start-up error).

        `inbound_only`: just HBONE on 15008, for in-pod mode's "self" listener (ztunnel's own
        workload in its own namespace), which never spoofs the client's address."""
        if not self.config.enable_proxy:
            # ENABLE_PROXY=false: no TCP proxy listener; the DNS proxy still runs.
            if self.config.dns_capture and not inbound_only:
                self._bind_dns()
            return {}
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
            if self.config.dns_capture:
                self._bind_dns()
        except BaseException:
            for s in socks.values():
                s.close()
            raise
        # Original source preservation where the reply routing for it exists: in pods,
        # whose redirection the node agent writes, or when asked for with ENABLE_ORIG_SRC=true.
        spoof = is_transparent(socks["inbound"]) and (
            orig_src is True or (orig_src is None and self.config.proxy_mode == "shared")
        )
        self.rules = replace(self.rules, spoof_source=spoof)
        for name, s in socks.items():
            self.addresses[name] = canonical_addr(s.getsockname())
        return socks

    def _bind_dns(self) -> None:
        server = dns.dns_server(self.config, self.state, self, self.sockets, self.metrics)
        server.bind()
        self.dns = server
        self.addresses["dns"] = server.address

    async def serve(self, socks: dict[str, socket.socket]) -> None:
        """Start the accept loops on sockets from `bind_listeners`."""
        if not socks:
            if self.dns is not None:
                await self.dns.start()
            return
        loop = asyncio.get_running_loop()
        # The inbound listener needs our certificate; fetch it before accepting.
        with contextlib.suppress(Exception):
            await self.credentials()
        if self.dns is not None:
            await self.dns.start()
        for name, sock in socks.items():
            if name == "inbound":
                await self.inbound.server.serve(sock)  # closed by its shutdown
            else:
                handler = self._handlers[name]
                # istio_tcp_sockets_open: accepts towards a destination count as the source's.
                gauge = self.metrics.sockets_open("destination" if name == "inbound_plaintext" else "source")
                self._servers.append(
                    await loop.create_server(lambda h=handler, g=gauge: _Accepted(self, h, g), sock=sock)  # type: ignore[misc]
                )

    async def drain(self, deadline: float, *, graceful: bool = True) -> None:
        """Stop accepting, let connections finish for up to `deadline` seconds, then cut the rest.
        HBONE peers get a GOAWAY; a non-graceful drain cuts everything at once."""
        if self.dns is not None:
            await self.dns.close()
        for server in self._servers:
            server.close()
        current = asyncio.current_task()
        pending = [t for t in self._tasks if not t.done() and t is not current]
        if graceful:
            inbound = asyncio.ensure_future(self.inbound.server.shutdown(graceful=True))
            await asyncio.wait([*pending, inbound], timeout=deadline)
            inbound.cancel()
        await self.inbound.server.shutdown(graceful=False)
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.wait(pending, timeout=1.0)
        await self.outbound.close()
        self.tracker.close()
        with contextlib.suppress(ValueError):
            self._unsubscribe()
