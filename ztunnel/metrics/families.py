"""Prometheus metrics of the proxy: the `istio_tcp_*` traffic families, open sockets, build info, the
DNS proxy's `istio_dns_*` families, and their rendering for the stats endpoint.

Everything lives in one `CollectorRegistry` per `Metrics` (`ztunnel.metrics.registry`: our own family model
and registry, no client library). A connection resolves its counter cells once per label set; its
bytes are counted by its relay alone (`ByteCounts`), and the byte cells read the open connections'
counts when scraped and add them up at close: nothing per chunk here (no lock is needed, each
data-plane event loop owns its `Metrics`); no family emits `_created` samples (the reference does not).

The traffic series of a workload gone from the state are forgotten by `drop_series` (never one
that counts an open connection: each series keeps a count of those); `ztunnel.metrics.series` decides when.

`response_flags` is decided only when a connection closes, so the opened and byte counters carry
`response_flags="-"` (as the reference, which records them with the flags of a fresh connection) and
only `closed` and `failed` carry the final flag.

Exposition is OpenMetrics text (see `render_openmetrics`) with each family's labels in the order the
reference emits them (the traffic labels in the order Istio's ztunnel emits them, `docs/operations.md`).

Runtime families: `process_*` (`ztunnel.metrics.processes`: of this process alone, or, in a proxy's
supervisor, summed over its processes); the reference's `tokio_*` runtime families have
the workers' `ztunnel_event_loop_*` as their counterpart (`ztunnel.workers.loop_metrics`).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, fields
from typing import Literal, Protocol, cast

from ztunnel.logs import lines as logs
from ztunnel.metrics.processes import ProcessTreeCollector
from ztunnel.metrics.registry import (
    CollectorRegistry,
    Counter,
    CounterMetricFamily,
    Gauge,
    GaugeCell,
    HistogramMetricFamily,
    Metric,
    go_float,
)

TEXT_CONTENT_TYPE = "text/plain; charset=utf-8"
OPENMETRICS_CONTENT_TYPE = "application/openmetrics-text;charset=utf-8;version=1.0.0"

Reporter = Literal["source", "destination"]

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


class CounterCell:
    """One labelled counter value."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def inc(self, n: int = 1) -> None:
        self.value += n

    def read(self) -> int:
        return self.value


class ByteCounts(Protocol):
    """A carried connection's bytes, as its relay counts them (`hbone.relay.RelayCounts`): `a_to_b`
    from the downstream side (received), `b_to_a` back to it (sent)."""

    a_to_b: int
    b_to_a: int


class _ByteCell(CounterCell):
    """A byte counter: the bytes of the connections closed, plus, when read, the counts of the open
    ones (`ConnectionMetrics.count_live`)."""

    __slots__ = ("live", "sent")

    def __init__(self, sent: bool) -> None:
        super().__init__()
        self.sent = sent  # b_to_a, else a_to_b
        self.live: set[ByteCounts] = set()

    def read(self) -> int:
        if self.sent:
            return self.value + sum(c.b_to_a for c in self.live)
        return self.value + sum(c.a_to_b for c in self.live)


class _CounterFamily:
    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: tuple[str, ...],
        make: Callable[[], CounterCell] = CounterCell,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = labelnames
        self.cells: dict[tuple[str, ...], CounterCell] = {}
        self._make = make

    def cell(self, values: tuple[str, ...]) -> CounterCell:
        cell = self.cells.get(values)
        if cell is None:
            cell = self.cells[values] = self._make()
        return cell

    def forget(self, values: tuple[str, ...]) -> None:
        self.cells.pop(values, None)

    def family(self) -> CounterMetricFamily:
        fam = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, cell in list(self.cells.items()):
            fam.add_metric(values, cell.read())
        return fam


