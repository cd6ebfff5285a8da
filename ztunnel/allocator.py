"""glibc's allocator, as every process of `ztunnel proxy` runs it: fixed thresholds while traffic
flows, and the free memory given back once it stops.

glibc's allocator, left to itself, maps each block above an adaptive threshold on its own and
returns the top of the heap to the kernel once more than twice that is free there. A relay's
buffers (a TLS write of a few hundred KiB, a payload copied out of a read) are allocated and freed
on every read, so that adaptive pair ends up mapping, zeroing and unmapping them again and again:
measured at up to ~175,000 page faults per GiB relayed by the sending proxy, ~15 % of its CPU.
Fixed thresholds (`tune_allocator`) keep blocks up to MALLOC_MMAP_THRESHOLD in the heap and up to
MALLOC_TRIM_THRESHOLD of free heap for reuse. The glibc environment variables of the same names
(with a trailing underscore) or GLIBC_TUNABLES win when set.

What the heap keeps for reuse is memory a process holds after the traffic is gone. `IdleTrim`
decides when to give it back: once a process has done some work (`MIN_WORK` of CPU time since the
last trim) and then spends a look's window nearly idle (under `IDLE_SHARE` of it on the CPU), the
garbage is collected and `malloc_trim(0)` called, which returns every free page of the heap; at
most once per `MIN_INTERVAL`. The page faults come back once per burst, when the next one grows the
heap again, not on every read.

Looking costs a wake-up: ten a second were most of an idle proxy's CPU. So the looks are a slow
periodic one (`TRIM_TICK`) and, in a worker, one `SETTLE` after a connection closes (`IdleTrimmer`):
traffic usually stops with its connections, and its memory goes back a tenth of a second later;
traffic that stops on held connections is seen by the next periodic look. The control process
has no connections to poke its trimmer: it looks only periodically.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import gc
import os
import time
from collections.abc import Callable, Mapping

MALLOC_MMAP_THRESHOLD = 4 << 20
MALLOC_TRIM_THRESHOLD = 16 << 20
_M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
_M_MMAP_THRESHOLD = -3

TRIM_TICK = 1.0  # seconds between periodic looks at the process's CPU time
# After a connection closes: the look that sees whether the traffic stopped with it.
SETTLE = 0.1
IDLE_SHARE = 0.02  # a tick with less CPU time than this share of it is idle
MIN_WORK = 0.05  # CPU seconds since the last trim that make a trim worth it
# At most one trim a second: traffic that pauses often pays the heap's page faults again at most
# once a second (16 MiB of heap is ~4,000 faults, milliseconds of CPU).
MIN_INTERVAL = 1.0


@functools.cache  # looked up once: every idle trim calls it
def _glibc() -> ctypes.CDLL | None:
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return None
    except (ValueError, OSError):
        return None
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def tune_allocator(environ: Mapping[str, str]) -> bool:
    """Fix glibc's mmap and trim thresholds for this process and the ones it forks; True if set."""
    if any(k in environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")):
        return False
    libc = _glibc()
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(
        mallopt(_M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD)
        and mallopt(_M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD)
    )


def release_free_memory() -> None:
    """Collect garbage, then give every free page of the heap back to the kernel (glibc only)."""
    gc.collect()
    trim = getattr(_glibc(), "malloc_trim", None)
    if trim is not None:
        trim.argtypes = (ctypes.c_size_t,)
        trim(0)


class IdleTrim:
    """The sans-IO decision: given the wall clock and the process's CPU time at each tick, whether
    to give the free memory back now (the first nearly idle tick after `min_work` of CPU time, and
    `min_interval` after the last trim)."""

    def __init__(
        self,
        *,
        idle_share: float = IDLE_SHARE,
        min_work: float = MIN_WORK,
        min_interval: float = MIN_INTERVAL,
    ) -> None:
        self.idle_share = idle_share
        self.min_work = min_work
        self.min_interval = min_interval
        self._last: tuple[float, float] | None = None
        self._work = 0.0  # CPU seconds of the busy ticks since the last trim
        self._trimmed: float | None = None  # when

    def tick(self, now: float, cpu: float) -> bool:
        last, self._last = self._last, (now, cpu)
        if last is None:
            return False
        used = max(0.0, cpu - last[1])
        if used >= self.idle_share * max(now - last[0], 1e-9):
            self._work += used
            return False
        if self._work < self.min_work:
            return False
        if self._trimmed is not None and now - self._trimmed < self.min_interval:
            return False
        self._work = 0.0
        self._trimmed = now
        return True


class IdleTrimmer:
    """The looks of `IdleTrim` on an event loop: one every `tick`, and one `settle` after each
    `poke` (a connection closed; a burst of closes makes one look, not one each)."""

    def __init__(
        self,
        policy: IdleTrim | None = None,
        *,
        tick: float = TRIM_TICK,
        settle: float = SETTLE,
        cpu: Callable[[], float] = time.process_time,
        release: Callable[[], None] = release_free_memory,
    ) -> None:
        self.policy = policy or IdleTrim()
        self.tick = tick
        self.settle = settle
        self._cpu = cpu
        self._release = release
        self._loop: asyncio.AbstractEventLoop | None = None
        self._periodic: asyncio.TimerHandle | None = None
        self._settling: asyncio.TimerHandle | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._look()  # the first window starts now
        self._periodic = loop.call_later(self.tick, self._periodic_look)

    def stop(self) -> None:
        for handle in (self._periodic, self._settling):
            if handle is not None:
                handle.cancel()
        self._periodic = self._settling = None
        self._loop = None

    def poke(self) -> None:
        """Something that may have ended the traffic happened: look now (what ran until now was
        work) and again `settle` later (idle by then if the traffic stopped)."""
        loop = self._loop
        if loop is None or self._settling is not None:
            return
        self._look()
        self._settling = loop.call_later(self.settle, self._settled)

    def _settled(self) -> None:
        self._settling = None
        self._look()

    def _periodic_look(self) -> None:
        self._look()
        assert self._loop is not None  # `stop` cancels this callback
        self._periodic = self._loop.call_later(self.tick, self._periodic_look)

    def _look(self) -> None:
        loop = self._loop
        assert loop is not None
        if self.policy.tick(loop.time(), self._cpu()):
            loop.call_soon(self._release)  # not inside whatever poked (a connection's close)
