"""The Delta ADS client: the proxy's xDS stream to a control plane (its gRPC channel, credentials
and node identity, shared with the CA client, are `xds.channel`'s).

`XdsClient.run()` keeps one `DeltaAggregatedResources` stream open, reconnecting with the reference's
backoff (from 10 ms, doubling up to 15 s on errors, reset when the stream ended cleanly), until `close()`. On every (re)connect it subscribes, wildcard, to each type of
`xds.resources` in turn (Address then Authorization), listing the resources it holds in
`initial_resource_versions` as far as the request stays within the control plane's message limit
(`xds.resume`: 4 MiB, or less when the control plane said so refusing one; what it leaves out comes
again, and is removed if the first answer does not carry it). Each response is decoded and converted
by its type's registration (from 64 KiB of payload on a thread, so that a huge push does not stall
the loop), applied to the store, on the loop, as one batch (the resources that fail are left out
and named in the NACK, the rest are applied), and answered with an ACK or a NACK carrying only the type
URL and nonce. Readiness: once the first response of each watched type has been answered,
`wait_synced()` returns and `on_synced` is called.

The store is anything with the `xds.resources.XdsStore` methods (`ztunnel.state.store.ProxyState`);
metrics go to an optional `XdsMetrics` hook. The clock's only use, the backoff sleep, is injectable.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

from google.protobuf.message import DecodeError

from xds.channel import (
    CONNECT_TIMEOUT,
    AuthToken,
    ControlPlaneAddress,
    ControlPlaneError,
    call_metadata,
    open_channel,
)

# The control plane's server takes the client's limit from here (a large file fails on neither side).
from xds.channel import MAX_MESSAGE_BYTES as MAX_MESSAGE_BYTES
from xds.gen.envoy.config.core.v3 import base_pb2
from xds.gen.envoy.service.discovery.v3 import discovery_pb2
from xds.gen.google.rpc import status_pb2
from xds.grpc.connection import Call
from xds.grpc.wire import RpcError, Status, StatusCode
from xds.resources import ADDRESS, BY_URL, TYPES, Rejection, ResourceType, XdsStore
from xds.resume import MAX_REQUEST_BYTES, InitialRequest, initial_request, refused_limit, stale

log = logging.getLogger(__name__)

INITIAL_BACKOFF = 0.010
MAX_BACKOFF = 15.0
# How long an on-demand lookup waits for the control plane before the caller re-reads the store
# and goes on without the resource, as the reference's demand wait.
ON_DEMAND_TIMEOUT = 5.0

# Metric label values of `istio_xds_connection_terminations_total{reason}`.
CONNECTION_ERROR = "ConnectionError"
ERROR = "Error"
RECONNECT = "Reconnect"
COMPLETE = "Complete"

DELTA_ADS_PATH = "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources"

_RECONNECT_CODES = (StatusCode.UNKNOWN, StatusCode.CANCELLED, StatusCode.DEADLINE_EXCEEDED)
_RECONNECT_MESSAGES = ("transport is closing", "received prior goaway")


# --- what the client needs from the proxy -------------------------------------------------------


class XdsMetrics(Protocol):
    """Hook for `istio_xds_message_total`, `istio_xds_message_bytes_total` and
    `istio_xds_connection_terminations_total`."""

    def message(self, type_url: str, n_bytes: int) -> None: ...
    def termination(self, reason: str) -> None: ...


# --- the stream ---------------------------------------------------------------------------------


class ConnectionFailed(Exception):
    """The channel did not connect (or its credentials could not be read): back off."""


class StreamStatus(Exception):
    """The stream ended with a non-OK gRPC status."""

    def __init__(self, code: StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


def reconnect_delay(end: BaseException | None, backoff: float) -> tuple[str, float]:
    """How a stream ended -> (termination reason, delay before the next attempt).

    `end` is None for a clean end; the next backoff is `max(delay, INITIAL_BACKOFF)`. Any failure
    but the server's own hints to reconnect backs off, an unexpected exception included: never a
    loop of full pushes against the control plane.
    """
    if end is None:
        return COMPLETE, 0.0
    if isinstance(end, ConnectionFailed):
        return CONNECTION_ERROR, min(MAX_BACKOFF, backoff * 2)
    if isinstance(end, StreamStatus) and (
        end.code in _RECONNECT_CODES
        or (end.code is StatusCode.UNAVAILABLE and any(m in end.details for m in _RECONNECT_MESSAGES))
    ):
        return RECONNECT, INITIAL_BACKOFF
    return ERROR, min(MAX_BACKOFF, backoff * 2)


# A resource as converted: its model value, or why it is refused.
Converted = object | Rejection
# From this many payload bytes a response is converted on a thread (a few hundred workloads or CIDRs
# convert in well under a millisecond: not worth the hop).
THREADED_CONVERSION_BYTES = 64 * 1024


@contextlib.contextmanager
def _collector_paused(paused: bool, *, freeze: bool) -> Iterator[None]:
    """The cyclic garbage collector off while a big response is converted and applied. The first
    push of a cluster makes millions of objects, none of them in a cycle, and each collection of the
    oldest generation on the way walks all of them: a third of the time applying 100,000 workloads
    took. With `freeze` (the initial state), what it made is the store, long-lived: frozen at the
    end, out of the collector's sight (still freed as usual when nothing refers to it), so that the
    next full collection does not walk it either, a 0.3 to 0.5 s stall of this loop just as the
    workers are told the state is there. Only then: a cycle that is garbage when it is frozen is
    never collected, and this is once per process."""
    if not paused or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        if freeze:
            gc.freeze()
        gc.enable()


def _payload_bytes(response: discovery_pb2.DeltaDiscoveryResponse) -> int:
    return sum(len(r.resource.value) for r in response.resources)


def _convert_all(rtype: ResourceType[Any], response: discovery_pb2.DeltaDiscoveryResponse) -> list[Converted]:
    """Decode and convert every resource of a response of type `rtype`; pure (no store)."""
    return [
        rtype.convert(r.name, r.resource.value if r.HasField("resource") else None)
        for r in response.resources
    ]


class XdsClient:
    """One proxy's Delta ADS stream, applied to one store (see the module docstring)."""

    def __init__(
        self,
        address: str,
        state: XdsStore,
        node: base_pb2.Node,
        *,
        root_ca: str | None = None,
        alt_hostname: str | None = None,
        token: AuthToken | None = None,
        cluster_id: str = "Kubernetes",
        headers: Sequence[tuple[str, str]] = (),
        on_demand: bool = False,
        metrics: XdsMetrics | None = None,
        on_synced: Callable[[], None] | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        connect_timeout: float = CONNECT_TIMEOUT,
        request_limit: int = MAX_REQUEST_BYTES,
    ) -> None:
        """`address`: `http://host:port` or `https://host:port` (raises ControlPlaneError when
        invalid); `root_ca`: the `XDS_ROOT_CA` setting (path, `SYSTEM` or PEM) for https;
        `request_limit`: the largest initial request sent (`xds.resume`)."""
        self.address = ControlPlaneAddress.parse(address)
        self._state = state
        self._node = node
        self._root_ca = root_ca
        self._alt_hostname = alt_hostname
        self._token = token
        self._cluster_id = cluster_id
        self._headers = tuple(headers)
        self._on_demand = on_demand
        self._metrics = metrics
        self._on_synced = on_synced
        self._sleep = sleep
        self._connect_timeout = connect_timeout
        self._request_limit = request_limit
        # Type URL -> the held resources the current stream's initial request did not list, until
        # the answer to it is applied (`xds.resume`).
        self._unlisted: dict[str, frozenset[str]] = {}
        # name -> version of the resources applied, by type: sent on reconnect.
        self._versions: dict[str, dict[str, str]] = {t.type_url: {} for t in TYPES}
        # A type subscribed by name may never be answered: readiness waits for the wildcard ones.
        self._awaiting_first = {t.type_url for t in TYPES if not (on_demand and t.on_demand)}
        self._synced = asyncio.Event()
        self._demanded: dict[tuple[str, str], list[asyncio.Future[None]]] = {}
        self._arrival_checks: dict[asyncio.Future[None], Callable[[], bool]] = {}
        self._call: Call | None = None
        self._write_lock = asyncio.Lock()
        self._run_task: asyncio.Task[None] | None = None
        self._closed = False
        self.connections = 0  # streams opened so far (for logs and tests)

    # --- public ---

    @property
    def synced(self) -> bool:
        return self._synced.is_set()

    async def wait_synced(self) -> None:
        """Return once the first response of every watched type has been ACKed or NACKed."""
        await self._synced.wait()

    def resource_versions(self, type_url: str) -> dict[str, str]:
        """The name -> version of the resources of `type_url` applied so far."""
        return dict(self._versions.get(type_url, {}))

    async def run(self) -> None:
        """Keep the stream up until `close()` (or cancellation)."""
        self._run_task = asyncio.current_task()
        backoff = INITIAL_BACKOFF
        try:
            while not self._closed:
                end: BaseException | None = None
                try:
                    await self._stream_once()
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    end = e
                reason, delay = reconnect_delay(end, backoff)
                backoff = max(delay, INITIAL_BACKOFF)
                self._log_end(reason, end, delay)
                if self._metrics is not None:
                    self._metrics.termination(reason)
                if delay > 0:
                    await self._sleep(delay)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not self._closed or task is None:
                raise
            task.uncancel()  # our own close(): a normal end

    async def close(self) -> None:
        """Stop `run()` and wait for it to end; pending `demand()` calls are cancelled."""
        self._closed = True
        task = self._run_task
        if task is not None and task is not asyncio.current_task() and not task.done():
            task.cancel()
            await asyncio.wait([task])
        for waiters in self._demanded.values():
            for fut in waiters:
                fut.cancel()
        self._demanded.clear()

    async def demand(
        self,
        name: str,
        type_url: str = ADDRESS.type_url,
        *,
        arrived: Callable[[], bool] | None = None,
        timeout: float | None = ON_DEMAND_TIMEOUT,
    ) -> bool:
        """On-demand mode: subscribe to `name` and return True once a resource or a removal of
        exactly that name has been applied, or once `arrived()` holds after a response was applied
        (the control plane may answer `network/ip` with resources named by their uid); False after
        `timeout` seconds without either."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        key = (type_url, name)
        self._demanded.setdefault(key, []).append(fut)
        if arrived is not None:
            self._arrival_checks[fut] = arrived
        # Also listed on reconnect, so the subscription survives a new stream.
        self._versions.setdefault(type_url, {}).setdefault(name, "")
        try:
            call = self._call
            if call is not None:
                request = discovery_pb2.DeltaDiscoveryRequest(
                    type_url=type_url, resource_names_subscribe=[name]
                )
                with contextlib.suppress(Exception):  # a broken stream resubscribes on reconnect
                    await self._write(call, request)
            try:
                async with asyncio.timeout(timeout):
                    await fut
            except TimeoutError:
                return False
            return True
        finally:
            self._arrival_checks.pop(fut, None)
            waiters = self._demanded.get(key)
            if waiters is not None and fut in waiters:
                waiters.remove(fut)
                if not waiters:
                    del self._demanded[key]

    # --- one stream ---

    def initial_requests(self) -> list[discovery_pb2.DeltaDiscoveryRequest]:
        """What a new stream starts with: each type in turn, Address then Authorization, each listing
        what it holds as far as the request stays within the limit (`xds.resume`)."""
        return [opening.request for opening in self._openings()]

    def _openings(self) -> list[InitialRequest]:
        return [
            initial_request(
                self._node,
                rtype.type_url,
                self._versions.get(rtype.type_url, {}),
                on_demand=self._on_demand and rtype.on_demand,
                limit=self._request_limit,
            )
            for rtype in TYPES
        ]

    async def _stream_once(self) -> None:
        try:
            channel = open_channel(
                self.address, self._root_ca, self._alt_hostname, connect_timeout=self._connect_timeout
            )
            metadata = call_metadata(self._token, self._cluster_id, self._headers)
        except ControlPlaneError as e:
            raise ConnectionFailed(str(e)) from None
        try:
            try:
                call = await channel.stream(DELTA_ADS_PATH, metadata)
            except RpcError as e:
                raise ConnectionFailed(e.details or e.code.name) from None
            try:
                await self._converse(call)
            except RpcError as e:
                self._heed_refusal(e)
                raise StreamStatus(e.code, e.details) from None
            finally:
                self._call = None
                call.cancel()
        finally:
            await channel.close()

    def _heed_refusal(self, error: RpcError) -> None:
        """A control plane that refused a request as over its receive limit: stay within it."""
        limit = refused_limit(error.code, error.details)
        if limit is None or limit >= self._request_limit:
            return
        self._request_limit = limit
        log.warning(
            "the control plane refused a request over its message limit: initial requests now stay within it",
            extra={"fields": {"limit": limit}},
        )

    async def _converse(self, call: Call) -> None:
        self.connections += 1
        self._call = call
        self._unlisted.clear()
        for opening in self._openings():
            request = opening.request
            fields = {"type_url": request.type_url, "resources": len(request.initial_resource_versions)}
            if opening.cut:
                log.info(
                    "initial request cut to the message limit: the resources left out are sent again",
                    extra={"fields": {**fields, "held": opening.held, "limit": self._request_limit}},
                )
                self._left_out(request.type_url, opening.unlisted)
            else:
                log.debug("sending initial request", extra={"fields": fields})
            await self._write(call, request)
        log.info("Stream established", extra={"fields": {"address": self.address.target}})
        while True:
            message = await call.read()  # raises RpcError for a status other than OK
            if message is None:
                return
            try:
                response = discovery_pb2.DeltaDiscoveryResponse.FromString(message)
            except DecodeError as e:
                raise RpcError(Status(StatusCode.INTERNAL, f"undecodable response: {e}")) from None
            converted = None
            rtype = BY_URL.get(response.type_url)
            big = len(message) >= THREADED_CONVERSION_BYTES
            with _collector_paused(big, freeze=not self._synced.is_set()):
                if big and rtype is not None:
                    # Decoding and converting are pure: a big push (a policy of 100k CIDRs) is
                    # converted on a thread, so that the loop keeps running beside it; the store is
                    # still changed here, on the loop.
                    converted = await asyncio.to_thread(_convert_all, rtype, response)
                reply = self.handle_response(response, converted)
            await self._write(call, reply)
            self._answered(response.type_url)

    async def _write(self, call: Call, request: discovery_pb2.DeltaDiscoveryRequest) -> None:
        async with self._write_lock:
            try:
                await call.write(request.SerializeToString())
            except RpcError:
                if call.state.status is not None and call.state.status.code is StatusCode.OK:
                    return  # the server ended the stream cleanly: the reader sees its end next
                raise

    def _answered(self, type_url: str) -> None:
        if type_url not in self._awaiting_first:
            return
        self._awaiting_first.discard(type_url)
        if not self._awaiting_first and not self._synced.is_set():
            log.info("initial xDS state applied")
            self._synced.set()
            if self._on_synced is not None:
                self._on_synced()

    # --- one response ---

    def handle_response(
        self, response: discovery_pb2.DeltaDiscoveryResponse, converted: list[Converted] | None = None
    ) -> discovery_pb2.DeltaDiscoveryRequest:
        """Apply a response to the store and return its ACK or NACK. `converted`: its
        resources already run through `_convert_all` (elsewhere than on the loop)."""
        type_url = response.type_url
        if self._metrics is not None:
            self._metrics.message(type_url, _payload_bytes(response))
        log.info(
            "received response",
            extra={
                "fields": {
                    "type_url": type_url,
                    "size": len(response.resources),
                    "removes": len(response.removed_resources),
                }
            },
        )
        rtype = BY_URL.get(type_url)
        if rtype is not None:
            rejections = self._apply(rtype, response, converted, self._gone(response))
        else:
            log.error("unknown type", extra={"fields": {"type_url": type_url}})
            rejections = []
        reply = discovery_pb2.DeltaDiscoveryRequest(type_url=type_url, response_nonce=response.nonce)
        if rejections:
            message = "; ".join(str(r) for r in rejections)
            reply.error_detail.CopyFrom(status_pb2.Status(message=message))
            log.warning(
                "rejected configuration (NACK)",
                extra={"fields": {"type_url": type_url, "nonce": response.nonce, "error": message}},
            )
        else:
            log.debug("sending ACK", extra={"fields": {"type_url": type_url, "nonce": response.nonce}})
        return reply

    def _left_out(self, type_url: str, unlisted: frozenset[str]) -> None:
        """Held resources a new stream's initial request did not list: a wildcard subscription's
        first answer says which are gone; a by-name one no longer holds them, so they go now."""
        rtype = BY_URL[type_url]
        if not (self._on_demand and rtype.on_demand):
            self._unlisted[type_url] = unlisted
            return
        versions = self._versions[type_url]
        state = self._state
        with state.batch():
            for name in unlisted:
                rtype.remove(state, name)
                versions.pop(name, None)

    def _gone(self, response: discovery_pb2.DeltaDiscoveryResponse) -> list[str]:
        """On the answer to a cut initial request: the resources it left out that are gone."""
        unlisted = self._unlisted.pop(response.type_url, None)
        if not unlisted:
            return []
        gone = stale(unlisted, response)
        log.info(
            "removing resources left out of the initial request that the control plane no longer has",
            extra={
                "fields": {"type_url": response.type_url, "unlisted": len(unlisted), "removed": len(gone)}
            },
        )
        return gone

    def _apply(
        self,
        rtype: ResourceType[Any],
        response: discovery_pb2.DeltaDiscoveryResponse,
        converted: list[Converted] | None,
        gone: Iterable[str] = (),
    ) -> list[Rejection]:
        if converted is None:
            converted = _convert_all(rtype, response)
        versions = self._versions.setdefault(response.type_url, {})
        rejections: list[Rejection] = []
        arrived: list[str] = []
        state = self._state
        with state.batch():
            for name in gone:
                rtype.remove(state, name)
                versions.pop(name, None)
            for name in response.removed_resources:
                rtype.remove(state, name)
                versions.pop(name, None)
                arrived.append(name)
            for resource, item in zip(response.resources, converted, strict=True):
                arrived.append(resource.name)
                if isinstance(item, Rejection):
                    rejections.append(item)
                    continue
                rtype.upsert(state, item)
                versions[resource.name] = resource.version
        self._wake_demanded(response.type_url, arrived)
        return rejections

    def _wake_demanded(self, type_url: str, names: Iterable[str]) -> None:
        if not self._demanded:
            return
        for name in names:
            for fut in self._demanded.pop((type_url, name), []):
                if not fut.done():
                    fut.set_result(None)
        for fut, arrived in list(self._arrival_checks.items()):
            if not fut.done() and arrived():
                fut.set_result(None)

    def _log_end(self, reason: str, end: BaseException | None, delay: float) -> None:
        fields = {"reason": reason, "retry_in": f"{delay * 1000:.0f}ms"}
        if reason == COMPLETE:
            log.warning("XDS client complete", extra={"fields": fields})
        elif reason == RECONNECT:
            log.debug(f"XDS client terminated: {end}", extra={"fields": fields})
        elif reason == CONNECTION_ERROR:
            log.warning(f"XDS client connection error: {end}", extra={"fields": fields})
        else:
            log.warning(f"XDS client error: {end}", extra={"fields": fields})