class _TrafficCollector:
    def __init__(self, families: Iterable[_CounterFamily]) -> None:
        self._families = tuple(families)

    def collect(self) -> Iterator[Metric]:
        for f in self._families:
            if f.cells:
                yield f.family()


class _Series:
    """The cells of one traffic label set: its fresh-connection series (opened, bytes) and, per
    final flags, its closed and failed series; and how many open connections count on it."""

    __slots__ = ("carried", "closed", "failed", "opened", "received", "sent", "values")

    def __init__(self, metrics: Metrics, values: tuple[str, ...]) -> None:
        self.values = values
        self.carried = 0
        self.opened = metrics._opened.cell(values)
        self.received = cast(_ByteCell, metrics._received.cell(values))
        self.sent = cast(_ByteCell, metrics._sent.cell(values))
        self.closed: dict[str, CounterCell] = {}
        self.failed: dict[str, CounterCell] = {}

    def closed_cells(self, metrics: Metrics, flags: str) -> tuple[CounterCell, CounterCell | None]:
        """The closed (and, for any flag but `-`, failed) cells of a close with `flags`."""
        closed = self.closed.get(flags)
        if closed is None:
            values = (*self.values[:_FLAGS_AT], flags, *self.values[_FLAGS_AT + 1 :])
            closed = self.closed[flags] = metrics._closed.cell(values)
            if flags != NO_FLAGS:
                self.failed[flags] = metrics._failed.cell(values)
        return closed, self.failed.get(flags)


class ConnectionMetrics:
    """The counters of one connection, resolved when it opened."""

    __slots__ = ("_closed", "_live", "_metrics", "_series", "received_cell", "sent_cell")

    def __init__(self, metrics: Metrics, labels: TrafficLabels) -> None:
        self._metrics = metrics
        self._closed = False
        # Connections with the same labels share one series (a held connection keeps it until it
        # closes), resolved once per label set rather than once per connection.
        series = self._series = metrics._series(labels)
        series.opened.value += 1
        series.carried += 1
        self.received_cell = series.received
        self.sent_cell = series.sent
        self._live: ByteCounts | None = None

    def count_live(self, counts: ByteCounts) -> None:
        """The connection's bytes are `counts`, kept by its relay: read when scraped, added to the
        series at close."""
        self._live = counts
        self.received_cell.live.add(counts)
        self.sent_cell.live.add(counts)

    def received(self, n: int) -> None:
        """Bytes read from downstream and written upstream (besides those of `count_live`)."""
        self.received_cell.value += n

    def sent(self, n: int) -> None:
        """Bytes from upstream written back downstream (besides those of `count_live`)."""
        self.sent_cell.value += n

    def close(self, response_flags: str = NO_FLAGS) -> None:
        """Count the close once, with the final flags; any flag but `-` also counts a failure."""
        if self._closed:
            return
        self._closed = True
        live = self._live
        if live is not None:
            self._live = None
            self.received_cell.live.discard(live)
            self.sent_cell.live.discard(live)
            self.received_cell.value += live.a_to_b
            self.sent_cell.value += live.b_to_a
        series = self._series
        series.carried -= 1
        closed, failed = series.closed_cells(self._metrics, response_flags)
        closed.value += 1
        if failed is not None:
            failed.value += 1
        hook = self._metrics.on_connection_closed
        if hook is not None:
            hook()


class XdsCounters:
    """The `istio_xds_*` families; the xDS client's metrics hook (`xds.client.XdsMetrics`)."""

    def __init__(self) -> None:
        self.terminations = _CounterFamily(
            "istio_xds_connection_terminations",
            "The total number of completed connections to xds server (unstable)",
            ("reason",),
        )
        self.messages = _CounterFamily(
            "istio_xds_message", "Total number of messages received (unstable)", ("url",)
        )
        self.message_bytes = _CounterFamily(
            "istio_xds_message_bytes", "Total number of bytes received (unstable)", ("url",)
        )

    def message(self, type_url: str, n_bytes: int) -> None:
        self.messages.cell((type_url,)).inc()
        self.message_bytes.cell((type_url,)).inc(n_bytes)

    def termination(self, reason: str) -> None:
        self.terminations.cell((reason,)).inc()


