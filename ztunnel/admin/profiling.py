"""Profiling a live proxy: CPU and heap profiles in pprof's format, for `/debug/pprof/*`.

This module owns the in-process samplers and the profile model:

* `collect_cpu_profile(seconds, frequency)`: a thread wakes `frequency` times a second, reads every
  other thread's CPU clock and Python stack (`sys._current_frames()`), and charges the CPU time each
  thread used since the last tick to the stack it is in now. Idle threads (the event loop waiting in
  epoll) use no CPU and so add nothing: this is a CPU profile, not a wall-clock one.
* `collect_heap_profile(seconds)`: the live allocations `tracemalloc` sees, by allocating stack. If
  tracing was not switched on (`set_heap_profiling(True)`), it is switched on for `seconds` and off
  again, so the profile holds what was allocated in that window and is still alive.
* `Profile`, a plain value (picklable, `as_dict()`/`from_dict()` for a worker's report), `merge()`
  of several (one per worker process, labelled with their `pid`), and `encode()`: the gzipped
  protobuf of `profile.proto` (vendored beside this module), written by hand so that the proxy needs
  no protobuf runtime for it.

Nothing here runs unless a profile is asked for: no hook, no thread, no tracing on the data path.
"""

from __future__ import annotations

import asyncio
import functools
import gzip
import os
import sys
import threading
import time
import tracemalloc
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import CodeType, FrameType
from typing import Any

MAX_SECONDS = 300
MAX_FREQUENCY = 1000
DEFAULT_SECONDS = 10
DEFAULT_FREQUENCY = 100
# Deepest stack kept per sample (the leaf end is kept when a stack is deeper).
MAX_DEPTH = 64
HEAP_FRAMES = 32


@dataclass(frozen=True, order=True)
class Frame:
    """One stack frame: the function (module-qualified), its file and first line, the line running."""

    function: str
    filename: str
    start_line: int
    line: int


Stack = tuple[Frame, ...]  # leaf first, as pprof orders locations
Labels = tuple[tuple[str, int], ...]  # numeric sample labels, e.g. (("pid", 1234),)


@dataclass
class Profile:
    """Samples by (stack, labels), each a list of values in the order of `sample_types`."""

    sample_types: tuple[tuple[str, str], ...]
    period_type: tuple[str, str]
    period: int
    time_nanos: int
    duration_nanos: int
    samples: dict[tuple[Stack, Labels], list[int]] = field(default_factory=dict)

    def add(self, stack: Stack, values: Sequence[int], labels: Labels = ()) -> None:
        current = self.samples.get((stack, labels))
        if current is None:
            self.samples[(stack, labels)] = list(values)
        else:
            for i, v in enumerate(values):
                current[i] += v

    def as_dict(self) -> dict[str, Any]:
        """Plain lists and numbers, for a worker to send its profile to the parent."""
        return {
            "sample_types": [list(t) for t in self.sample_types],
            "period_type": list(self.period_type),
            "period": self.period,
            "time_nanos": self.time_nanos,
            "duration_nanos": self.duration_nanos,
            "samples": [
                {
                    "stack": [[f.function, f.filename, f.start_line, f.line] for f in stack],
                    "labels": [list(label) for label in labels],
                    "values": values,
                }
                for (stack, labels), values in self.samples.items()
            ],
        }

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> Profile:
        profile = cls(
            sample_types=tuple((str(t), str(u)) for t, u in doc["sample_types"]),
            period_type=(str(doc["period_type"][0]), str(doc["period_type"][1])),
            period=int(doc["period"]),
            time_nanos=int(doc["time_nanos"]),
            duration_nanos=int(doc["duration_nanos"]),
        )
        for s in doc["samples"]:
            stack = tuple(Frame(str(f), str(fn), int(sl), int(ln)) for f, fn, sl, ln in s["stack"])
            labels = tuple((str(k), int(v)) for k, v in s["labels"])
            profile.add(stack, [int(v) for v in s["values"]], labels)
        return profile


def merge(profiles: Iterable[Profile]) -> Profile:
    """One profile of several of the same kind (e.g. one per worker): samples summed per stack."""
    items = list(profiles)
    if not items:
        raise ValueError("no profiles to merge")
    first = items[0]
    merged = Profile(
        first.sample_types,
        first.period_type,
        first.period,
        min(p.time_nanos for p in items),
        max(p.duration_nanos for p in items),
    )
    for p in items:
        if p.sample_types != first.sample_types:
            raise ValueError("cannot merge profiles of different sample types")
        for (stack, labels), values in p.samples.items():
            merged.add(stack, values, labels)
    return merged


# --- CPU ---------------------------------------------------------------------------------------


class ProfileBusy(Exception):
    """A CPU profile is already being collected in this process."""


_cpu_lock = threading.Lock()


