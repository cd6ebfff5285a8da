"""One connection's telemetry: its metric labels, live byte counts, the access log line written
when it completes, and the log of the policy decision on it (both inbound listeners')."""

from __future__ import annotations

import logging
import operator
import random
import time
from dataclasses import dataclass, fields
from typing import Protocol

from hbone.relay import RelayCounts
from mesh.model import Service, Workload
from ztunnel.decisions.admission import Admit, Reject
from ztunnel.logs.lines import ACCESS, Bare, FieldRun, Item, Spans, access_items, access_log
from ztunnel.metrics.families import Metrics
from ztunnel.metrics.traffic import UNKNOWN, ConnectionMetrics, TrafficLabels

rbac_log = logging.getLogger("ztunnel.rbac")

_HEX = frozenset("0123456789abcdef")


def trace_id(traceparent: str | None) -> str:
    """The trace id of a W3C `traceparent` (`00-<32 hex>-<16 hex>-<2 hex>`), or a new random one
    when there is none or it is malformed."""
    if traceparent:
        parts = traceparent.strip().split("-")
        if len(parts) >= 4 and len(parts[0]) == 2 and len(parts[1]) == 32 and len(parts[2]) == 16:
            tid = parts[1].lower()
            if set(tid) <= _HEX and tid != "0" * 32 and parts[0].lower() != "ff":
                return tid
    return new_trace_id()


def new_trace_id() -> str:
    """A random W3C trace id (32 hex digits). Ids only need to be unique, not secret: the process's
    generator (reseeded in every forked worker) spares a getrandom() syscall per connection."""
    return f"{random.getrandbits(128) | 1:032x}"


def new_span_id() -> str:
    return f"{random.getrandbits(64) | 1:016x}"


def _v(value: str | None) -> str:
    return value or UNKNOWN


class Carrier(Protocol):
    def end(self, reason: str) -> None:
        """End the connection gracefully, for `reason` (which its access-log line gives)."""
        ...


@dataclass(frozen=True, slots=True)
class Peer:
    """One side of a connection as telemetry describes it."""

    workload: Workload | None = None
    identity: str | None = None  # SPIFFE URI, only when proven by mTLS
    # Values learned from baggage when no workload is known.
    name: str = ""
    namespace: str = ""
    cluster: str = ""
    canonical_service: str = ""
    canonical_revision: str = ""

    @property
    def workload_name(self) -> str:
        return (self.workload.workload_name or self.workload.name) if self.workload else self.name

    @property
    def ns(self) -> str:
        return self.workload.namespace if self.workload else self.namespace

    @property
    def app(self) -> str:
        w = self.workload
        return (w.canonical_name or w.workload_name or w.name) if w else self.canonical_service

    @property
    def version(self) -> str:
        return self.workload.canonical_revision if self.workload else self.canonical_revision

    @property
    def cluster_id(self) -> str:
        return self.workload.cluster_id if self.workload else self.cluster


def traffic_labels(
    reporter: str, src: Peer, dst: Peer, service: Service | None, security_policy: str
) -> TrafficLabels:
    return TrafficLabels(
        reporter=reporter,
        source_workload=_v(src.workload_name),
        source_canonical_service=_v(src.app),
        source_canonical_revision=_v(src.version),
        source_workload_namespace=_v(src.ns),
        source_principal=_v(src.identity),
        source_app=_v(src.app),
        source_version=_v(src.version),
        source_cluster=_v(src.cluster_id),
        destination_service=_v(service.hostname if service else None),
        destination_service_namespace=_v(service.namespace if service else None),
        destination_service_name=_v(service.name if service else None),
        destination_workload=_v(dst.workload_name),
        destination_canonical_service=_v(dst.app),
        destination_canonical_revision=_v(dst.version),
        destination_workload_namespace=_v(dst.ns),
        destination_principal=_v(dst.identity),
        destination_app=_v(dst.app),
        destination_version=_v(dst.version),
        destination_cluster=_v(dst.cluster_id),
        request_protocol="tcp",
        connection_security_policy=security_policy,
        source_region=_v(src.workload.locality.region if src.workload else None),
        source_zone=_v(src.workload.locality.zone if src.workload else None),
        destination_region=_v(dst.workload.locality.region if dst.workload else None),
        destination_zone=_v(dst.workload.locality.zone if dst.workload else None),
    )


