"""The proxy's allocator settings: relay-sized buffers allocated and freed over and over stay in the
heap instead of being mapped, zeroed and unmapped each time (seen as page faults)."""

from __future__ import annotations

import asyncio
import json
import platform
import subprocess
import sys

import pytest

from ztunnel.allocator import IdleTrim, IdleTrimmer

# Allocates and frees 2 MiB blocks (the size of a large TLS write) 400 times, after one warm-up
# round; prints whether the tuning took and the minor page faults of the 400.
_CHURN = """
import json, resource, sys
from ztunnel.allocator import tune_allocator
tuned = tune_allocator(json.loads(sys.argv[1]))
def cycle():
    keep = [bytes(bytearray(2 << 20)) for _ in range(4)]
    del keep
cycle()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(100):
    cycle()
print(json.dumps([tuned, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before]))
"""


def _churn(environ: str) -> tuple[bool, int]:
    out = subprocess.run(
        [sys.executable, "-c", _CHURN, environ], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    tuned, faults = json.loads(out)
    return tuned, faults


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the thresholds are glibc's")
def test_tuned_allocator_reuses_large_blocks_without_page_faults() -> None:
    tuned, faults = _churn("{}")
    assert tuned
    # Untuned, each 2 MiB block is faulted in page by page: 512 faults a block, ~200,000 here.
    untuned_ok, untuned_faults = _churn('{"MALLOC_TRIM_THRESHOLD_": "131072"}')
    assert not untuned_ok  # the operator's glibc variable wins: nothing is set
    assert untuned_faults > 100_000
    assert faults < untuned_faults // 100


def test_idle_trim_gives_memory_back_once_work_is_followed_by_an_idle_tick() -> None:
    trim = IdleTrim(idle_share=0.02, min_work=0.05)
    assert not trim.tick(0.0, 0.0)  # the first look only sets the baseline
    # Traffic: every tick busy (60 % of the CPU), nothing given back while it flows.
    assert [trim.tick(0.1 * i, 0.06 * i) for i in range(1, 6)] == [False] * 5
    assert trim.tick(0.6, 0.3005)  # it stopped: the first idle tick trims
    assert not trim.tick(0.7, 0.301)  # and only once
    assert not trim.tick(0.8, 0.301)


def test_idle_trim_leaves_a_process_doing_little_alone() -> None:
    trim = IdleTrim(idle_share=0.02, min_work=0.05)
    trim.tick(0.0, 0.0)
    # A heartbeat, a counter push or a scrape now and then: less work in all than a trim is worth.
    cpu, results = 0.0, []
    for i in range(1, 40):
        cpu += 0.01 if i % 10 == 0 else 0.0001
        results.append(trim.tick(0.1 * i, cpu))
    assert not any(results)
    # Enough of them add up to work worth giving back.
    for i in range(40, 80):
        cpu += 0.01 if i % 10 == 0 else 0.0001
        results.append(trim.tick(0.1 * i, cpu))
    assert any(results)


def test_idle_trim_gives_back_at_most_once_a_second() -> None:
    trim = IdleTrim(idle_share=0.02, min_work=0.05, min_interval=1.0)
    trim.tick(0.0, 0.0)
    assert not trim.tick(0.1, 0.1)
    assert trim.tick(0.2, 0.1)
    # Traffic that pauses every 200 ms: the next trims wait for the second to pass.
    now, cpu, trimmed = 0.2, 0.1, []
    for _ in range(10):
        now, cpu = now + 0.1, cpu + 0.1
        assert not trim.tick(now, cpu)  # busy
        now += 0.1
        if trim.tick(now, cpu):  # a pause
            trimmed.append(round(now, 1))
    assert trimmed == [1.2, 2.2]


def test_idle_trim_judges_a_late_tick_by_its_length() -> None:
    trim = IdleTrim(idle_share=0.02, min_work=0.05)
    trim.tick(0.0, 0.0)
    assert not trim.tick(0.1, 0.08)  # busy
    # A tick that came 2 s late with 10 ms of CPU in it was idle (0.5 %), not busy.
    assert trim.tick(2.1, 0.09)


async def test_trimming_releases_after_a_burst() -> None:
    cpu = [0.0]
    released = asyncio.Event()
    trimmer = IdleTrimmer(tick=0.01, cpu=lambda: cpu[0], release=released.set)
    trimmer.start(asyncio.get_running_loop())
    try:
        for _ in range(20):  # a burst: 100 % of the CPU (10 ms a tick) for 20 ticks
            cpu[0] += 0.01
            await asyncio.sleep(0.01)  # the simulated CPU time's pace: the stimulus
        await asyncio.wait_for(released.wait(), 10.0)  # then idle (the policy's tests say when)
    finally:
        trimmer.stop()


async def test_a_closed_connection_brings_the_look_that_gives_memory_back() -> None:
    """A worker's trimmer wakes once a second, not ten times: traffic that stops with its
    connections (a poke per close) is seen `settle` after the last close, and a burst of closes
    makes one look, not one per close."""
    cpu = [0.0]
    looks = [0]
    released = asyncio.Event()

    def read_cpu() -> float:
        looks[0] += 1
        return cpu[0]

    trimmer = IdleTrimmer(tick=10.0, settle=0.05, cpu=read_cpu, release=released.set)
    trimmer.start(asyncio.get_running_loop())
    try:
        for _ in range(10):  # a busy stretch: 100 % of the CPU for 0.1 s, no connection closing
            cpu[0] += 0.01
            await asyncio.sleep(0.01)  # the simulated CPU time's pace: the stimulus
        assert looks[0] == 1  # only the start's: the periodic look is 10 s away
        for _ in range(50):
            trimmer.poke()  # the connections close, all at once
        assert looks[0] == 2  # the first poke looked (the busy stretch counted as work)
        await asyncio.wait_for(released.wait(), 10.0)
        assert looks[0] == 3  # and one look `settle` later saw the idle
    finally:
        trimmer.stop()


async def test_traffic_that_stops_on_held_connections_is_seen_by_the_periodic_look() -> None:
    cpu = [0.0]
    released = asyncio.Event()
    trimmer = IdleTrimmer(tick=0.05, settle=10.0, cpu=lambda: cpu[0], release=released.set)
    trimmer.start(asyncio.get_running_loop())
    try:
        for _ in range(20):
            cpu[0] += 0.01
            await asyncio.sleep(0.01)  # the simulated CPU time's pace: the stimulus
        await asyncio.wait_for(released.wait(), 10.0)  # no poke: the periodic look finds it idle
    finally:
        trimmer.stop()


async def test_a_stopped_trimmer_looks_no_more() -> None:
    looks = [0]

    def read_cpu() -> float:
        looks[0] += 1
        return 0.0

    trimmer = IdleTrimmer(tick=0.01, settle=0.01, cpu=read_cpu, release=lambda: None)
    trimmer.start(asyncio.get_running_loop())
    trimmer.stop()
    trimmer.poke()
    await asyncio.sleep(0.05)  # a negative check: five ticks' time for a wrong look to show
    assert looks[0] == 1  # the start's only