def _frame_of(frame: FrameType) -> Frame:
    code = frame.f_code
    module = frame.f_globals.get("__name__", "")
    name = f"{module}.{code.co_qualname}" if module else code.co_qualname
    return Frame(name, code.co_filename, code.co_firstlineno, frame.f_lineno or 0)


def _stack_of(frame: FrameType | None) -> Stack:
    out: list[Frame] = []
    while frame is not None and len(out) < MAX_DEPTH:
        out.append(_frame_of(frame))
        frame = frame.f_back
    return tuple(out)


def _thread_cpu_ns(ident: int) -> int | None:
    try:
        return time.clock_gettime_ns(time.pthread_getcpuclockid(ident))
    except (OSError, OverflowError):
        return None  # the thread ended between listing and reading it


def _sample_cpu(stop: threading.Event, interval: float, profile: Profile, labels: Labels) -> None:
    me = threading.get_ident()
    last: dict[int, int] = {}
    for ident in sys._current_frames():
        if ident != me and (cpu := _thread_cpu_ns(ident)) is not None:
            last[ident] = cpu
    while not stop.wait(interval):
        for ident, frame in sys._current_frames().items():
            if ident == me:
                continue
            cpu = _thread_cpu_ns(ident)
            if cpu is None:
                continue
            used = cpu - last.get(ident, cpu)
            last[ident] = cpu
            if used > 0:
                profile.add(_stack_of(frame), (1, used), labels)


async def collect_cpu_profile(seconds: float, frequency: int = DEFAULT_FREQUENCY) -> Profile:
    """Sample this process's threads for `seconds` at `frequency` Hz (the event loop keeps running).

    The function a worker process runs when its parent asks for a profile; raises ProfileBusy when
    one is already being collected here."""
    if not _cpu_lock.acquire(blocking=False):
        raise ProfileBusy("a CPU profile is already being collected")
    try:
        interval = 1.0 / frequency
        profile = Profile(
            sample_types=(("samples", "count"), ("cpu", "nanoseconds")),
            period_type=("cpu", "nanoseconds"),
            period=int(1e9 * interval),
            time_nanos=time.time_ns(),
            duration_nanos=int(seconds * 1e9),
        )
        stop = threading.Event()
        labels: Labels = (("pid", os.getpid()),)
        sampler = threading.Thread(
            target=_sample_cpu, args=(stop, interval, profile, labels), name="cpu-profiler", daemon=True
        )
        sampler.start()
        try:
            await asyncio.sleep(seconds)
        finally:
            # Also when cancelled (a drain, a client gone): the thread ends at its next tick.
            stop.set()
            await asyncio.to_thread(sampler.join)
        return profile
    finally:
        _cpu_lock.release()


# --- heap --------------------------------------------------------------------------------------

_heap_activated = False  # switched on by the operator (until switched off)
_heap_windows = 0  # timed heap profiles tracing now


def _heap_tracing_wanted() -> bool:
    return _heap_activated or _heap_windows > 0


def set_heap_profiling(active: bool) -> bool:
    """Switch allocation tracing on or off until switched again (a timed profile running keeps it
    on until it ends); returns whether it is on."""
    global _heap_activated
    _heap_activated = active
    if active and not tracemalloc.is_tracing():
        tracemalloc.start(HEAP_FRAMES)
    elif not _heap_tracing_wanted() and tracemalloc.is_tracing():
        tracemalloc.stop()
    return tracemalloc.is_tracing()


def heap_profiling_active() -> bool:
    return tracemalloc.is_tracing()


async def collect_heap_profile(seconds: float = DEFAULT_SECONDS) -> Profile:
    """The live allocations by stack: now if tracing is on, else after tracing for `seconds`."""
    global _heap_windows
    started = time.time_ns()
    timed = not _heap_activated  # else tracing has been on: answer at once
    if timed:
        _heap_windows += 1
        if not tracemalloc.is_tracing():
            tracemalloc.start(HEAP_FRAMES)
        try:
            await asyncio.sleep(seconds)
            snapshot = tracemalloc.take_snapshot()
        finally:
            _heap_windows -= 1
            if not _heap_tracing_wanted():
                tracemalloc.stop()
    else:
        snapshot = tracemalloc.take_snapshot()
    snapshot = snapshot.filter_traces((tracemalloc.Filter(False, tracemalloc.__file__),))
    profile = Profile(
        sample_types=(("inuse_objects", "count"), ("inuse_space", "bytes")),
        period_type=("space", "bytes"),
        period=1,
        time_nanos=started,
        duration_nanos=time.time_ns() - started if timed else 0,
    )
    labels: Labels = (("pid", os.getpid()),)
    for stat in snapshot.statistics("traceback"):
        stack = tuple(_heap_frame(f.filename, f.lineno) for f in reversed(stat.traceback))
        profile.add(stack, (stat.count, stat.size), labels)
    return profile