DNS_LABEL_NAMES = (
    "request_query_type",
    "request_protocol",
    "source_canonical_service",
    "source_canonical_revision",
)
DNS_UPSTREAM_BUCKETS = (0.0005, 0.001, 0.01, 0.1, 1.0, 5.0)


class HistogramFamily:
    """A histogram without `_created` samples (as `_CounterFamily` for counters)."""

    def __init__(
        self, name: str, documentation: str, labelnames: tuple[str, ...], buckets: tuple[float, ...]
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = labelnames
        self.buckets = buckets
        self.cells: dict[tuple[str, ...], list[float]] = {}  # per bucket (not cumulative), then +Inf, sum

    def observe(self, values: tuple[str, ...], value: float) -> None:
        cell = self.cells.get(values)
        if cell is None:
            cell = self.cells[values] = [0.0] * (len(self.buckets) + 2)
        i = next((i for i, bound in enumerate(self.buckets) if value <= bound), len(self.buckets))
        cell[i] += 1
        cell[-1] += value

    def family(self) -> HistogramMetricFamily:
        fam = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, cell in list(self.cells.items()):
            cumulative, buckets = 0.0, []
            for bound, count in zip((*map(go_float, self.buckets), "+Inf"), cell[:-1], strict=True):
                cumulative += count
                buckets.append((bound, cumulative))
            fam.add_metric(list(values), buckets, cell[-1])
        return fam


class DnsMetrics:
    """The DNS proxy's families (the reference's names), labelled per query type, protocol and
    client, and the outbound path's on-demand resolutions of workload hostnames."""

    def __init__(self) -> None:
        self.requests = _CounterFamily(
            "istio_dns_requests", "Total number of DNS requests (unstable)", DNS_LABEL_NAMES
        )
        self.upstream_requests = _CounterFamily(
            "istio_dns_upstream_requests",
            "Total number of DNS requests forwarded to upstream (unstable)",
            DNS_LABEL_NAMES,
        )
        self.upstream_failures = _CounterFamily(
            "istio_dns_upstream_failures",
            "Total number of DNS requests that failed upstream (unstable)",
            DNS_LABEL_NAMES,
        )
        self.on_demand = _CounterFamily(
            "istio_on_demand_dns",
            "Number of requests for on-demand DNS resolution (unstable)",
            (
                "source_workload",
                "source_canonical_service",
                "source_canonical_revision",
                "source_workload_namespace",
                "source_principal",
                "source_app",
                "source_version",
                "source_cluster",
                "hostname",
            ),
        )
        self.upstream_duration = HistogramFamily(
            "istio_dns_upstream_request_duration_seconds",
            "Total time in seconds taken to get a DNS response from upstream (unstable)",
            DNS_LABEL_NAMES,
            DNS_UPSTREAM_BUCKETS,
        )

    def collect(self) -> Iterator[Metric]:
        for f in (self.requests, self.upstream_requests, self.upstream_failures, self.on_demand):
            if f.cells:
                yield f.family()
        if self.upstream_duration.cells:
            yield self.upstream_duration.family()


class _DnsCollector:
    def __init__(self, dns: DnsMetrics) -> None:
        self._dns = dns

    def collect(self) -> Iterator[Metric]:
        return self._dns.collect()


class _LogCollector:
    """`ztunnel_log_lines_dropped_total`: log lines this process dropped because its stderr was not
    being read (`ztunnel.logs.writer.LogWriter`). Not in the reference, whose writer drops silently."""

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "ztunnel_log_lines_dropped",
            "Log lines dropped because the log stream was not read in time",
            value=logs.dropped_lines(),
        )


