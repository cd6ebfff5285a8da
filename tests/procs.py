"""What /proc says of processes: a process group's live members (a process exiting, its command
line already gone, is no longer one) and a process's command line, as the shipped harness reads
them (`ztunnel/harness.py`), and a process's descriptors and memory."""

from __future__ import annotations

import os
import subprocess

from ztunnel.harness import cmdline, group_left, group_members, is_cert_helper

__all__ = [
    "alive",
    "cmdline",
    "end_all",
    "group_left",
    "group_members",
    "is_cert_helper",
    "open_fds",
    "proportional_memory",
]


def _stat(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def alive(pid: int) -> bool:
    """Whether the kernel still runs `pid` (a zombie does not count; one exiting does)."""
    try:
        return _stat(pid)[0] not in ("Z", "X")
    except OSError:
        return False


def open_fds(pids: list[int]) -> int:
    """The file descriptors the kernel lists for `pids`, summed."""
    total = 0
    for p in pids:
        try:
            total += len(os.listdir(f"/proc/{p}/fd"))
        except OSError:
            pass
    return total


def proportional_memory(pids: list[int]) -> float:
    """`Pss` of `pids` (bytes), summed: what they occupy together, shared pages once."""
    total = 0.0
    for p in pids:
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                total += next(float(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))
        except (OSError, StopIteration):
            pass
    return total


def end_all(procs: list[subprocess.Popen[bytes]] | list[subprocess.Popen[str]]) -> None:
    """Helper processes a test started (apps, servers): SIGTERM to each, then SIGKILL to any still
    running 10 s later."""
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
