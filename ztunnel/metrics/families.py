"""The families of one process, composed: `Metrics` registers each concern's families in one
`CollectorRegistry` (`ztunnel.metrics.registry`: our own family model, no client library), in the
order they are exposed: traffic (`traffic`), xDS (`xds`), open sockets, build info, dropped log
lines, `process_*` (`processes`: of this process alone, or, in a proxy's supervisor, summed over
its processes), then, on first use, in-pod mode's (`inpod`), the DNS proxy's (`dns`) and revocation's
(`crl`). Each data-plane event loop owns its `Metrics`; the body of `/metrics` is `exposition`'s.

The reference's `tokio_*` runtime families have the workers' `ztunnel_event_loop_*` as their
counterpart (`ztunnel.workers.loop_metrics`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

from ztunnel.logs import lines as logs
from ztunnel.metrics.crl import CrlCounters
from ztunnel.metrics.dns import DnsMetrics
from ztunnel.metrics.exposition import render_negotiated
from ztunnel.metrics.inpod import WorkloadManagerMetrics
from ztunnel.metrics.processes import ProcessTreeCollector
from ztunnel.metrics.registry import CollectorRegistry, CounterMetricFamily, Gauge, GaugeCell, Metric
from ztunnel.metrics.traffic import UNKNOWN, ConnectionMetrics, TrafficLabels, TrafficMetrics, WorkloadKey
from ztunnel.metrics.xds import XdsCounters

Reporter = Literal["source", "destination"]


class _LogCollector:
    """`ztunnel_log_lines_dropped_total`: log lines this process dropped because its stderr was not
    being read (`ztunnel.logs.writer.LogWriter`). Not in the reference, whose writer drops silently."""

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "ztunnel_log_lines_dropped",
            "Log lines dropped because the log stream was not read in time",
            value=logs.dropped_lines(),
        )


class Metrics:
    """The proxy's metrics registry."""

    def __init__(self, istio_version: str = UNKNOWN, *, process_metrics: bool = True) -> None:
        self.registry = CollectorRegistry()
        self.traffic = TrafficMetrics()
        self.registry.register(self.traffic.collector())
        self.xds = XdsCounters()
        self.registry.register(self.xds.collector())
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
        return self.traffic.open_connection(labels)

    def series_workloads(self) -> set[WorkloadKey]:
        """Every workload the traffic series name."""
        return self.traffic.series_workloads()

    def drop_series(self, stale: set[WorkloadKey]) -> int:
        """Forget the traffic series of `stale` workloads that carry no open connection."""
        return self.traffic.drop_series(stale)

    def workload_manager(self) -> WorkloadManagerMetrics:
        """In-pod mode's families, registered on first use (a dedicated proxy does not show them)."""
        if self._workload_manager is None:
            self._workload_manager = WorkloadManagerMetrics(self.registry)
        return self._workload_manager

    def dns(self) -> DnsMetrics:
        """The DNS proxy's families, registered on first use and shared by every DNS server."""
        if self._dns is None:
            self._dns = DnsMetrics()
            self.registry.register(self._dns.collector())
        return self._dns

    def crl(self) -> CrlCounters:
        """The revocation families, registered on first use (only with `CRL_PATH`)."""
        if self._crl is None:
            self._crl = CrlCounters()
            self.registry.register(self._crl.collector())
        return self._crl

    def sockets_open(self, reporter: Reporter) -> GaugeCell:
        """The `istio_tcp_sockets_open` gauge of one reporter: `source` for the sockets accepted on
        15001/15080, `destination` for 15006 and the HBONE connections on 15008 (up once accepted,
        down once closed). The family is shown once a proxy has bound a listener."""
        return self._sockets_open.labels(reporter=reporter)

    def render(self, accept_header: str | None) -> tuple[bytes, str]:
        """The exposition body and its content type, negotiated from an `Accept` header."""
        return render_negotiated(self.registry, accept_header)
