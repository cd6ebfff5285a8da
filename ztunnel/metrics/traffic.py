"""The `istio_tcp_*` traffic families: their label set, a connection's counters, and the series of
workloads gone from the state.

A connection resolves its counter cells once per label set and then adds to a plain attribute per
chunk (no lock, no label lookup), which is safe because each data-plane event loop owns its
families; no family emits `_created` samples (the reference does not).

The series of a workload gone from the state are forgotten by `drop_series` (never one that counts
an open connection: each series keeps a count of those); `ztunnel.metrics.series` decides when.

`response_flags` is decided only when a connection closes, so the opened and byte counters carry
`response_flags="-"` (as the reference, which records them with the flags of a fresh connection) and
only `closed` and `failed` carry the final flag. The labels are emitted in the order Istio's ztunnel
emits them (`docs/operations.md`).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, fields

from ztunnel.metrics.registry import CounterCell, CounterFamily, Families

NO_FLAGS = "-"
UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class TrafficLabels:
    """The traffic label set except `response_flags` (given at close); fields in emission order.

    Empty strings render as `unknown`, like absent values.
    """

    reporter: str = UNKNOWN
    source_workload: str = UNKNOWN
    source_canonical_service: str = UNKNOWN
    source_canonical_revision: str = UNKNOWN
    source_workload_namespace: str = UNKNOWN
    source_principal: str = UNKNOWN
    source_app: str = UNKNOWN
    source_version: str = UNKNOWN
    source_cluster: str = UNKNOWN
    destination_service: str = UNKNOWN
    destination_service_namespace: str = UNKNOWN
    destination_service_name: str = UNKNOWN
    destination_workload: str = UNKNOWN
    destination_canonical_service: str = UNKNOWN
    destination_canonical_revision: str = UNKNOWN
    destination_workload_namespace: str = UNKNOWN
    destination_principal: str = UNKNOWN
    destination_app: str = UNKNOWN
    destination_version: str = UNKNOWN
    destination_cluster: str = UNKNOWN
    request_protocol: str = "tcp"
    connection_security_policy: str = UNKNOWN
    source_region: str = UNKNOWN
    source_zone: str = UNKNOWN
    destination_region: str = UNKNOWN
    destination_zone: str = UNKNOWN


_FIELDS = tuple(f.name for f in fields(TrafficLabels))
# As the reference emits them: response_flags sits between request_protocol and connection_security_policy.
_FLAGS_AT = _FIELDS.index("request_protocol") + 1
TRAFFIC_LABEL_NAMES: tuple[str, ...] = (*_FIELDS[:_FLAGS_AT], "response_flags", *_FIELDS[_FLAGS_AT:])
_label_values = operator.attrgetter(*_FIELDS)


# Where a series names its workloads: (namespace, workload) of the source, then of the destination.
WORKLOAD_LABELS = tuple(
    (TRAFFIC_LABEL_NAMES.index(f"{side}_workload_namespace"), TRAFFIC_LABEL_NAMES.index(f"{side}_workload"))
    for side in ("source", "destination")
)
WorkloadKey = tuple[str, str]  # (namespace, workload name)


def named_workloads(values: tuple[str, ...]) -> list[WorkloadKey]:
    """The workloads a traffic series names (its `unknown` sides left out)."""
    out = []
    for ns_at, name_at in WORKLOAD_LABELS:
        if values[name_at] != UNKNOWN:
            out.append((values[ns_at], values[name_at]))
    return out


def _base(values: tuple[str, ...]) -> tuple[str, ...]:
    """A series' label values with the flags of a fresh connection (the opened series')."""
    if values[_FLAGS_AT] == NO_FLAGS:
        return values
    return (*values[:_FLAGS_AT], NO_FLAGS, *values[_FLAGS_AT + 1 :])


# Label sets whose series are kept resolved (a node's connections repeat a few).
_SERIES_KEPT = 4096


def _values(labels: TrafficLabels, flags: str) -> tuple[str, ...]:
    vals = tuple(v or UNKNOWN for v in _label_values(labels))
    return (*vals[:_FLAGS_AT], flags, *vals[_FLAGS_AT:])


class _Series:
    """The cells of one traffic label set: its fresh-connection series (opened, bytes) and, per
    final flags, its closed and failed series; and how many open connections count on it."""

    __slots__ = ("carried", "closed", "failed", "opened", "received", "sent", "values")

    def __init__(self, traffic: TrafficMetrics, values: tuple[str, ...]) -> None:
        self.values = values
        self.carried = 0
        self.opened = traffic.opened.cell(values)
        self.received = traffic.received.cell(values)
        self.sent = traffic.sent.cell(values)
        self.closed: dict[str, CounterCell] = {}
        self.failed: dict[str, CounterCell] = {}

    def closed_cells(self, traffic: TrafficMetrics, flags: str) -> tuple[CounterCell, CounterCell | None]:
        """The closed (and, for any flag but `-`, failed) cells of a close with `flags`."""
        closed = self.closed.get(flags)
        if closed is None:
            values = (*self.values[:_FLAGS_AT], flags, *self.values[_FLAGS_AT + 1 :])
            closed = self.closed[flags] = traffic.closed.cell(values)
            if flags != NO_FLAGS:
                self.failed[flags] = traffic.failed.cell(values)
        return closed, self.failed.get(flags)


class ConnectionMetrics:
    """The counters of one connection, resolved when it opened."""

    __slots__ = ("_closed", "_series", "_traffic", "received_cell", "sent_cell")

    def __init__(self, traffic: TrafficMetrics, labels: TrafficLabels) -> None:
        self._traffic = traffic
        self._closed = False
        # Connections with the same labels share one series (a held connection keeps it until it
        # closes), resolved once per label set rather than once per connection.
        series = self._series = traffic.series(labels)
        series.opened.value += 1
        series.carried += 1
        self.received_cell = series.received
        self.sent_cell = series.sent

    def received(self, n: int) -> None:
        """Bytes read from downstream and written upstream."""
        self.received_cell.value += n

    def sent(self, n: int) -> None:
        """Bytes from upstream written back downstream."""
        self.sent_cell.value += n

    def close(self, response_flags: str = NO_FLAGS) -> None:
        """Count the close once, with the final flags; any flag but `-` also counts a failure."""
        if self._closed:
            return
        self._closed = True
        series = self._series
        series.carried -= 1
        closed, failed = series.closed_cells(self._traffic, response_flags)
        closed.value += 1
        if failed is not None:
            failed.value += 1
        hook = self._traffic.on_connection_closed
        if hook is not None:
            hook()


class TrafficMetrics:
    """The five `istio_tcp_*` families of one process and its series, resolved per label set."""

    def __init__(self) -> None:
        self.opened = CounterFamily(
            "istio_tcp_connections_opened", "The total number of TCP connections opened", TRAFFIC_LABEL_NAMES
        )
        self.closed = CounterFamily(
            "istio_tcp_connections_closed", "The total number of TCP connections closed", TRAFFIC_LABEL_NAMES
        )
        self.received = CounterFamily(
            "istio_tcp_received_bytes",
            "The size of total bytes received during request in case of a TCP connection",
            TRAFFIC_LABEL_NAMES,
        )
        self.sent = CounterFamily(
            "istio_tcp_sent_bytes",
            "The size of total bytes sent during response in case of a TCP connection",
            TRAFFIC_LABEL_NAMES,
        )
        self.failed = CounterFamily(
            "istio_tcp_connections_failed",
            "The total number of TCP connections that failed to establish (unstable)",
            TRAFFIC_LABEL_NAMES,
        )
        self.families = (self.opened, self.closed, self.received, self.sent, self.failed)
        # Called after each connection's close is counted (a worker's idle trimmer looks then).
        self.on_connection_closed: Callable[[], None] | None = None
        # Every series by its fresh-connection values (the opened series' key), and the same per
        # label set object (the listeners share one per pair of peers): a cache, emptied when series
        # are dropped.
        self._by_values: dict[tuple[str, ...], _Series] = {}
        self._by_labels: dict[int, tuple[TrafficLabels, _Series]] = {}

    def collector(self) -> Families:
        return Families(self.families)

    def open_connection(self, labels: TrafficLabels) -> ConnectionMetrics:
        """Count an opened connection and return its pre-resolved counters."""
        return ConnectionMetrics(self, labels)

    def series(self, labels: TrafficLabels) -> _Series:
        hit = self._by_labels.get(id(labels))
        if hit is not None and hit[0] is labels:
            return hit[1]
        values = _values(labels, NO_FLAGS)
        series = self._by_values.get(values)
        if series is None:
            series = self._by_values[values] = _Series(self, values)
        if len(self._by_labels) >= _SERIES_KEPT:
            self._by_labels.clear()
        self._by_labels[id(labels)] = (labels, series)  # holding `labels`: its id stays its own
        return series

    def series_workloads(self) -> set[WorkloadKey]:
        """Every workload the traffic series name."""
        return {w for values in self.opened.cells for w in named_workloads(values)}

    def drop_series(self, stale: set[WorkloadKey]) -> int:
        """Forget the traffic series naming a workload of `stale` that carry no open connection
        (every family's: opened, closed with any flag, bytes, failed); how many were dropped."""
        dropped = 0
        for family in self.families:
            for values in list(family.cells):
                series = self._by_values.get(_base(values))
                if (series is not None and series.carried) or not any(
                    w in stale for w in named_workloads(values)
                ):
                    continue
                family.forget(values)
                dropped += 1
        if dropped:
            self._by_labels.clear()
            for values, series in list(self._by_values.items()):
                if not series.carried and values not in self.opened.cells:
                    del self._by_values[values]
        return dropped
