"""The supervisor's sums of its workers' reports, as its /metrics shows them: counters and
histograms of a worker that is gone stay in the totals, its gauges leave with it."""

from __future__ import annotations

from ztunnel.metrics.families import Metrics
from ztunnel.workers.counters import SummedMetrics, TrafficSums, traffic_snapshot


def report(opened: float, sockets: float) -> dict[str, object]:
    return {
        "istio_tcp_connections_opened": {
            "type": "counter",
            "help": "opened",
            "samples": [["istio_tcp_connections_opened_total", [("reporter", "source")], opened]],
        },
        "istio_tcp_sockets_open": {
            "type": "gauge",
            "help": "open",
            "samples": [["istio_tcp_sockets_open", [("reporter", "source")], sockets]],
        },
    }


def lines(metrics: SummedMetrics) -> list[str]:
    body, _ = metrics.render(None)
    return [line for line in body.decode().splitlines() if line.startswith("istio_tcp_")]


def test_counters_outlive_a_worker_gauges_do_not() -> None:
    sums = TrafficSums()
    metrics = SummedMetrics(sums, "1.0")
    sums.report(0, report(3, 2))
    sums.report(1, report(4, 1))
    assert lines(metrics) == [
        'istio_tcp_connections_opened_total{reporter="source"} 7',
        'istio_tcp_sockets_open{reporter="source"} 3',
    ]
    sums.retire(1)
    sums.report(0, report(5, 0))
    assert lines(metrics) == [
        'istio_tcp_connections_opened_total{reporter="source"} 9',
        'istio_tcp_sockets_open{reporter="source"} 0',
    ]
    assert sums.opened(0) == 5 and sums.opened(1) == 0


def test_a_worker_snapshot_holds_its_data_plane_families_only() -> None:
    m = Metrics("1.0", process_metrics=False)
    m.sockets_open("source").inc()
    snapshot = traffic_snapshot(m)
    assert snapshot["istio_tcp_sockets_open"]["type"] == "gauge"
    assert snapshot["istio_tcp_sockets_open"]["samples"] == [
        ["istio_tcp_sockets_open", [("reporter", "source")], 1.0]
    ]
    assert "istio_build" not in snapshot  # the supervisor's own
