"""The log writer: text to a file descriptor (stderr) from a bounded buffer and a thread of its own,
so a stderr nobody reads never blocks an event loop (`ztunnel.logs.lines` puts its lines through it)."""

from __future__ import annotations

import os
import select
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable

# What may wait for stderr at most: about 2,500 access-log lines. Beyond it lines are dropped.
BUFFER_BYTES = 1 << 20
_BATCH_BYTES = 64 * 1024
# The most one write(2) to a pipe carries atomically (POSIX: at least 512; Linux: 4096).
_ATOMIC = select.PIPE_BUF
_CLOSE_TIMEOUT = 2.0
# While lines keep coming (the last write less than ACTIVE ago), the writer thread looks for more
# every LINGER, woken by no one (the most a line waits); idle longer, it sleeps until a line wakes it.
LINGER = 0.02
ACTIVE = 0.1


class LogWriter:
    """Text to a file descriptor, never blocking the caller: lines wait in a buffer of at most
    `limit` bytes and one thread of this process writes them, blocking only itself when the reader
    is slow or gone. A line that does not fit is dropped and counted (`dropped`); once the buffer has
    drained, the thread writes `report(n)` for the `n` lines dropped since the last report.

    While lines keep coming the thread looks for them every `LINGER` and writes what came in one
    go; only after `ACTIVE` without any does it sleep until the next line wakes it. So it wakes at
    most 1/`LINGER` times a second however many lines come, and under steady traffic (an access
    log line per connection) the caller never wakes it: no futex wake, context switches and GIL
    hand-off per line on the event loop's thread (a wake-up costs ~0.1 ms of CPU on a busy VM).

    A fork copies no thread: the child's writer starts empty and starts its own thread on its
    first line (`os.register_at_fork` keeps the lock consistent across the fork)."""

    def __init__(
        self, fd: int, *, limit: int = BUFFER_BYTES, report: Callable[[int], str] | None = None
    ) -> None:
        self.fd = fd
        self.limit = limit
        self._report = report
        self._fresh()
        _WRITERS.add(self)

    def _fresh(self) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._queue: deque[bytes] = deque()
        self._queued = 0
        self._busy = False  # the thread holds taken lines not yet written
        self._idle = False  # the thread waits for a line: the next one wakes it
        self._hurry = 0  # callers of `flush` waiting: the thread writes without lingering
        self._wrote = -ACTIVE  # when the thread last took lines (monotonic)
        self._unreported = 0
        self.dropped = 0
        self._broken = False
        self._closed = False
        self._thread: threading.Thread | None = None

    def write(self, text: str) -> None:
        data = text.encode("utf-8", "backslashreplace")
        with self._lock:
            if self._broken or self._closed or self._queued + len(data) > self.limit:
                self.dropped += 1
                self._unreported += 1
                return
            self._queue.append(data)
            self._queued += len(data)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="log-writer", daemon=True)
                self._thread.start()
            elif self._idle or self._queued >= _BATCH_BYTES:
                self._idle = False
                self._changed.notify_all()

    def flush(self, timeout: float = _CLOSE_TIMEOUT) -> bool:
        """Wait (at most `timeout`) until every buffered line is written; whether they were."""
        deadline = time.monotonic() + timeout
        with self._lock:
            self._hurry += 1
            try:
                self._changed.notify_all()  # the thread stops lingering
                while (self._queue or self._busy) and not self._broken and self._thread is not None:
                    left = deadline - time.monotonic()
                    if left <= 0 or not self._thread.is_alive():
                        return False
                    self._changed.wait(left)
                return not self._queue
            finally:
                self._hurry -= 1

    def close(self) -> None:
        self.flush()
        with self._lock:
            self._closed = True
            self._changed.notify_all()

    def _run(self) -> None:
        while True:
            with self._lock:
                self._busy = False
                self._changed.notify_all()
                while not self._queue and not (self._unreported and self._report and not self._broken):
                    if self._closed or self._broken:
                        return
                    if time.monotonic() - self._wrote < ACTIVE and not self._hurry:
                        # Lines came lately: look again in a while, unwoken, and write what came.
                        self._changed.wait(LINGER)
                    else:
                        self._idle = True
                        self._changed.wait()
                self._idle = False
                self._busy = True
                if self._queue:
                    batch, lines = self._take()
                else:  # drained, with lines dropped since the last report
                    assert self._report is not None
                    batch, lines = [self._report(self._unreported).encode("utf-8", "backslashreplace")], 0
                    self._unreported = 0
            self._wrote = time.monotonic()
            if not self._write_all(batch):
                with self._lock:
                    self._broken = True
                    self.dropped += lines + len(self._queue)
                    self._queue.clear()
                    self._queued = 0

    def _take(self) -> tuple[list[bytes], int]:
        """Lines from the front of the buffer, up to a batch, as writes of whole lines of at most
        `PIPE_BUF` bytes each (a longer line alone), and their number of lines."""
        writes: list[bytes] = []
        parts: list[bytes] = []
        size = total = lines = 0
        while self._queue and (not lines or total + len(self._queue[0]) <= _BATCH_BYTES):
            data = self._queue.popleft()
            if parts and size + len(data) > _ATOMIC:
                writes.append(b"".join(parts))
                parts, size = [], 0
            parts.append(data)
            size += len(data)
            total += len(data)
            lines += 1
        if parts:
            writes.append(b"".join(parts))
        self._queued -= total
        return writes, lines

    def _write_all(self, writes: list[bytes]) -> bool:
        """Each piece in one write(2) where it fits: to a pipe, a write of at most `PIPE_BUF` bytes
        is atomic, so the lines of the proxy's processes, which share its stderr, never interleave
        within a line when the reader is slow (a larger write is split where the kernel likes)."""
        for data in writes:
            view = memoryview(data)
            while view:
                try:
                    view = view[os.write(self.fd, view) :]
                except BlockingIOError:  # someone made the shared descriptor non-blocking
                    select.select([], [self.fd], [])
                except OSError:  # closed, or the reader is gone: nothing will be read again
                    return False
        return True


_WRITERS: weakref.WeakSet[LogWriter] = weakref.WeakSet()


def _before_fork() -> None:
    for writer in list(_WRITERS):
        writer._lock.acquire()


def _after_fork_in_parent() -> None:
    for writer in list(_WRITERS):
        writer._lock.release()


def _after_fork_in_child() -> None:
    for writer in list(_WRITERS):
        writer._fresh()  # the parent's thread writes what was buffered; the child starts empty


os.register_at_fork(
    before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child
)
