"""The fork server: a process forked early that forks every worker, the first ones and each
replacement.

It is forked from the supervisor before any event loop or gRPC thread exists, once the worker body
and its imports are loaded and before the control side's are (so workers share the one and never
hold the other), and runs no loop itself: it waits for a
`Spawn` (with the worker's end of its channel) and forks, calling the worker body it was given,
answers `Spawned`, and reports each child that ends as `Exited`. It stops when its channel closes;
it and every worker die with their parent (`PR_SET_PDEATHSIG`).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import logging
import os
import select
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from ztunnel.workers.channel import ChannelError, close_fds, recv_blocking, send_blocking
from ztunnel.workers.messages import Exited, Spawn, Spawned

PR_SET_PDEATHSIG = 1

# The body of a worker process: (worker index, fd of its channel) -> exit code.
WorkerBody = Callable[[int, int], int]


@dataclass(frozen=True)
class ForkServer:
    """The supervisor's handle on its fork server."""

    pid: int
    sock: socket.socket

    def close(self) -> None:
        """Close our end (the fork server exits then) and reap it."""
        self.sock.close()
        reap(self.pid)


def set_pdeathsig(sig: int) -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)


def start_fork_server(body: WorkerBody) -> ForkServer:
    """Fork the fork server now (before any event loop or gRPC thread)."""
    # What exists now is shared, copy-on-write, by this process, the fork server and every worker,
    # for their lifetime: frozen, out of every collector's sight, so that no process's collections
    # write the objects' GC headers (copying the pages) nor walk them.
    gc.collect()
    gc.freeze()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # the fork server
        code = 1
        try:
            ours.close()
            set_pdeathsig(signal.SIGKILL)
            if os.getppid() != parent:
                os._exit(0)
            code = serve(body, theirs)
        finally:
            os._exit(code)
    theirs.close()
    return ForkServer(pid, ours)


def serve(body: WorkerBody, sock: socket.socket) -> int:
    """The fork server's loop, until its channel closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when everything stops
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    while True:
        try:
            readable, _, _ = select.select([sock.fileno(), wake_r], [], [])
        except InterruptedError:
            continue
        if wake_r in readable:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 512)
            for pid, code in _reap_children():
                send_blocking(sock, Exited(pid, code))
        if sock.fileno() in readable:
            try:
                got = recv_blocking(sock)
            except (ChannelError, OSError):
                return 0
            if got is None:
                return 0  # the parent is gone; our children follow us (PR_SET_PDEATHSIG)
            message, fds = got
            if not isinstance(message, Spawn) or len(fds) != 1:
                close_fds(fds)
                continue
            pid = _fork_worker(body, message.index, fds[0], sock, (wake_r, wake_w))
            close_fds(fds)
            send_blocking(sock, Spawned(message.index, pid))


def _reap_children() -> list[tuple[int, int]]:
    ended = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        ended.append((pid, os.waitstatus_to_exitcode(status)))
    return ended


def _fork_worker(body: WorkerBody, index: int, fd: int, sock: socket.socket, wake: tuple[int, int]) -> int:
    me = os.getpid()
    pid = os.fork()
    if pid != 0:
        return pid
    code = 1  # a worker, from here on
    try:
        signal.set_wakeup_fd(-1)
        close_fds(wake)
        sock.close()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        set_pdeathsig(signal.SIGKILL)
        if os.getppid() != me:
            os._exit(0)
        code = body(index, fd)
    finally:
        logging.shutdown()
        os._exit(code)


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
