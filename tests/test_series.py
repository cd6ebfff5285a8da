"""Dropping the series of workloads that have left the state: the grace period's bookkeeping, a
worker's own series (never one that carries an open connection) and the supervisor's totals of
workers that are gone."""

from __future__ import annotations

from ztunnel.metrics.families import Metrics
from ztunnel.metrics.series import StaleWorkloads
from ztunnel.metrics.traffic import TrafficLabels
from ztunnel.workers.counters import TrafficSums, traffic_snapshot

GONE, STAYS, CLIENT = ("demo", "gone"), ("demo", "stays"), ("demo", "client")


def to(workload: tuple[str, str]) -> TrafficLabels:
    return TrafficLabels(
        reporter="source",
        source_workload=CLIENT[1],
        source_workload_namespace=CLIENT[0],
        destination_workload=workload[1],
        destination_workload_namespace=workload[0],
    )


def series(metrics: Metrics) -> set[tuple[str, str]]:
    body = metrics.render(None)[0].decode()
    return {
        (line.split("{")[0], "gone" if 'destination_workload="gone"' in line else "stays")
        for line in body.splitlines()
        if line.startswith("istio_tcp_")
    }


def test_a_workload_is_stale_once_absent_for_the_grace_period() -> None:
    stale = StaleWorkloads(10.0)
    assert stale.update([GONE, STAYS], {STAYS}, 100.0) == set()
    assert stale.update([GONE, STAYS], {STAYS}, 109.9) == set()
    assert stale.update([GONE, STAYS], {STAYS}, 110.0) == {GONE}
    # Back before it was dropped: the clock starts again when it leaves again.
    assert stale.update([GONE], {GONE}, 111.0) == set()
    assert stale.update([GONE], set(), 112.0) == set()
    assert stale.update([GONE], set(), 121.9) == set()
    assert stale.update([GONE], set(), 122.0) == {GONE}


def test_a_worker_drops_the_series_of_a_stale_workload_but_not_while_carried() -> None:
    metrics = Metrics(process_metrics=False)
    metrics.open_connection(to(STAYS)).close()
    done = metrics.open_connection(to(GONE))
    done.received(10)
    done.close("CONNECT")
    held = metrics.open_connection(to(GONE))
    assert metrics.series_workloads() == {CLIENT, STAYS, GONE}
    assert metrics.drop_series({GONE}) == 0  # a connection is still open on that series
    held.close()
    assert ("istio_tcp_connections_failed_total", "gone") in series(metrics)
    assert metrics.drop_series({GONE}) == 6  # opened, received, sent; closed - and CONNECT, failed
    assert {s for s in series(metrics) if s[1] == "gone"} == set()
    assert ("istio_tcp_connections_opened_total", "stays") in series(metrics)
    assert metrics.series_workloads() == {CLIENT, STAYS}
    # Back later: its series start again from zero.
    metrics.open_connection(to(GONE))
    assert "istio_tcp_connections_opened_total" in {s[0] for s in series(metrics) if s[1] == "gone"}


def test_the_supervisor_drops_what_gone_workers_counted_once_no_live_worker_reports_it() -> None:
    one, two = Metrics(process_metrics=False), Metrics(process_metrics=False)
    one.open_connection(to(GONE)).close()
    one.open_connection(to(STAYS)).close()
    two.open_connection(to(GONE)).close()
    sums = TrafficSums()
    sums.report(0, traffic_snapshot(one))
    sums.report(1, traffic_snapshot(two))
    sums.retire(0)
    assert sums.retired_workloads() == {CLIENT, GONE, STAYS}
    assert sums.drop_retired({GONE}) == 0  # worker 1 still reports those series
    two.drop_series({GONE})
    sums.report(1, traffic_snapshot(two))
    assert sums.drop_retired({GONE}) == 4  # opened, closed, both byte counters
    assert sums.retired_workloads() == {CLIENT, STAYS}
    opened = {k: v for k, v in sums.totals().items() if k[0] == "istio_tcp_connections_opened"}
    assert [dict(k[2])["destination_workload"] for k in opened] == ["stays"]