class CrlCounters:
    """Certificate revocation (`CRL_PATH`): handshakes refused and sessions torn down because a CRL
    revoked the peer's chain, and sessions admitted that are not kept for re-checks on a reload."""

    def __init__(self) -> None:
        self.rejections = _CounterFamily(
            "istio_crl_policy_rejections",
            "The total number of connections rejected or closed because a CRL revoked the peer certificate",
            (),
        )
        self.untracked = _CounterFamily(
            "istio_crl_untracked_connections",
            "The total number of connections not re-checked when the CRL changes",
            (),
        )
        # Shown from the start (at 0) once revocation is on.
        self._rejections = self.rejections.cell(())
        self._untracked = self.untracked.cell(())

    def rejection(self) -> None:
        self._rejections.inc()

    def untracked_connection(self) -> None:
        self._untracked.inc()


class WorkloadManagerMetrics:
    """In-pod mode's proxy counts."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.active = Gauge(
            "workload_manager_active_proxy_count",
            "The total number current workload proxies",
            registry=registry,
        )
        self.pending = Gauge(
            "workload_manager_pending_proxy_count",
            "The total number current pending workload proxies",
            registry=registry,
        )
        self.started = Counter(
            "workload_manager_proxies_started",
            "The total number of workload proxies started",
            registry=registry,
        )
        self.stopped = Counter(
            "workload_manager_proxies_stopped",
            "The total number of workload proxies stopped",
            registry=registry,
        )


class Metrics:
    """The proxy's metrics registry."""

    def __init__(self, istio_version: str = UNKNOWN, *, process_metrics: bool = True) -> None:
        self.registry = CollectorRegistry()
        self._opened = _CounterFamily(
            "istio_tcp_connections_opened", "The total number of TCP connections opened", TRAFFIC_LABEL_NAMES
        )
        self._closed = _CounterFamily(
            "istio_tcp_connections_closed", "The total number of TCP connections closed", TRAFFIC_LABEL_NAMES
        )
        self._received = _CounterFamily(
            "istio_tcp_received_bytes",
            "The size of total bytes received during request in case of a TCP connection",
            TRAFFIC_LABEL_NAMES,
            lambda: _ByteCell(sent=False),
        )
        self._sent = _CounterFamily(
            "istio_tcp_sent_bytes",
            "The size of total bytes sent during response in case of a TCP connection",
            TRAFFIC_LABEL_NAMES,
            lambda: _ByteCell(sent=True),
        )
        self._failed = _CounterFamily(
            "istio_tcp_connections_failed",
            "The total number of TCP connections that failed to establish (unstable)",
            TRAFFIC_LABEL_NAMES,
        )
        self._traffic = (self._opened, self._closed, self._received, self._sent, self._failed)
        # Called after each connection's close is counted (a worker's idle trimmer looks then).
        self.on_connection_closed: Callable[[], None] | None = None
        self.registry.register(_TrafficCollector(self._traffic))
        # Every traffic series by its fresh-connection values (the opened series' key), and the same
        # per label set object (the listeners share one per pair of peers): a cache, emptied when
        # series are dropped.
        self._by_values: dict[tuple[str, ...], _Series] = {}
        self._by_labels: dict[int, tuple[TrafficLabels, _Series]] = {}
        self.xds = XdsCounters()
        self.registry.register(
            _TrafficCollector((self.xds.terminations, self.xds.messages, self.xds.message_bytes))
        )
        self._sockets_open = Gauge(
            "istio_tcp_sockets_open",
            "The current number of open TCP sockets (unstable)",
            ["reporter"],
            registry=self.registry,
        )
        self._workload_manager: WorkloadManagerMetrics | None = None
        self._dns: DnsMetrics | None = None
        self._crl: CrlCounters | None = None
        build = Gauge(
            "istio_build", "Istio component build info", ["component", "tag"], registry=self.registry
        )
        build.labels(component="ztunnel", tag=istio_version or UNKNOWN).set(1)
        self.registry.register(_LogCollector())
        if process_metrics:
            self.registry.register(ProcessTreeCollector(tuple))  # this process alone

    def open_connection(self, labels: TrafficLabels) -> ConnectionMetrics:
        """Count an opened connection and return its pre-resolved counters."""
        return ConnectionMetrics(self, labels)

    def _series(self, labels: TrafficLabels) -> _Series:
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
        return {w for values in self._opened.cells for w in named_workloads(values)}

    def drop_series(self, stale: set[WorkloadKey]) -> int:
        """Forget the traffic series naming a workload of `stale` that carry no open connection
        (every family's: opened, closed with any flag, bytes, failed); how many were dropped."""
        dropped = 0
        for family in self._traffic:
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
                if not series.carried and values not in self._opened.cells:
                    del self._by_values[values]
        return dropped

    def workload_manager(self) -> WorkloadManagerMetrics:
        """In-pod mode's families, registered on first use (a dedicated proxy does not show them)."""
        if self._workload_manager is None:
            self._workload_manager = WorkloadManagerMetrics(self.registry)
        return self._workload_manager

    def dns(self) -> DnsMetrics:
        """The DNS proxy's families, registered on first use and shared by every DNS server."""
        if self._dns is None:
            self._dns = DnsMetrics()
            self.registry.register(_DnsCollector(self._dns))
        return self._dns

    def crl(self) -> CrlCounters:
        """The revocation families, registered on first use (only with `CRL_PATH`)."""
        if self._crl is None:
            self._crl = CrlCounters()
            self.registry.register(_TrafficCollector((self._crl.rejections, self._crl.untracked)))
        return self._crl

    def sockets_open(self, reporter: Reporter) -> GaugeCell:
        """The `istio_tcp_sockets_open` gauge of one reporter: `source` for the sockets accepted on
        15001/15080, `destination` for 15006 and the HBONE connections on 15008 (up once accepted,
        down once closed). The family is shown once a proxy has bound a listener."""
        return self._sockets_open.labels(reporter=reporter)

    def render(self, accept_header: str | None) -> tuple[bytes, str]:
        """The exposition body and its content type, negotiated from an `Accept` header.

        The body is OpenMetrics text either way (as the reference); only the content type differs.
        """
        body = render_openmetrics(self.registry)
        return body, OPENMETRICS_CONTENT_TYPE if wants_openmetrics(accept_header) else TEXT_CONTENT_TYPE