@dataclass(frozen=True, slots=True)
class PeerTelemetry:
    """What the connections between one pair of peers share: their metric labels, and their access
    log fields besides the addresses (the source's, then the service's and the destination's)."""

    labels: TrafficLabels
    src_fields: FieldRun
    dst_fields: FieldRun


def _src_fields(src: Peer) -> FieldRun:
    return _run(
        ("src.workload", src.workload_name or None),
        ("src.namespace", src.ns or None),
        ("src.identity", src.identity),
        ("src.cluster", src.cluster_id or None),
    )


def _dst_fields(dst: Peer, service: Service | None) -> FieldRun:
    return _run(
        ("dst.service", service.hostname if service else None),
        ("dst.workload", dst.workload_name or None),
        ("dst.namespace", dst.ns or None),
        ("dst.identity", dst.identity),
        ("dst.cluster", dst.cluster_id or None),
    )


def _run(*items: tuple[str, object]) -> FieldRun:
    return FieldRun((k, v) for k, v in items if v is not None)


# Per (reporter, policy, service, peers): a node's connections repeat a few pairs of workloads.
_PEERS: dict[tuple[object, ...], tuple[PeerTelemetry, tuple[object, ...]]] = {}
_PEERS_KEPT = 4096
_peer_values = operator.attrgetter(*(f.name for f in fields(Peer)))


def _by_value_or_identity(v: object) -> object:
    # Workloads and services by identity: the store replaces them, never changes them.
    return v if v is None or type(v) is str else id(v)


def peer_telemetry(
    reporter: str, src: Peer, dst: Peer, service: Service | None, security_policy: str
) -> PeerTelemetry:
    """`traffic_labels` and the peers' access log fields, remembered by every input and every field
    of both peers (a field added to `Peer` is in the key as it is in the dataclass). Each entry
    holds the objects its key names by identity, so no other object can take their ids while it
    is kept."""
    inputs = (reporter, security_policy, service, *_peer_values(src), *_peer_values(dst))
    key = tuple(map(_by_value_or_identity, inputs))
    hit = _PEERS.get(key)
    if hit is not None:
        return hit[0]
    peers = PeerTelemetry(
        traffic_labels(reporter, src, dst, service, security_policy),
        _src_fields(src),
        _dst_fields(dst, service),
    )
    if len(_PEERS) >= _PEERS_KEPT:
        _PEERS.clear()
    _PEERS[key] = (peers, inputs)
    return peers


