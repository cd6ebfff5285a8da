"""What a worker reports of its traffic, and the supervisor's sum of every worker's reports.

A worker takes a `traffic_snapshot` of its data-plane families (connections, DNS, CRL refusals:
counters, histograms and gauges) and sends it as `Counters`. The supervisor keeps the latest report
of each live worker in `TrafficSums`. When a worker is gone its counters and histograms stay in the
totals for good (they count what happened), while its gauges leave with it (they say what is).
`SummedMetrics` is the supervisor's `/metrics`: its own families (build info, xDS, and `process_*`
of the whole proxy, `processes.ProcessTreeCollector`), with the sums in place of the data-plane
families it has no traffic for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from ztunnel.metrics.exposition import render_negotiated
from ztunnel.metrics.families import Metrics
from ztunnel.metrics.processes import ProcessTreeCollector
from ztunnel.metrics.registry import CollectorRegistry, Family, Metric
from ztunnel.metrics.traffic import UNKNOWN, WorkloadKey
from ztunnel.workers.messages import Snapshot

# The families the workers count (the supervisor shows their sums).
DATA_PLANE_PREFIXES = (
    "istio_tcp_",
    "istio_dns_",
    "istio_on_demand_dns",
    "istio_crl_",
    "ztunnel_log_",
    "ztunnel_event_loop_",
)
KINDS = ("counter", "histogram", "gauge")

LabelPairs = tuple[tuple[str, str], ...]
SampleKey = tuple[str, str, LabelPairs]  # (family, sample name, labels in emission order)


def traffic_snapshot(metrics: Metrics) -> Snapshot:
    """The data-plane families of one process:
    `{family: {"type": …, "help": …, "samples": [[sample name, labels, value]]}}`.

    Labels travel as pairs, so the label order of the reference survives the trip.
    """
    out: Snapshot = {}
    for family in metrics.registry.collect():
        if family.type not in KINDS or not family.name.startswith(DATA_PLANE_PREFIXES):
            continue
        samples = [
            [s.name, list(s.labels.items()), s.value]
            for s in family.samples
            if not s.name.endswith("_created")
        ]
        if samples:
            out[family.name] = {"type": family.type, "help": family.documentation, "samples": samples}
    return out


def _named(labels: LabelPairs) -> list[WorkloadKey]:
    """The workloads a series' labels name (as `metrics.named_workloads`)."""
    d = dict(labels)
    out = []
    for side in ("source", "destination"):
        name = d.get(f"{side}_workload", UNKNOWN)
        if name != UNKNOWN:
            out.append((d.get(f"{side}_workload_namespace", UNKNOWN), name))
    return out


class TrafficSums:
    """The latest report per live worker, plus what workers that are gone counted."""

    def __init__(self) -> None:
        self.meta: dict[str, tuple[str, str]] = {}  # family -> (type, help)
        self.live: dict[int, dict[SampleKey, float]] = {}
        self.retired: dict[SampleKey, float] = {}

    def report(self, worker: int, snapshot: Snapshot) -> None:
        values: dict[SampleKey, float] = {}
        for name, family in snapshot.items():
            self.meta[name] = (str(family.get("type", "counter")), str(family.get("help", "")))
            for sample, labels, value in family["samples"]:
                values[(name, str(sample), tuple((str(k), str(v)) for k, v in labels))] = float(value)
        self.live[worker] = values

    def retire(self, worker: int) -> None:
        """A worker is gone: its last counts become part of the totals for good; its gauges go."""
        for key, value in self.live.pop(worker, {}).items():
            if self.meta.get(key[0], ("counter", ""))[0] != "gauge":
                self.retired[key] = self.retired.get(key, 0.0) + value

    def retired_workloads(self) -> set[WorkloadKey]:
        """The workloads the series of the workers that are gone name."""
        return {w for _, _, labels in self.retired for w in _named(labels)}

    def drop_retired(self, stale: set[WorkloadKey]) -> int:
        """Forget what the workers that are gone counted in the series naming a workload of `stale`
        that no live worker reports any more (a live one keeps its series while it carries them)."""
        reported = {key for values in self.live.values() for key in values}
        gone = [k for k in self.retired if k not in reported and any(w in stale for w in _named(k[2]))]
        for key in gone:
            del self.retired[key]
        return len(gone)

    def totals(self) -> dict[SampleKey, float]:
        out = dict(self.retired)
        for values in self.live.values():
            for key, value in values.items():
                out[key] = out.get(key, 0.0) + value
        return out

    def opened(self, worker: int, reporter: str | None = None) -> int:
        """Connections the worker opened (by `reporter`: source = outbound, destination = inbound)."""
        return int(
            sum(
                v
                for (name, _, labels), v in self.live.get(worker, {}).items()
                if name == "istio_tcp_connections_opened"
                and (reporter is None or ("reporter", reporter) in labels)
            )
        )

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        # Samples in the order the workers report them (a histogram's buckets ascending).
        for (name, sample, labels), value in self.totals().items():
            family = families.get(name)
            if family is None:
                kind, documentation = self.meta.get(name, ("counter", ""))
                family = families[name] = Metric(name, documentation, kind)
            family.add_sample(sample, dict(labels), value)
        yield from (families[name] for name in sorted(families))


class _SummedView:
    """The supervisor's own families, except those the workers' sums replace, then the sums."""

    def __init__(self, own: CollectorRegistry, sums: TrafficSums) -> None:
        self.own = own
        self.sums = sums

    def collect(self) -> Iterator[Family]:
        summed = list(self.sums.collect())
        names = {f.name for f in summed}
        yield from (f for f in self.own.collect() if f.name not in names)
        yield from summed


class SummedMetrics(Metrics):
    """The supervisor's metrics: its own registry (build info, xDS, `process_*` of every process of
    the proxy: `pids` are those besides this one), then the workers' sums."""

    def __init__(
        self, sums: TrafficSums, istio_version: str, pids: Callable[[], Iterable[int]] = tuple
    ) -> None:
        super().__init__(istio_version=istio_version, process_metrics=False)
        self.registry.register(ProcessTreeCollector(pids))
        self.sums = sums
        self._view = CollectorRegistry()
        self._view.register(_SummedView(self.registry, sums))

    def render(self, accept_header: str | None) -> tuple[bytes, str]:
        return render_negotiated(self._view, accept_header)
