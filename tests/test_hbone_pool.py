"""The HBONE connection pool, with a fake connector, an injected clock and jitter: reuse, the
stream limit, idle release, and dials shared by their waiters, backed off after failures, stopped by
a drain, never holding up another key."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import replace
from typing import cast

import pytest

from hbone.errors import ConnectionClosed
from hbone.identity import Identity
from hbone.pool import Backoff, Pool, PoolKey
from hbone.stream import HboneStream
from tests.waiting import eventually_async

pytestmark = pytest.mark.timeout(10)

SRC = Identity("cluster.local", "ns", "client")
DST = Identity("cluster.local", "ns", "server")
KEY = PoolKey(SRC, (DST,), ("10.0.0.2", 15008), "10.0.0.1")


class FakeConnection:
    def __init__(self, key: PoolKey, max_streams: int = 100) -> None:
        self.key = key
        self.max_streams = max_streams
        self.active_streams = 0
        self.usable = True
        self.closed = False
        self.aborted = False
        self.authorities: list[str] = []

    def is_usable(self) -> bool:
        return self.usable and not self.closed and not self.aborted

    async def connect(
        self, authority: str, headers: Sequence[tuple[str, str]] = (), early_data: bytes = b""
    ) -> HboneStream:
        self.authorities.append(authority)
        self.active_streams += 1
        return cast(HboneStream, (self, authority, tuple(headers)))  # a stand-in the tests compare

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Connector:
    def __init__(self, max_streams: int = 100, delay: float = 0.0) -> None:
        self.dials: list[PoolKey] = []
        self.made: list[FakeConnection] = []
        self.max_streams = max_streams
        self.delay = delay
        self.fail_next = 0
        self.gate: asyncio.Event | None = None  # when set: each dial waits for it
        self.cancelled = 0
        self.dead_on_arrival = False  # the connections made are unusable at once

    async def __call__(self, key: PoolKey) -> FakeConnection:
        self.dials.append(key)
        if self.delay:
            await asyncio.sleep(self.delay)  # a slow dial: the stimulus
        if self.gate is not None:
            try:
                await self.gate.wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        if self.fail_next:
            self.fail_next -= 1
            raise OSError("connection refused")
        conn = FakeConnection(key, self.max_streams)
        conn.usable = not self.dead_on_arrival
        self.made.append(conn)
        return conn


@pytest.fixture
async def pool_parts():
    made: list[Pool[FakeConnection]] = []

    def make(connector: Connector, **kw: object) -> Pool[FakeConnection]:
        p: Pool[FakeConnection] = Pool(connector, **kw)  # type: ignore[arg-type]  # kwargs as object
        made.append(p)
        return p

    yield make
    for p in made:
        await p.close()


async def test_same_key_reuses_connection(pool_parts) -> None:
    dial = Connector()
    pool = pool_parts(dial)
    a = await pool.checkout(KEY)
    b = await pool.checkout(PoolKey(SRC, (DST,), ("10.0.0.2", 15008), "10.0.0.1"))  # equal, not identical
    assert a is b
    assert len(dial.dials) == 1


@pytest.mark.parametrize(
    "other",
    [
        replace(KEY, src_identity=Identity("cluster.local", "ns", "other-client")),
        replace(KEY, dst_identities=(DST, Identity("cluster.local", "ns", "waypoint"))),
        replace(KEY, dst_identities=()),
        replace(KEY, dst=("10.0.0.3", 15008)),
        replace(KEY, dst=("10.0.0.2", 15009)),
        replace(KEY, src_ip="10.0.0.9"),
        replace(KEY, src_ip=None),
    ],
)
async def test_keys_differing_in_any_field_do_not_share(pool_parts, other: PoolKey) -> None:
    dial = Connector()
    pool = pool_parts(dial)
    a = await pool.checkout(KEY)
    b = await pool.checkout(other)
    assert a is not b
    assert dial.dials == [KEY, other]


async def test_storm_of_checkouts_dials_once(pool_parts) -> None:
    dial = Connector(delay=0.01)
    pool = pool_parts(dial)
    conns = await asyncio.gather(*(pool.checkout(KEY) for _ in range(50)))
    assert len(dial.dials) == 1
    assert all(c is conns[0] for c in conns)


async def test_stream_limit_takes_connection_out_of_the_pool(pool_parts) -> None:
    dial = Connector()
    pool = pool_parts(dial, max_streams=100)
    first = [await pool.checkout(KEY) for _ in range(99)]
    assert all(c is first[0] for c in first)
    assert pool.pooled(KEY) is first[0]
    hundredth = await pool.checkout(KEY)
    assert hundredth is first[0]
    assert pool.pooled(KEY) is None  # full: out of the pool
    next_one = await pool.checkout(KEY)
    assert next_one is not first[0]
    assert len(dial.dials) == 2
    # Never re-added, even after its streams end.
    first[0].active_streams = 0
    for _ in range(5):
        assert await pool.checkout(KEY) is next_one


async def test_stream_limit_is_the_smaller_of_pool_and_server(pool_parts) -> None:
    dial = Connector(max_streams=3)  # the server advertised 3 concurrent streams
    pool = pool_parts(dial, max_streams=100)
    conns = [await pool.checkout(KEY) for _ in range(4)]
    assert conns[0] is conns[1] is conns[2]
    assert conns[3] is not conns[0]


async def test_connect_closes_a_departed_connection_once_its_stream_is_open(pool_parts) -> None:
    dial = Connector(max_streams=2)
    pool = pool_parts(dial)
    s1 = await pool.connect(KEY, "10.0.0.2:80", [("baggage", "x")])
    conn = dial.made[0]
    assert s1 == (conn, "10.0.0.2:80", (("baggage", "x"),))
    assert not conn.closed
    await pool.connect(KEY, "10.0.0.2:81")
    assert conn.authorities == ["10.0.0.2:80", "10.0.0.2:81"]
    assert conn.closed  # left the pool: it closes when its streams are done


async def test_idle_connection_is_released_after_timeout(pool_parts) -> None:
    clock = Clock()
    dial = Connector()
    pool = pool_parts(dial, idle_timeout=300.0, clock=clock)
    conn = await pool.checkout(KEY)
    clock.now += 299.0
    assert pool.release_idle() == 0
    assert await pool.checkout(KEY) is conn  # checkout refreshes the idle clock
    clock.now += 299.0
    assert pool.release_idle() == 0
    clock.now += 1.0
    assert pool.release_idle() == 1
    assert conn.closed
    assert pool.pooled(KEY) is None
    assert await pool.checkout(KEY) is not conn
    assert len(dial.dials) == 2


async def test_idle_release_runs_periodically(pool_parts) -> None:
    clock = Clock()
    dial = Connector()
    pool = pool_parts(dial, idle_timeout=0.1, clock=clock)
    conn = await pool.checkout(KEY)
    clock.now += 1.0
    await eventually_async(lambda: conn.closed, "the idle connection closed")
    assert conn.closed
    assert len(pool) == 0


async def test_unusable_connection_is_replaced(pool_parts) -> None:
    dial = Connector()
    pool = pool_parts(dial)
    conn = await pool.checkout(KEY)
    conn.usable = False  # e.g. GOAWAY received
    fresh = await pool.checkout(KEY)
    assert fresh is not conn
    assert conn.closed
    assert len(dial.dials) == 2


async def test_failed_dial_propagates_and_next_checkout_dials_again(pool_parts) -> None:
    dial = Connector()
    dial.fail_next = 1
    pool = pool_parts(dial)
    with pytest.raises(OSError):
        await pool.checkout(KEY)
    conn = await pool.checkout(KEY)
    assert conn is dial.made[0]
    assert len(dial.dials) == 2


async def test_close_stops_everything(pool_parts) -> None:
    dial = Connector(max_streams=2)
    pool = pool_parts(dial)
    departed = await pool.checkout(KEY)
    assert await pool.checkout(KEY) is departed  # second stream: out of the pool
    pooled = await pool.checkout(replace(KEY, src_ip=None))
    assert pool.pooled(KEY) is None and pool.pooled(replace(KEY, src_ip=None)) is pooled
    await pool.close()
    assert departed.aborted and pooled.aborted
    with pytest.raises(ConnectionClosed):
        await pool.checkout(KEY)


# --- the backoff policy, pure -------------------------------------------------------------------


def test_backoff_doubles_from_25ms_to_1s_with_jitter_between_half_and_all() -> None:
    top, bottom = Backoff(), Backoff()
    ceilings = [0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0]
    for ceiling in ceilings:
        assert top.failed(100.0, 0.999999) == pytest.approx(ceiling, rel=1e-5)
        assert bottom.failed(100.0, 0.0) == pytest.approx(ceiling / 2)
    assert top.failures == len(ceilings)
    assert top.wait(100.0) == pytest.approx(1.0, rel=1e-5)
    assert top.wait(100.4) == pytest.approx(0.6, rel=1e-4)
    assert top.wait(101.5) == 0.0
    for _ in range(100):  # many failures in a row: still at most 1 s
        top.failed(100.0, 0.999999)
    assert top.wait(100.0) <= 1.0


def test_backoff_resets_on_success_and_is_forgotten_after_a_quiet_second() -> None:
    b = Backoff()
    assert b.settled(0.0) and b.wait(0.0) == 0.0
    b.failed(10.0, 0.5)  # 18.75 ms
    assert not b.settled(10.5)
    assert b.settled(10.01875 + 1.0)
    b.failed(20.0, 0.5)
    b.succeeded()
    assert b.failures == 0 and b.wait(20.0) == 0.0 and b.settled(20.0)


# --- dials shared, failing at once, backed off, drained -----------------------------------------


async def test_waiters_share_one_dial_and_its_failure_reaches_them_all_at_once(pool_parts) -> None:
    dial = Connector()
    dial.gate = asyncio.Event()
    dial.fail_next = 1
    pool = pool_parts(dial)
    loop = asyncio.get_running_loop()
    ended: list[float] = []

    async def one() -> BaseException | None:
        try:
            await pool.checkout(KEY)
        except OSError as e:
            ended.append(loop.time())
            return e
        return None

    waiters = [asyncio.ensure_future(one()) for _ in range(5)]
    await eventually_async(lambda: dial.dials and pool.dialing(KEY), "the dial under way")
    await asyncio.sleep(0.05)  # a negative check: time for a second dial or a waiter's end to show
    assert len(dial.dials) == 1 and pool.dialing(KEY)
    assert not any(w.done() for w in waiters)
    dial.gate.set()
    errors = await asyncio.gather(*waiters)
    assert all(isinstance(e, OSError) and str(e) == "connection refused" for e in errors)
    assert len(dial.dials) == 1  # nobody dialled again in turn
    assert max(ended) - min(ended) < 0.1  # together (a loaded machine may pause between them)
    assert not pool.dialing(KEY)


async def test_a_failed_key_backs_off_before_its_next_dial(pool_parts) -> None:
    clock = Clock()
    dial = Connector()
    dial.fail_next = 3
    pool = pool_parts(dial, clock=clock, jitter=lambda: 0.999999)
    loop = asyncio.get_running_loop()
    with pytest.raises(OSError):
        await pool.checkout(KEY)  # no backoff before the first dial
    backoff = pool.backoff(KEY)
    assert backoff is not None and backoff.failures == 1
    assert backoff.wait(clock.now) == pytest.approx(0.025, rel=1e-4)
    started = loop.time()
    with pytest.raises(OSError):
        await pool.checkout(KEY)  # waits out 25 ms (the fake clock stands still), then dials
    assert loop.time() - started >= 0.02
    assert len(dial.dials) == 2
    assert backoff.wait(clock.now) == pytest.approx(0.05, rel=1e-4)  # doubled
    clock.now += 1.0  # the window passed: the next dial starts at once
    task = asyncio.ensure_future(pool.checkout(KEY))
    await asyncio.sleep(0)
    assert pool.dialing(KEY)  # started in the checkout's first step: no wait
    with pytest.raises(OSError):
        await task
    assert len(dial.dials) == 3
    clock.now += 1.0
    conn = await pool.checkout(KEY)
    assert conn is dial.made[0]
    assert pool.backoff(KEY) is None  # a connection made resets it


async def test_backoffs_of_keys_never_reached_are_forgotten_once_stale(pool_parts) -> None:
    """Keys whose every dial failed (peers that are gone) leave nothing behind: the reaper forgets
    their backoffs a quiet second after their last window, as it does for keys once connected."""
    clock = Clock()
    dial = Connector()
    dial.fail_next = 1000
    pool = pool_parts(dial, idle_timeout=0.1, clock=clock)
    keys = [replace(KEY, dst=(f"10.0.1.{i}", 15008)) for i in range(5)]
    for key in keys:
        with pytest.raises(OSError):
            await pool.checkout(key)
    assert all(pool.backoff(key) is not None for key in keys)
    clock.now += 0.5  # within a second of the last window: still remembered
    await asyncio.sleep(0.2)  # a negative check: two rounds of the reaper (every 50 ms here)
    assert all(pool.backoff(key) is not None for key in keys)
    clock.now += 1.0
    await eventually_async(
        lambda: all(pool.backoff(key) is None for key in keys), "the stale backoffs forgotten"
    )


async def test_a_dial_outlives_a_waiter_that_gives_up(pool_parts) -> None:
    dial = Connector()
    dial.gate = asyncio.Event()
    pool = pool_parts(dial)
    quitter = asyncio.ensure_future(pool.checkout(KEY))
    stayer = asyncio.ensure_future(pool.checkout(KEY))
    await eventually_async(lambda: dial.dials, "the dial under way")
    quitter.cancel()
    await asyncio.sleep(0.01)  # a negative check: time for a wrong cancel of the dial to show
    assert dial.cancelled == 0 and pool.dialing(KEY)
    dial.gate.set()
    assert await stayer is dial.made[0]
    assert len(dial.dials) == 1
    assert quitter.cancelled()


async def test_a_silent_peer_holds_up_no_other_key(pool_parts) -> None:
    dial = Connector()
    pool = pool_parts(dial)
    silent = replace(KEY, dst=("10.0.0.9", 15008))
    dial.gate = asyncio.Event()  # the silent peer's dial never ends
    stuck = [asyncio.ensure_future(pool.checkout(silent)) for _ in range(5)]
    await eventually_async(lambda: dial.dials, "the silent peer's dial under way")
    dial.gate = None
    conn = await asyncio.wait_for(pool.checkout(KEY), 1.0)
    assert conn.key == KEY and not any(t.done() for t in stuck)
    await pool.close()
    for t in stuck:
        with pytest.raises(ConnectionClosed):
            await t
    assert dial.cancelled == 1  # the one dial, cancelled by close


async def test_drain_stops_new_dials_only(pool_parts) -> None:
    dial = Connector()
    pool = pool_parts(dial)
    warm = await pool.checkout(KEY)
    other = replace(KEY, dst=("10.0.0.3", 15008))
    dial.gate = asyncio.Event()
    in_flight = asyncio.ensure_future(pool.checkout(other))
    await eventually_async(lambda: len(dial.dials) == 2, "the other key's dial under way")
    pool.drain()
    assert await pool.checkout(KEY) is warm  # the pooled connection still serves
    with pytest.raises(ConnectionClosed, match="draining"):
        await pool.checkout(replace(KEY, dst=("10.0.0.4", 15008)))
    dial.gate.set()
    assert (await in_flight).key == other  # the dial in progress finished for its waiter
    assert len(dial.dials) == 2


async def test_waiters_beyond_the_stream_limit_share_the_next_dial(pool_parts) -> None:
    dial = Connector(delay=0.01)
    pool = pool_parts(dial, max_streams=100)
    conns = await asyncio.gather(*(pool.checkout(KEY) for _ in range(150)))
    assert len(dial.dials) == 2
    first, second = dial.made
    assert conns.count(first) == 100 and conns.count(second) == 50
    assert pool.pooled(KEY) is second


async def test_waiters_of_a_one_stream_dial_each_get_a_connection(pool_parts) -> None:
    """With one stream per connection (the bench's handshake proxy), the first waiter of a shared
    dial takes its connection, which leaves the pool and is closed once its stream is open: the
    other waiters dial again instead of failing ("closed as it was made" is for a connection that
    closed before anyone took it)."""
    dial = Connector(max_streams=1)
    dial.gate = asyncio.Event()
    pool = pool_parts(dial, max_streams=1)
    waiters = [asyncio.ensure_future(pool.connect(KEY, f"10.0.0.2:{8000 + i}")) for i in range(3)]
    await eventually_async(lambda: pool.dialing(KEY), "the shared dial under way")
    dial.gate.set()
    streams = await asyncio.gather(*waiters)
    assert [s[1] for s in streams] == ["10.0.0.2:8000", "10.0.0.2:8001", "10.0.0.2:8002"]  # type: ignore[index]
    assert len(dial.made) == 3 and all(c.closed and c.active_streams == 1 for c in dial.made)


async def test_a_connection_closed_as_it_was_made_fails_all_its_waiters(pool_parts) -> None:
    dial = Connector()
    dial.gate = asyncio.Event()
    dial.dead_on_arrival = True  # the peer says GOAWAY as the connection is made
    pool = pool_parts(dial)
    waiters = [asyncio.ensure_future(pool.checkout(KEY)) for _ in range(3)]
    await eventually_async(lambda: pool.dialing(KEY), "the shared dial under way")
    dial.gate.set()
    results = await asyncio.gather(*waiters, return_exceptions=True)
    assert [str(r) for r in results] == ["HBONE connection closed as it was made"] * 3
    assert len(dial.dials) == 1  # one dial, its end seen by all: no dial again in a loop
