"""The DNS proxy's families (the reference's names), labelled per query type, protocol and client,
and the outbound path's on-demand resolutions of workload hostnames."""

from __future__ import annotations

from ztunnel.metrics.registry import CounterFamily, Families, HistogramFamily

DNS_LABEL_NAMES = (
    "request_query_type",
    "request_protocol",
    "source_canonical_service",
    "source_canonical_revision",
)
DNS_UPSTREAM_BUCKETS = (0.0005, 0.001, 0.01, 0.1, 1.0, 5.0)
ON_DEMAND_LABEL_NAMES = (
    "source_workload",
    "source_canonical_service",
    "source_canonical_revision",
    "source_workload_namespace",
    "source_principal",
    "source_app",
    "source_version",
    "source_cluster",
    "hostname",
)


class DnsMetrics:
    """The `istio_dns_*` families and `istio_on_demand_dns`, shared by every DNS server of a process."""

    def __init__(self) -> None:
        self.requests = CounterFamily(
            "istio_dns_requests", "Total number of DNS requests (unstable)", DNS_LABEL_NAMES
        )
        self.upstream_requests = CounterFamily(
            "istio_dns_upstream_requests",
            "Total number of DNS requests forwarded to upstream (unstable)",
            DNS_LABEL_NAMES,
        )
        self.upstream_failures = CounterFamily(
            "istio_dns_upstream_failures",
            "Total number of DNS requests that failed upstream (unstable)",
            DNS_LABEL_NAMES,
        )
        self.on_demand = CounterFamily(
            "istio_on_demand_dns",
            "Number of requests for on-demand DNS resolution (unstable)",
            ON_DEMAND_LABEL_NAMES,
        )
        self.upstream_duration = HistogramFamily(
            "istio_dns_upstream_request_duration_seconds",
            "Total time in seconds taken to get a DNS response from upstream (unstable)",
            DNS_LABEL_NAMES,
            DNS_UPSTREAM_BUCKETS,
        )

    def collector(self) -> Families:
        return Families(
            (
                self.requests,
                self.upstream_requests,
                self.upstream_failures,
                self.on_demand,
                self.upstream_duration,
            )
        )
