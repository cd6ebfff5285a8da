"""`process_*` of the whole proxy: the supervisor and every live worker, read by
the supervisor from `/proc/<pid>` of each at scrape time (no message, no work in the workers).

What the OS says per process is summed: open file descriptors, virtual memory and CPU seconds.
Resident memory is the proportional set size (`Pss` of `/proc/<pid>/smaps_rollup`, each shared page
split among the processes sharing it), so the pages the workers share with the supervisor since the
fork count once, as the machine spends them; a kernel without `smaps_rollup` gives the resident
set size instead. A worker's CPU seconds stay in the total once it is gone: the supervisor reaps
it and the kernel adds them to the supervisor's children's times, which are counted too. A worker
that has exited counts in no gauge: only the live pids are read. `process_max_fds` and
`process_start_time_seconds` are the supervisor's (the limit every process inherits, the proxy's
start).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from ztunnel.metrics.registry import Collector, CounterMetricFamily, GaugeMetricFamily, Metric

PROC = "/proc"
_TICKS = float(os.sysconf("SC_CLK_TCK"))
_PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True, slots=True)
class ProcessStats:
    """What the OS says of one process."""

    cpu_seconds: float  # user + system, and its reaped children's
    virtual_bytes: float
    memory_bytes: float  # proportional set size (resident set size without smaps_rollup)
    open_fds: int
    start_ticks: float  # since boot, in clock ticks


def _stat_fields(text: bytes) -> list[bytes]:
    """`/proc/<pid>/stat` after the command name (which may hold spaces and parentheses):
    field 3 of proc(5) is index 0."""
    return text.rpartition(b")")[2].split()


def _pss_bytes(path: str) -> float | None:
    try:
        with open(os.path.join(path, "smaps_rollup"), "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def read_process(pid: int | str, proc: str = PROC) -> ProcessStats | None:
    """One process's figures, or None when it is gone (or not readable)."""
    path = os.path.join(proc, str(pid))
    try:
        with open(os.path.join(path, "stat"), "rb") as f:
            parts = _stat_fields(f.read())
        open_fds = len(os.listdir(os.path.join(path, "fd")))
    except OSError:
        return None
    utime, stime, cutime, cstime = (float(p) for p in parts[11:15])
    pss = _pss_bytes(path)
    return ProcessStats(
        cpu_seconds=(utime + stime + cutime + cstime) / _TICKS,
        virtual_bytes=float(parts[20]),
        memory_bytes=pss if pss is not None else float(parts[21]) * _PAGE,
        open_fds=open_fds,
        start_ticks=float(parts[19]),
    )


def _boot_time(proc: str) -> float:
    try:
        with open(os.path.join(proc, "stat"), "rb") as f:
            for line in f:
                if line.startswith(b"btime "):
                    return float(line.split()[1])
    except OSError:
        pass
    return 0.0


def _max_fds(proc: str) -> float | None:
    try:
        with open(os.path.join(proc, "self", "limits"), "rb") as f:
            for line in f:
                if line.startswith(b"Max open files"):
                    return float(line.split()[3])
    except (OSError, ValueError, IndexError):
        pass
    return None


class ProcessTreeCollector(Collector):
    """The `process_*` families (prometheus_client's names and help) summed over `pids()`: this
    process first, then its helpers and workers alive now."""

    def __init__(self, pids: Callable[[], Iterable[int]], proc: str = PROC) -> None:
        self._pids = pids
        self._proc = proc
        self._btime = _boot_time(proc)

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        own = read_process("self", self._proc)
        if own is None or not self._btime:
            return
        me = os.getpid()
        stats = [own, *filter(None, (read_process(p, self._proc) for p in self._pids() if p != me))]
        yield GaugeMetricFamily(
            "process_virtual_memory_bytes",
            "Virtual memory size in bytes.",
            value=sum(s.virtual_bytes for s in stats),
        )
        yield GaugeMetricFamily(
            "process_resident_memory_bytes",
            "Resident memory size in bytes.",
            value=sum(s.memory_bytes for s in stats),
        )
        yield GaugeMetricFamily(
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds.",
            value=own.start_ticks / _TICKS + self._btime,
        )
        yield CounterMetricFamily(
            "process_cpu_seconds",
            "Total user and system CPU time spent in seconds.",
            value=sum(s.cpu_seconds for s in stats),
        )
        yield GaugeMetricFamily(
            "process_open_fds", "Number of open file descriptors.", value=sum(s.open_fds for s in stats)
        )
        max_fds = _max_fds(self._proc)
        if max_fds is not None:
            yield GaugeMetricFamily(
                "process_max_fds", "Maximum number of open file descriptors.", value=max_fds
            )
