"""The Delta ADS server: `envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources`.

Each stream subscribes per type URL. A wildcard subscription (no names, or `*`) gets that type's
full state, less the resources the client already holds at the same version
(`initial_resource_versions`), plus the names it holds that no longer exist. After that the stream
gets only differences, pushed when the served snapshot changes. Every response carries a fresh
nonce; the client's ACK or NACK names it.

On demand (a client that subscribes `*` and unsubscribes `*`, i.e. to nothing, then names what it
misses): a name is answered with the resources it resolves to (an Address by uid or
`namespace/hostname`, or by `network/ip` of a workload or a service VIP; each resource named by its
own name and listing the asked name under `aliases`, as istiod does), or with a removal of the
asked name when nothing matches, so the client stops waiting at once. Later pushes carry only the
resources the stream holds.

All of this runs on the event loop, and a snapshot swap enqueues its pushes to every stream before
returning, so a stream always sees its full state and then each difference, in order, exactly once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from controlplane.snapshot import Delta, Snapshot, VersionedResource, encode_response
from xds.gen.envoy.service.discovery.v3 import discovery_pb2, discovery_pb2_grpc
from xds.resources import TYPE_URLS  # in the order they go out: addresses before the policies naming them

log = logging.getLogger(__name__)

Request = discovery_pb2.DeltaDiscoveryRequest
SERVICE_NAME = "envoy.service.discovery.v3.AggregatedDiscoveryService"


@dataclass(eq=False)
class _Stream:
    """One connected client: its subscriptions, the responses it has not answered, and its outbox."""

    peer: str
    node_id: str = ""
    subscribed: set[str] = field(default_factory=set)
    # Type URL -> the resource names a by-name (on-demand) subscription holds; absent: wildcard.
    named: dict[str, set[str]] = field(default_factory=dict)
    unanswered: dict[str, Delta] = field(default_factory=dict)  # nonce -> what that response carried
    # Encoded responses; None ends the stream (the client went away).
    outbox: asyncio.Queue[bytes | None] = field(default_factory=asyncio.Queue)

    @property
    def who(self) -> str:
        return self.node_id or self.peer


class AggregatedDiscoveryService(discovery_pb2_grpc.AggregatedDiscoveryServiceServicer):
    """Serves one snapshot at a time to every stream; `publish` swaps it and pushes the difference."""

    def __init__(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot
        self._streams: set[_Stream] = set()
        self._nonces = itertools.count(1)

    def publish(self, snapshot: Snapshot) -> None:
        deltas = [snapshot.delta_since(t, self.snapshot.versions(t)) for t in TYPE_URLS]
        self.snapshot = snapshot
        changed = [d for d in deltas if d]
        if not changed:
            log.info("configuration reloaded: nothing changed")
            return
        log.info(
            "configuration reloaded: %s; pushing to %d stream(s)",
            "; ".join(
                f"{_short(d.type_url)} {len(d.updated)} updated, {len(d.removed)} removed" for d in changed
            ),
            len(self._streams),
        )
        for stream in self._streams:
            for delta in changed:
                if delta.type_url not in stream.subscribed:
                    continue
                names = stream.named.get(delta.type_url)
                if names is not None:
                    delta = delta.only(names)
                    names.difference_update(delta.removed)
                if delta:
                    self._send(stream, delta)

    def close(self) -> None:
        """End every stream with an OK status, before the server stops (a stream the server
        cancels instead ends in a logged traceback)."""
        for stream in self._streams:
            stream.outbox.put_nowait(None)

    async def DeltaAggregatedResources(
        self, request_iterator: AsyncIterator[Request], context: grpc.aio.ServicerContext
    ) -> None:
        stream = _Stream(peer=context.peer())
        self._streams.add(stream)
        reader = asyncio.create_task(self._read(stream, request_iterator))
        try:
            while (response := await stream.outbox.get()) is not None:
                await context.write(response)
        finally:
            self._streams.discard(stream)
            reader.cancel()
            log.info("stream from %s closed", stream.who)

    async def _read(self, stream: _Stream, requests: AsyncIterator[Request]) -> None:
        try:
            async for request in requests:
                self._on_request(stream, request)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the RPC broke: the writer must stop too
            log.debug("stream from %s: read failed: %s", stream.who, e)
        stream.outbox.put_nowait(None)

    def _on_request(self, stream: _Stream, request: Request) -> None:
        if request.node.id and not stream.node_id:
            stream.node_id = request.node.id
            log.info("stream from %s (peer %s) opened", stream.node_id, stream.peer)
        if request.response_nonce:
            self._on_answer(stream, request)
            return
        type_url = request.type_url
        if type_url not in TYPE_URLS:
            log.warning("%s subscribed to %s, which this control plane does not serve", stream.who, type_url)
            return
        if type_url in stream.subscribed:
            if type_url in stream.named:
                self._on_demand(stream, request)
            else:
                # Every resource of the type is sent anyway (wildcard); a change of names changes nothing.
                log.debug(
                    "%s changed its %s subscription; still sending everything", stream.who, _short(type_url)
                )
            return
        stream.subscribed.add(type_url)
        subscribe = set(request.resource_names_subscribe)
        if subscribe and not (subscribe == {"*"} and "*" not in request.resource_names_unsubscribe):
            stream.named[type_url] = set()
            log.info("%s subscribed to %s on demand", stream.who, _short(type_url))
            # A reconnecting client lists what it held; it keeps those, sent again only if changed.
            known = dict(request.initial_resource_versions)
            self._on_demand(stream, request, [*known, *request.resource_names_subscribe], known)
            return
        known = dict(request.initial_resource_versions)
        delta = self.snapshot.delta_since(type_url, known)
        current = self.snapshot.versions(type_url) if known else {}
        log.info(
            "%s subscribed to %s: sending %d resource(s), %d removal(s), %d unchanged",
            stream.who,
            _short(type_url),
            len(delta.updated),
            len(delta.removed),
            sum(1 for name, version in known.items() if current.get(name) == version),
        )
        # Sent even when empty: the client's readiness waits for a first response of each type.
        self._send(stream, delta)

    def _on_demand(
        self,
        stream: _Stream,
        request: Request,
        keys: list[str] | None = None,
        known: dict[str, str] | None = None,
    ) -> None:
        """Names subscribed by an on-demand client: answered now, then kept up to date."""
        type_url = request.type_url
        held = stream.named[type_url]
        for name in request.resource_names_unsubscribe:
            held.discard(name)
        asked = [k for k in (request.resource_names_subscribe if keys is None else keys) if k != "*"]
        resources = self.snapshot.resources.get(type_url, {})
        updated: dict[str, VersionedResource] = {}
        aliases: dict[str, list[str]] = {}
        missing: list[str] = []
        for key in asked:
            names = self.snapshot.resolve(type_url, key)
            if not names:
                missing.append(key)
            for name in names:
                held.add(name)
                if (known or {}).get(name) == resources[name].version:
                    continue
                updated[name] = resources[name]
                if name != key:
                    aliases.setdefault(name, []).append(key)
        if not updated and not missing:
            return
        log.info(
            "%s asked for %s %s: sending %d resource(s), %d not found",
            stream.who,
            _short(type_url),
            ", ".join(asked),
            len(updated),
            len(missing),
        )
        self._send(
            stream,
            Delta(
                type_url,
                tuple(updated.values()),
                tuple(missing),
                {name: tuple(keys) for name, keys in aliases.items()},
            ),
        )

    def _on_answer(self, stream: _Stream, request: Request) -> None:
        nonce = request.response_nonce
        delta = stream.unanswered.pop(nonce, None)
        if delta is None:
            log.debug("%s answered unknown nonce %s", stream.who, nonce)
            return
        if request.HasField("error_detail"):
            log.warning(
                "%s NACKed %s (nonce %s): %s",
                stream.who,
                _short(delta.type_url),
                nonce,
                request.error_detail.message,
            )
        else:
            log.debug("%s ACKed %s (nonce %s)", stream.who, _short(delta.type_url), nonce)

    def _send(self, stream: _Stream, delta: Delta) -> None:
        nonce = str(next(self._nonces))
        stream.unanswered[nonce] = delta
        stream.outbox.put_nowait(encode_response(delta, nonce))


def add_to_server(service: AggregatedDiscoveryService, server: grpc.aio.Server) -> None:
    """Register `service`: its responses are written as the bytes `encode_response` made (the
    generated registration would encode `DeltaDiscoveryResponse` messages)."""
    handler = grpc.stream_stream_rpc_method_handler(
        service.DeltaAggregatedResources,
        request_deserializer=Request.FromString,
        response_serializer=bytes,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE_NAME, {"DeltaAggregatedResources": handler}),)
    )


def _short(type_url: str) -> str:
    return type_url.rsplit(".", 1)[-1]
