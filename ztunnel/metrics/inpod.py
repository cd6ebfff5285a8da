"""In-pod mode's `workload_manager_*` families: the pods' proxies started, stopped, up and pending."""

from __future__ import annotations

from ztunnel.metrics.registry import CollectorRegistry, Counter, Gauge


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
