"""What the harness reads from /proc about the processes under test: CPU time, resident memory,
and the worker processes a proxy started (so a proxy with workers counts as the sum of them)."""

from __future__ import annotations

import os
from collections.abc import Iterable

_TICKS = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        raw = f.read()
    # The command name (field 2) may contain spaces; everything after its closing paren is fixed.
    return raw[raw.rindex(")") + 2 :].split()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads); 0 once it is gone."""
    try:
        fields = _stat_fields(pid)
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime (fields 14 and 15)


def thread_cpu_seconds(pid: int) -> float:
    """CPU seconds of the process's live threads, from the scheduler's own count
    (`/proc/<pid>/task/*/schedstat`, nanoseconds): precise where `cpu_seconds` moves in clock ticks
    (10 ms), but a thread that has exited is no longer counted. 0 once the process is gone."""
    total = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue
    return total / 1e9


def rss_kib(pid: int) -> int:
    """Resident set size in KiB; 0 once the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def pss_kib(pid: int) -> int:
    """Proportional set size in KiB (each shared page divided among the processes mapping it); 0
    once the process is gone. Summed over a parent and the workers it forked, it counts their shared
    pages once, where RSS would count them once per process."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return 0


def children(pid: int) -> list[int]:
    """Direct children of `pid`, from each thread's `children` list."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(c) for c in f.read().split())
        except FileNotFoundError:
            continue
    return out


def tree(pid: int) -> list[int]:
    """`pid` and all its descendants."""
    out = [pid]
    i = 0
    while i < len(out):
        out.extend(children(out[i]))
        i += 1
    return out


def running_module(pids: Iterable[int], module: str) -> bool:
    """Whether one of `pids` is a `python -m <module>` process (its command line says so)."""
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except (FileNotFoundError, ProcessLookupError):
            continue
        if module.encode() in argv and b"-m" in argv:
            return True
    return False


def total_cpu(pids: Iterable[int]) -> float:
    return sum(cpu_seconds(p) for p in pids)


def total_thread_cpu(pids: Iterable[int]) -> float:
    return sum(thread_cpu_seconds(p) for p in pids)


def total_rss_kib(pids: Iterable[int]) -> int:
    return sum(rss_kib(p) for p in pids)


def total_pss_kib(pids: Iterable[int]) -> int:
    return sum(pss_kib(p) for p in pids)


def open_fds(pid: int) -> int:
    """Open file descriptors of a process; 0 once it is gone."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError):
        return 0


def total_fds(pids: Iterable[int]) -> int:
    return sum(open_fds(p) for p in pids)


def time_wait(pid: int) -> int:
    """TCP sockets in TIME_WAIT in the network namespace of `pid` (its /proc/<pid>/net view)."""
    n = 0
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                next(f, None)  # the header
                n += sum(1 for line in f if line.split()[3:4] == ["06"])
        except (FileNotFoundError, ProcessLookupError):
            continue
    return n
