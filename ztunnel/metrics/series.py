"""Which metric series to drop: those of workloads that have left the state (beyond the reference,
whose series of deleted pods stay for the life of the process, so their number grows with pod churn).

A traffic series names up to two workloads (source and destination, by namespace and workload
name). `StaleWorkloads` is told, now and then, the workloads the series name and those the state
lists, and answers the ones absent for at least the grace period
(`METRICS_STALE_SERIES_GRACE_PERIOD`): the series naming one of them are dropped, unless a
connection they count is still open. A workload back in the state before then keeps its series; one
back later starts them again from zero (a counter reset, as Prometheus reads a restart).
Each data-plane worker drops its own series; the supervisor drops what the workers that are gone
left in its totals, once no live worker reports the series.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Container, Iterable

from mesh.model import Workload
from ztunnel.metrics.traffic import WorkloadKey

# How often the series are checked, at most (a shorter grace period checks more often).
SWEEP_INTERVAL = 30.0


def sweep_interval(grace: float) -> float:
    return max(0.2, min(grace / 4, SWEEP_INTERVAL))


def present_workloads(workloads: Iterable[Workload]) -> set[WorkloadKey]:
    """The workloads of the state as series name them (`workload_name`, else the pod's name)."""
    return {(w.namespace, w.workload_name or w.name) for w in workloads}


# Which of the keys series name are in the state (`ProxyState.series_names_present`): asked per key,
# so a worker never decodes the whole mesh for it.
Present = Callable[[set[WorkloadKey]], set[WorkloadKey]]


class StaleWorkloads:
    """The sans-IO part: when each workload named by some series was first seen absent."""

    def __init__(self, grace: float) -> None:
        self.grace = grace
        self._absent_since: dict[WorkloadKey, float] = {}

    def update(
        self, named: Iterable[WorkloadKey], present: Container[WorkloadKey], now: float
    ) -> set[WorkloadKey]:
        """Of `named`, those absent from `present` for at least the grace period (by `now`). A
        workload no series names any more, or present again, is forgotten."""
        since: dict[WorkloadKey, float] = {}
        stale = set()
        for w in named:
            if w in present or w in since:
                continue
            since[w] = first = self._absent_since.get(w, now)
            if now - first >= self.grace:
                stale.add(w)
        self._absent_since = since
        return stale


async def sweep_stale_series(
    grace: float,
    named: Callable[[], set[WorkloadKey]],
    present: Present,
    drop: Callable[[set[WorkloadKey]], object],
    clock: Callable[[], float],
) -> None:
    """Forever, every `sweep_interval(grace)`: `drop` the workloads `named` by series that have been
    absent from the state (`present`) for `grace` (the one loop of the parent and of each worker)."""
    stale = StaleWorkloads(grace)
    while True:
        await asyncio.sleep(sweep_interval(grace))
        names = named()
        gone = stale.update(names, present(names) if names else set(), clock())
        if gone:
            drop(gone)
