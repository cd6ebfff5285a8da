"""The event loop of one data-plane worker, as the reference's `tokio_*` runtime families describe
its scheduler: how late the loop runs what is due, how many tasks it holds, how busy it is.

A timer fires every `TICK` seconds and measures its own lateness: the time a callback that was due
waited behind the ones running (a loop blocked by a slow handler, a long write, a CPU-bound burst).
That is the only recurring work; a connection costs nothing here. The task count and the busy time
are read when the worker reports its counters (about once a second, and at each scrape).

Families, labelled `worker` (the worker's index), summed by the supervisor like the other data-plane
families (a worker's gauges leave with it):

* `ztunnel_event_loop_lag_seconds` (histogram): the timer's lateness per tick;
* `ztunnel_event_loop_tasks` (gauge): tasks alive on the loop (a connection's handler while it is
  set up among them; a carried connection is callbacks, not a task);
* `ztunnel_event_loop_busy_seconds_total` (counter): CPU time of the loop's thread.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Iterator

from ztunnel.metrics.registry import (
    Collector,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramFamily,
    Metric,
)

TICK = 0.25
LAG_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)


class LoopLag:
    """The sans-IO part: given when a tick was due and when it ran, record the lateness."""

    def __init__(self, worker: int) -> None:
        self.labels = (str(worker),)
        self.histogram = HistogramFamily(
            "ztunnel_event_loop_lag_seconds",
            "How late a data-plane worker's event loop ran a timer that was due",
            ("worker",),
            LAG_BUCKETS,
        )

    def ran(self, due: float, now: float) -> None:
        self.histogram.observe(self.labels, max(0.0, now - due))


class EventLoopMetrics(Collector):
    """A worker's loop figures; `start` arms the timer on the running loop."""

    def __init__(self, worker: int, tick: float = TICK) -> None:
        self.worker = str(worker)
        self.tick = tick
        self.lag = LoopLag(worker)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._arm(loop.time() + self.tick)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _arm(self, due: float) -> None:
        assert self._loop is not None
        self._timer = self._loop.call_at(due, self._fire, due)

    def _fire(self, due: float) -> None:
        assert self._loop is not None
        now = self._loop.time()
        self.lag.ran(due, now)
        self._arm(now + self.tick)

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        if self._loop is None:
            return
        if self.lag.histogram.cells:
            yield self.lag.histogram.family()
        tasks = GaugeMetricFamily(
            "ztunnel_event_loop_tasks", "Tasks alive on a data-plane worker's event loop", labels=("worker",)
        )
        tasks.add_metric((self.worker,), len(asyncio.all_tasks(self._loop)))
        yield tasks
        busy = CounterMetricFamily(
            "ztunnel_event_loop_busy_seconds",
            "CPU time spent by a data-plane worker's event loop thread",
            labels=("worker",),
        )
        busy.add_metric((self.worker,), time.thread_time())
        yield busy