def _heap_frame(filename: str, line: int) -> Frame:
    """tracemalloc knows file and line only: the function is the innermost one defined there."""
    for start, end, name in reversed(_functions_in(filename)):
        if start <= line <= end:
            return Frame(name, filename, start, line)
    return Frame(f"{filename}:{line}", filename, 0, line)


@functools.lru_cache(maxsize=1024)
def _functions_in(filename: str) -> tuple[tuple[int, int, str], ...]:
    """(first line, last line, qualified name) of each function of the module loaded from
    `filename`, sorted by first line (so an inner function comes after the one enclosing it)."""
    module = next((m for m in list(sys.modules.values()) if getattr(m, "__file__", None) == filename), None)
    if module is None:
        return ()
    codes: dict[CodeType, None] = {}

    def visit(obj: object, depth: int) -> None:
        if depth > 3:
            return
        obj = getattr(obj, "__func__", obj)  # classmethod, staticmethod
        code = getattr(obj, "__code__", None)
        if isinstance(code, CodeType) and code.co_filename == filename:
            codes.setdefault(code)
        elif isinstance(obj, property):
            for f in (obj.fget, obj.fset, obj.fdel):
                visit(f, depth + 1)
        elif isinstance(obj, type) and getattr(obj, "__module__", None) == module.__name__:
            for value in list(vars(obj).values()):
                visit(value, depth + 1)

    for value in list(vars(module).values()):
        visit(value, 0)
    out = []
    pending = list(codes)
    while pending:
        code = pending.pop()
        lines = [ln for _, _, ln in code.co_lines() if ln is not None]
        if lines:
            out.append((code.co_firstlineno, max(lines), f"{module.__name__}.{code.co_qualname}"))
        pending.extend(c for c in code.co_consts if isinstance(c, CodeType))
    return tuple(sorted(out))


# --- pprof encoding ----------------------------------------------------------------------------


def _varint(n: int) -> bytes:
    if n < 0:
        n += 1 << 64  # int64 on the wire: two's complement in ten bytes
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _int_field(number: int, value: int) -> bytes:
    return _varint(number << 3) + _varint(value) if value else b""


def _bytes_field(number: int, value: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(value)) + value


def _packed(number: int, values: Iterable[int]) -> bytes:
    body = b"".join(_varint(v) for v in values)
    return _bytes_field(number, body) if body else b""


class _Strings:
    def __init__(self) -> None:
        self.table: list[str] = [""]
        self._index: dict[str, int] = {"": 0}

    def __call__(self, s: str) -> int:
        i = self._index.get(s)
        if i is None:
            i = self._index[s] = len(self.table)
            self.table.append(s)
        return i


def encode(profile: Profile) -> bytes:
    """The gzipped `perftools.profiles.Profile` message, as pprof viewers read it."""
    strings = _Strings()
    functions: dict[tuple[str, str, int], int] = {}
    locations: dict[Frame, int] = {}
    out: list[bytes] = []

    def value_type(t: tuple[str, str]) -> bytes:
        return _int_field(1, strings(t[0])) + _int_field(2, strings(t[1]))

    for t in profile.sample_types:
        out.append(_bytes_field(1, value_type(t)))
    for (stack, labels), values in profile.samples.items():
        ids = []
        for frame in stack:
            loc = locations.get(frame)
            if loc is None:
                key = (frame.function, frame.filename, frame.start_line)
                if key not in functions:
                    functions[key] = len(functions) + 1
                loc = locations[frame] = len(locations) + 1
            ids.append(loc)
        body = _packed(1, ids) + _packed(2, values)
        for label, num in labels:
            body += _bytes_field(3, _int_field(1, strings(label)) + _int_field(3, num))
        out.append(_bytes_field(2, body))
    for frame, loc in locations.items():
        fid = functions[(frame.function, frame.filename, frame.start_line)]
        line = _int_field(1, fid) + _int_field(2, frame.line)
        out.append(_bytes_field(4, _int_field(1, loc) + _bytes_field(4, line)))
    for (name, filename, start_line), fid in functions.items():
        n = strings(name)
        body = _int_field(1, fid) + _int_field(2, n) + _int_field(3, n)
        body += _int_field(4, strings(filename)) + _int_field(5, start_line)
        out.append(_bytes_field(5, body))
    # Every string is interned by now; the table goes after its users, as the format allows.
    period_type = _bytes_field(11, value_type(profile.period_type))
    tail = (
        _int_field(9, profile.time_nanos)
        + _int_field(10, profile.duration_nanos)
        + period_type
        + _int_field(12, profile.period)
    )
    table = b"".join(_bytes_field(6, s.encode()) for s in strings.table)
    return gzip.compress(b"".join(out) + table + tail, 6)