class ConnectionRecord:
    """Created once a connection is to be carried (the opened counter moves then); `finish` once."""

    __slots__ = (
        "_metrics",
        "_peers",
        "_registry",
        "carrier",
        "counts",
        "direction",
        "dst",
        "dst_addr",
        "dump_as",
        "hbone_addr",
        "service",
        "spans",
        "src",
        "src_addr",
        "start",
    )

    def __init__(
        self,
        metrics: Metrics,
        *,
        direction: str,
        src_addr: str,
        dst_addr: str,
        src: Peer,
        dst: Peer,
        service: Service | None = None,
        hbone_addr: str | None = None,
        mtls: bool = False,
        spans: Spans = (),
        registry: set[ConnectionRecord] | None = None,
        dump_as: tuple[str | None, str, str] | None = None,
    ) -> None:
        """`registry`: the proxy's set of open connections, this one is in it until `finish`;
        `dump_as`: what `/config_dump` lists of it besides `src`: `originalDst`, `actualDst` and
        `protocol` (a tuple: a held connection keeps it). As the reference, an inbound connection's
        `originalDst` is the service its client addressed (the `forwarded` header's `host=`), or
        None (JSON null): a plaintext one's always."""
        self.direction = direction
        self.src_addr = src_addr
        self.dst_addr = dst_addr
        self.src = src
        self.dst = dst
        self.service = service
        self.hbone_addr = hbone_addr
        self.spans = spans
        self.dump_as = dump_as
        # What carries it, once it is carried (`connections.carry`): a drain ends it through it.
        self.carrier: Carrier | None = None
        self._registry = registry
        if registry is not None:
            registry.add(self)
        self.start = time.monotonic()
        reporter = "source" if direction == "outbound" else "destination"
        self._peers = peers = peer_telemetry(reporter, src, dst, service, "mutual_tls" if mtls else UNKNOWN)
        self._metrics: ConnectionMetrics = metrics.open_connection(peers.labels)
        # Bytes from the downstream side (a) and back to it, as the relay counts them: the metrics
        # read them when scraped.
        self.counts = RelayCounts()
        self._metrics.count_live(self.counts)
        if ACCESS.isEnabledFor(logging.DEBUG):
            items = self._endpoints()
            items.append(("direction", direction))
            access_items(logging.DEBUG, "connection opened", items, spans)

    def dump(self) -> dict[str, str | None] | None:
        """How `/config_dump` lists this connection (None: it does not)."""
        if self.dump_as is None:
            return None
        original, actual, protocol = self.dump_as
        return {"src": self.src_addr, "originalDst": original, "actualDst": actual, "protocol": protocol}

    def _endpoints(self) -> list[Item]:
        """Who and where, as the access log names them (absent values left out)."""
        items: list[Item] = [
            ("src.addr", Bare(self.src_addr)),
            ("", self._peers.src_fields),
            ("dst.addr", Bare(self.dst_addr)),
        ]
        if self.hbone_addr:
            items.append(("dst.hbone_addr", Bare(self.hbone_addr)))
        items.append(("", self._peers.dst_fields))
        return items

    def finish(
        self,
        *,
        received: int,
        sent: int,
        error: str | None = None,
        flags: str = "-",
        reason: str | None = None,
    ) -> None:
        """Count and log the end of it; `reason`: why the proxy ended it (a deleted pod's drain)."""
        self.carrier = None  # it and its record refer to each other until now: no cycle left behind
        self._metrics.close(flags)
        if self._registry is not None:
            self._registry.discard(self)
        # Logs speak from the app's side: the client app for outbound, the server app for inbound.
        if self.direction == "outbound":
            bytes_sent, bytes_recv = received, sent
        else:
            bytes_sent, bytes_recv = sent, received
        level = logging.ERROR if error else logging.INFO
        if not ACCESS.isEnabledFor(level):
            return
        items = self._endpoints()
        items += (
            ("direction", self.direction),
            ("bytes_sent", bytes_sent),
            ("bytes_recv", bytes_recv),
            ("duration", f"{round((time.monotonic() - self.start) * 1000)}ms"),
        )
        if reason is not None:
            items.append(("reason", reason))
        if error is not None:
            items.append(("error", error))
        access_items(level, "connection complete", items, self.spans)


def connection_failed(src_addr: str, dst_addr: str, direction: str, error: str) -> None:
    """An early rejection, before any telemetry exists: a warning and no metrics."""
    access_log(
        logging.WARNING,
        "connection failed",
        {"src.addr": Bare(src_addr), "dst.addr": Bare(dst_addr), "direction": direction, "error": error},
    )


def record_denial(record: ConnectionRecord, decision: Reject) -> None:
    """The one deny path of both inbound listeners: the connection recorded as denied by policy."""
    record.finish(received=0, sent=0, error=decision.reason, flags="DENY")


def log_policy_decision(decision: Admit | Reject, src: str, dst: str, *, info: bool) -> None:
    """Authorization's verdict and its dry-run notes: at debug, or at info with
    AUTHZ_POLICY_INFO_LOGGING=true."""
    level = logging.INFO if info else logging.DEBUG
    if not rbac_log.isEnabledFor(level):
        return
    where = {"src.addr": Bare(src), "dst.addr": Bare(dst)}
    for note in decision.notes:
        rbac_log.log(level, "%s", note, extra={"fields": where})
    if isinstance(decision, Reject):
        rbac_log.log(
            level, "connection denied by policy", extra={"fields": {**where, "reason": decision.reason}}
        )
    else:
        rbac_log.log(level, "connection allowed by policy", extra={"fields": where})
