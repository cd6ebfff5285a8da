"""What /proc says of processes: a process group's live members (a process exiting, its command
line already gone, is no longer one), a process's command line, its descriptors and memory."""

from __future__ import annotations

import contextlib
import os
import subprocess


def _stat(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def cmdline(pid: int) -> list[str]:
    """`pid`'s command line; empty for a process exiting (its memory already released) or gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [part.decode(errors="replace") for part in f.read().split(b"\0") if part]
    except OSError:
        return []


def group_members(pgid: int) -> list[int]:
    """The processes of process group `pgid` that still run: neither a zombie nor one exiting."""
    found: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = _stat(int(entry))
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X") and cmdline(int(entry)):
            found.append(int(entry))
    return found


def alive(pid: int) -> bool:
    """Whether the kernel still runs `pid` (a zombie does not count; one exiting does)."""
    try:
        return _stat(pid)[0] not in ("Z", "X")
    except OSError:
        return False


def is_cert_helper(pid: int) -> bool:
    """Whether `pid` is a proxy's certificate helper (`python -m ztunnel.identity.certwork`)."""
    return "ztunnel.identity.certwork" in cmdline(pid)


def group_left(pgid: int) -> list[int]:
    """Whatever of group `pgid` the kernel still lists but zombies (an exiting one counts here)."""
    left = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                fields = _stat(int(entry))
                if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                    left.append(int(entry))
    return left


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
