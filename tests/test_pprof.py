"""`/debug/pprof/*` on a live pair of `ztunnel proxy` processes: the profiles decode with the
published `profile.proto` (compiled here with grpcio-tools) and name the proxy's own functions."""

from __future__ import annotations

import asyncio
import gzip
import os
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from types import ModuleType
from typing import Any

import pytest

from tests.apps import echo_roundtrip, loopback_net, sha, start_echo, workload_yaml
from tests.harness import Fleet, Proxy, proxy_env
from ztunnel.admin import profiling

NET = loopback_net()
SERVER, CLIENT = f"{NET}.3", f"{NET}.2"

CONFIG = f"""
workloads:{workload_yaml("server", SERVER)}{workload_yaml("client", CLIENT)}
"""


@pytest.fixture(scope="module")
def proxies(module_fleet: Fleet) -> tuple[Proxy, Proxy]:
    """Started once for the module (a start costs seconds); no test here counts anything."""
    server, client = module_fleet.start_all(
        proxy_env(SERVER, "demo/server/server", CONFIG),
        proxy_env(CLIENT, "demo/client/client", CONFIG),
    )
    return server, client


@pytest.fixture
async def pair(proxies: tuple[Proxy, Proxy]) -> AsyncIterator[tuple[Proxy, Proxy]]:
    echo = await start_echo(SERVER, 8080)
    try:
        yield proxies
    finally:
        echo.server.close()


def fetch(url: str) -> tuple[int, dict[str, str], bytes]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


async def traffic_for(seconds: float) -> int:
    """HBONE round trips through the pair for `seconds`; returns how many succeeded."""
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    done = 0
    payload = os.urandom(256 * 1024)
    while loop.time() < end:
        ex = await echo_roundtrip((CLIENT, 15080), SERVER, 8080, payload)
        assert ex.code == 0 and ex.digest == sha(payload)
        done += 1
    return done


def functions_in(profile: Any) -> dict[str, int]:
    """Function name -> the first value (samples or objects) of the samples whose stack holds it."""
    names = {f.id: profile.string_table[f.name] for f in profile.function}
    by_location = {loc.id: [names[line.function_id] for line in loc.line] for loc in profile.location}
    out: dict[str, int] = {}
    for sample in profile.sample:
        for fn in {n for loc in sample.location_id for n in by_location[loc]}:
            out[fn] = out.get(fn, 0) + sample.value[0]
    return out


async def test_cpu_profile_names_the_proxy_functions(
    pair: tuple[Proxy, Proxy], profile_pb2: ModuleType
) -> None:
    url = f"http://{CLIENT}:15000/debug/pprof/profile?seconds=2&frequency=200"
    reply, done = await asyncio.gather(asyncio.to_thread(fetch, url), traffic_for(2.5))
    status, headers, body = reply
    assert status == 200, body
    assert headers["Content-Type"] == "application/octet-stream"
    assert done > 0
    profile = profile_pb2.Profile.FromString(gzip.decompress(body))
    strings = profile.string_table
    assert strings[0] == ""
    assert [(strings[t.type], strings[t.unit]) for t in profile.sample_type] == [
        ("samples", "count"),
        ("cpu", "nanoseconds"),
    ]
    assert (strings[profile.period_type.type], strings[profile.period_type.unit]) == ("cpu", "nanoseconds")
    assert profile.period == 5_000_000
    assert profile.duration_nanos == 2_000_000_000
    assert all(len(s.value) == 2 and s.value[0] >= 1 and s.value[1] > 0 for s in profile.sample)
    assert {strings[label.key] for s in profile.sample for label in s.label} == {"pid"}
    functions = functions_in(profile)
    ours = [fn for fn in functions if fn.startswith(("hbone.", "ztunnel.proxy."))]
    assert ours, sorted(functions)[:50]


