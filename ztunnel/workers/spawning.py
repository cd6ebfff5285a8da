"""How worker processes come to be: the first ones forked from the parent before anything runs in
it, each replacement started afresh.

The first `worker_threads` workers are forked from the parent at start-up (`fork_workers`), before
any event loop or gRPC thread exists, once the worker body and what its workers load are imported
and the control side's too, and the heap is frozen: they share that memory copy-on-write with the
parent and each other (the control side's pages stay shared: no worker runs it). A fork once the
parent runs (its loop, gRPC's threads) would not be safe, so a worker that dies is replaced by a new
interpreter (`exec_worker`: `python -m ztunnel.workers.replacement`, the parent's environment, the
worker's end of its channel inherited), which imports what it needs itself. A worker waits for
`Spawn` on its channel before it binds anything, so that the parent decides when each one starts;
every worker dies with the parent (`PR_SET_PDEATHSIG`) and stops when its channel closes.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ztunnel.lifecycle import set_pdeathsig

# The body of a worker process: (worker index, fd of its channel) -> exit code.
WorkerBody = Callable[[int, int], int]


@dataclass(frozen=True)
class WorkerProcess:
    """The parent's handle on one worker process: its pid and the parent's end of its channel."""

    index: int
    pid: int
    sock: socket.socket


def fork_workers(body: WorkerBody, count: int) -> list[WorkerProcess]:
    """Fork workers 0..count-1 now: before any event loop or gRPC thread of this process."""
    # What exists now is shared, copy-on-write, by this process and every worker for their
    # lifetime: frozen, out of every collector's sight, so that no process's collections write the
    # objects' GC headers (copying the pages) nor walk them.
    gc.collect()
    gc.freeze()
    return [_fork_worker(body, index) for index in range(count)]


def _fork_worker(body: WorkerBody, index: int) -> WorkerProcess:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    parent = os.getpid()
    pid = os.fork()
    if pid != 0:
        theirs.close()
        return WorkerProcess(index, pid, ours)
    code = 1  # a worker, from here on
    try:
        ours.close()
        set_pdeathsig(signal.SIGKILL)
        if os.getppid() != parent:
            os._exit(0)
        code = body(index, theirs.detach())
    finally:
        logging.shutdown()
        os._exit(code)


@dataclass
class Spawner:
    """The supervisor's source of worker processes: the ones forked at start-up, once each, then
    fresh interpreters for the replacements."""

    first: list[WorkerProcess]
    environ: Mapping[str, str]
    argv: list[str] = field(default_factory=lambda: [*interpreter(), "-m", "ztunnel.workers.replacement"])

    def spawn(self, index: int) -> WorkerProcess:
        for i, proc in enumerate(self.first):
            if proc.index == index:
                return self.first.pop(i)
        return exec_worker(index, self.environ, self.argv)

    def close(self) -> None:
        """The forked workers never spawned (start-up failed first): their channels closed, they exit
        and are reaped."""
        for proc in self.first:
            proc.sock.close()
            reap(proc.pid)
        self.first.clear()


def interpreter() -> list[str]:
    """This interpreter's command with this process's -O or -OO: a replacement runs as its parent."""
    return [sys.executable, *(["-" + "O" * sys.flags.optimize] if sys.flags.optimize else [])]


def exec_worker(index: int, environ: Mapping[str, str], argv: list[str]) -> WorkerProcess:
    """Start worker `index` as a new interpreter, its channel's end inherited."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        fd = theirs.fileno()
        os.set_inheritable(fd, True)
        pid = os.posix_spawn(argv[0], [*argv, str(index), str(fd), str(os.getpid())], dict(environ))
    except OSError:
        ours.close()
        raise
    finally:
        theirs.close()
    return WorkerProcess(index, pid, ours)


def exit_code(pid: int) -> int | None:
    """The exit code of a child that ended (`os.waitstatus_to_exitcode`), None while it runs."""
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return None
    return os.waitstatus_to_exitcode(status) if done == pid else None


def reap(pid: int, timeout: float = 2.0) -> None:
    """Wait for a child that was told to exit; SIGKILL it after `timeout`."""
    deadline = time.monotonic() + timeout
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return
            time.sleep(0.01)