def _escape_label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _format_value(value: float) -> str:
    if isinstance(value, int) or (value.is_integer() and abs(value) < 2**53):
        return str(int(value))
    return go_float(value)


def render_openmetrics(registry: CollectorRegistry) -> bytes:
    """OpenMetrics text keeping each family's label order (prometheus_client's own exposition sorts
    labels alphabetically; the reference's order is fixed) and leaving out families without samples."""
    out: list[str] = []
    for family in registry.collect():
        if not family.samples:
            continue
        out.append(f"# HELP {family.name} {_escape_label_value(family.documentation)}\n")
        out.append(f"# TYPE {family.name} {family.type}\n")
        if family.unit:
            out.append(f"# UNIT {family.name} {family.unit}\n")
        for sample in family.samples:
            if sample.labels:
                labels = ",".join(f'{k}="{_escape_label_value(v)}"' for k, v in sample.labels.items())
                out.append(f"{sample.name}{{{labels}}} {_format_value(sample.value)}\n")
            else:
                out.append(f"{sample.name} {_format_value(sample.value)}\n")
    out.append("# EOF\n")
    return "".join(out).encode()


def wants_openmetrics(accept_header: str | None) -> bool:
    if not accept_header:
        return False
    for entry in accept_header.split(","):
        media_type = entry.split(";", 1)[0].strip().lower()
        if media_type == "application/openmetrics-text":
            return True
    return False