async def test_heap_profile_names_the_proxy_functions(
    pair: tuple[Proxy, Proxy], profile_pb2: ModuleType
) -> None:
    status, _, body = await asyncio.to_thread(fetch, f"http://{CLIENT}:15000/debug/pprof/heap/profiling")
    assert (status, body) == (200, b"heap profiling is inactive\n")
    # Not switched on: the request traces for `seconds`, during which the proxy carries traffic.
    url = f"http://{CLIENT}:15000/debug/pprof/heap?seconds=2"
    reply, _ = await asyncio.gather(asyncio.to_thread(fetch, url), traffic_for(1.5))
    status, _, body = reply
    assert status == 200, body
    profile = profile_pb2.Profile.FromString(gzip.decompress(body))
    strings = profile.string_table
    assert [(strings[t.type], strings[t.unit]) for t in profile.sample_type] == [
        ("inuse_objects", "count"),
        ("inuse_space", "bytes"),
    ]
    assert all(s.value[0] >= 1 and s.value[1] > 0 for s in profile.sample)
    functions = functions_in(profile)
    assert [fn for fn in functions if fn.startswith(("hbone.", "ztunnel."))], sorted(functions)[:50]
    # Tracing ended with the request: switched on only on demand.
    status, _, body = await asyncio.to_thread(fetch, f"http://{CLIENT}:15000/debug/pprof/heap/profiling")
    assert body == b"heap profiling is inactive\n"

    status, _, body = await asyncio.to_thread(
        fetch, f"http://{CLIENT}:15000/debug/pprof/heap/profiling?activate=true"
    )
    assert (status, body) == (200, b"heap profiling is active\n")
    await traffic_for(0.3)
    status, _, body = await asyncio.to_thread(fetch, f"http://{CLIENT}:15000/debug/pprof/heap")
    assert status == 200
    assert profile_pb2.Profile.FromString(gzip.decompress(body)).sample


@pytest.mark.parametrize(
    "query",
    ["seconds=0", "seconds=301", "seconds=abc", "frequency=0", "frequency=1001", "seconds=-1"],
)
async def test_bad_profile_parameters_are_400(pair: tuple[Proxy, Proxy], query: str) -> None:
    status, _, body = await asyncio.to_thread(fetch, f"http://{CLIENT}:15000/debug/pprof/profile?{query}")
    assert status == 400
    assert body.startswith(b"invalid ")


async def test_one_cpu_profile_at_a_time(pair: tuple[Proxy, Proxy]) -> None:
    base = f"http://{CLIENT}:15000/debug/pprof/profile"

    async def profile(seconds: int) -> tuple[int, dict[str, str], bytes]:
        return await asyncio.to_thread(fetch, f"{base}?seconds={seconds}")

    long = asyncio.create_task(profile(4))
    refused = None
    # Short profiles until one meets the long one running (either may reach the profiler first, and
    # the one that comes second is refused).
    for _ in range(20):
        status, _, body = await profile(1)
        if status == 409:
            refused = body
            break
        assert status == 200
        if long.done():
            long_status, _, long_body = long.result()
            long = asyncio.create_task(profile(4))  # again, for the end below
            if long_status == 409:  # it came second, while this short one ran
                refused = long_body
                break
    assert refused == b"a CPU profile is already being collected\n"
    assert (await long)[0] == 200


async def test_overlapping_heap_profiles_both_answer() -> None:
    """Two timed heap profiles at once: the first to end does not switch tracing off under the other."""
    first = asyncio.create_task(profiling.collect_heap_profile(0.3))
    await asyncio.sleep(0)  # the first is tracing now
    second = asyncio.create_task(profiling.collect_heap_profile(0.6))
    kept = [bytearray(1000) for _ in range(100)]  # allocated inside both windows, still alive
    a, b = await asyncio.gather(first, second)
    assert a.samples and b.samples and kept
    assert b.duration_nanos >= 500_000_000  # the second traced its own window too
    assert not profiling.heap_profiling_active()  # off again once both ended


def test_merge_sums_per_stack_and_keeps_workers_apart() -> None:
    frame = profiling.Frame("ztunnel.proxy.x", "x.py", 1, 2)
    a = profiling.Profile((("samples", "count"), ("cpu", "nanoseconds")), ("cpu", "nanoseconds"), 10, 5, 7)
    a.add((frame,), (1, 10), (("pid", 1),))
    a.add((frame,), (2, 20), (("pid", 1),))
    b = profiling.Profile.from_dict(a.as_dict())
    b.samples = {((frame,), (("pid", 2),)): [4, 40]}
    merged = profiling.merge([a, b])
    assert merged.samples == {((frame,), (("pid", 1),)): [3, 30], ((frame,), (("pid", 2),)): [4, 40]}
    heap = profiling.Profile((("inuse_objects", "count"),), ("space", "bytes"), 1, 0, 0)
    with pytest.raises(ValueError, match="different sample types"):
        profiling.merge([a, heap])
