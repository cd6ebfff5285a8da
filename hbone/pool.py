"""The client-side pool of HBONE connections.

One pool per proxy instance, so one per worker process for the same workload: each worker dials and
pools its own. Connections are shared only by callers with an equal `PoolKey`; per key the pool
hands out at most one connection at a time and runs at most one dial.

A checkout takes the key's pooled connection when it is usable. Otherwise it joins the key's dial in
progress, or starts one: every caller waiting for a key waits for that one dial, and its failure
reaches them all at once. The dial is a task of its own, so a caller that gives up does not cancel
it for the others. After a failed dial the key backs off (`Backoff`): the next dial waits 25 ms,
doubling with each failure in a row up to 1 s, with jitter; a connection made resets it, and the
idle reaper forgets it a second after its last window (a key no dial ever succeeded for included).
No lock is held, so one key's slow or silent peer never delays another key.

Streams are counted at checkout; the checkout that reaches the connection's stream limit takes it
out of the pool for good (the next caller dials anew), as the reference does. A pooled connection
not checked out for `idle_timeout` is released; a released or departed connection closes once its
last stream ends. `drain` stops new dials (pooled connections still serve); `close` aborts
everything. The clock and the jitter's random draw are inputs, so tests drive idle release and
backoff directly.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import weakref
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from hbone.errors import ConnectionClosed
from hbone.identity import Identity
from hbone.settings import POOL_BACKOFF_INITIAL, POOL_BACKOFF_MAX, POOL_IDLE_TIMEOUT, POOL_MAX_STREAMS
from hbone.stream import HboneStream

log = logging.getLogger("hbone")


@dataclass(frozen=True)
class PoolKey:
    src_identity: Identity
    dst_identities: tuple[Identity, ...]
    dst: tuple[str, int]  # the peer's HBONE address, port 15008 included
    src_ip: str | None


class PooledConnection(Protocol):
    """What the pool needs of a connection (`HboneConnection`, or a fake in tests)."""

    @property
    def max_streams(self) -> int: ...

    @property
    def active_streams(self) -> int: ...

    def is_usable(self) -> bool: ...

    async def connect(
        self, authority: str, headers: Sequence[tuple[str, str]] = (), early_data: bytes = b""
    ) -> HboneStream: ...

    def close(self) -> None: ...

    def abort(self) -> None: ...


C = TypeVar("C", bound=PooledConnection)


@dataclass(slots=True)
class Backoff:
    """One key's dials after failures: how long the next must wait. Pure: the time and the random
    draw are arguments."""

    failures: int = 0  # failed dials in a row
    retry_at: float = 0.0  # no dial starts before this

    def wait(self, now: float) -> float:
        """Seconds a dial wanted at `now` waits first (0: it starts at once)."""
        return max(self.retry_at - now, 0.0)

    def failed(self, now: float, draw: float) -> float:
        """A dial failed at `now`; `draw` is uniform in [0, 1). Returns the wait before the next: up
        to 25 ms doubled per failure in a row, at most 1 s, and at least half of that."""
        self.failures += 1
        ceiling = min(POOL_BACKOFF_INITIAL * 2 ** min(self.failures - 1, 16), POOL_BACKOFF_MAX)
        delay = ceiling * (0.5 + draw / 2)
        self.retry_at = now + delay
        return delay

    def succeeded(self) -> None:
        self.failures = 0
        self.retry_at = 0.0

    def settled(self, now: float) -> bool:
        """Nothing to remember: no failure, or none for the longest wait after the last window."""
        return self.failures == 0 or now - self.retry_at >= POOL_BACKOFF_MAX


class _Slot(Generic[C]):
    __slots__ = ("backoff", "conn", "dial", "last_used", "streams", "users")

    def __init__(self) -> None:
        self.conn: C | None = None
        self.streams = 0
        self.last_used = 0.0
        self.users = 0  # callers inside checkout; the slot is dropped when none and nothing else held
        self.dial: asyncio.Future[C] | None = None  # the dial in progress, which waiters share
        self.backoff = Backoff()


class Pool(Generic[C]):
    def __init__(
        self,
        connector: Callable[[PoolKey], Awaitable[C]],
        *,
        max_streams: int = POOL_MAX_STREAMS,
        idle_timeout: float = POOL_IDLE_TIMEOUT,
        clock: Callable[[], float] = time.monotonic,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        self._connector = connector
        self._max_streams = max_streams
        self._idle_timeout = idle_timeout
        self._clock = clock
        self._jitter = jitter
        self._slots: dict[PoolKey, _Slot[C]] = {}
        self._dialed: weakref.WeakSet[C] = weakref.WeakSet()
        self._dials: set[asyncio.Future[C]] = set()  # the connector's runs in progress
        self._reaper: asyncio.Task[None] | None = None
        self._draining = False
        self._closed = False

    def __len__(self) -> int:
        """Number of pooled (reusable) connections."""
        return sum(1 for s in self._slots.values() if s.conn is not None)

    def pooled(self, key: PoolKey) -> C | None:
        slot = self._slots.get(key)
        return slot.conn if slot is not None else None

    def backoff(self, key: PoolKey) -> Backoff | None:
        """The key's backoff after failed dials, while the pool remembers it."""
        slot = self._slots.get(key)
        return slot.backoff if slot is not None and slot.backoff.failures else None

    def dialing(self, key: PoolKey) -> bool:
        """Whether a dial for `key` is in progress."""
        slot = self._slots.get(key)
        return slot is not None and slot.dial is not None

    async def connect(
        self,
        key: PoolKey,
        authority: str,
        headers: Sequence[tuple[str, str]] = (),
        early_data: bytes = b"",
    ) -> HboneStream:
        """Check out a connection for `key` and open a CONNECT stream on it (`early_data`: see
        `HboneConnection.connect`)."""
        conn = await self.checkout(key)
        try:
            return await conn.connect(authority, headers, early_data)
        finally:
            if self.pooled(key) is not conn:
                conn.close()  # left the pool: close once its streams are done

    async def checkout(self, key: PoolKey) -> C:
        """A connection for `key` with one stream counted against it: the pooled one, else the one
        the key's dial (joined, or started after the key's backoff) makes. Raises the dial's error,
        or `ConnectionClosed` when the pool is closed, or draining and without a connection."""
        if self._closed:
            raise ConnectionClosed("pool closed")
        slot = self._slots.get(key)
        if slot is not None and slot.conn is not None and slot.conn.is_usable():
            return self._count(key, slot, slot.conn)  # most checkouts of a warm pool
        if slot is None:
            slot = self._slots[key] = _Slot()
        slot.users += 1
        try:
            return await self._wait_for_connection(key, slot)
        finally:
            slot.users -= 1
            self._forget_if_unused(key, slot)

    async def _wait_for_connection(self, key: PoolKey, slot: _Slot[C]) -> C:
        waited = False  # the backoff is waited out once: a fake clock need not move for the dial
        while True:
            conn = slot.conn
            if conn is not None:
                if conn.is_usable():
                    return self._count(key, slot, conn)
                slot.conn = None
                conn.close()
            dial = slot.dial
            if dial is None:
                if self._closed:
                    raise ConnectionClosed("pool closed")
                if self._draining:
                    raise ConnectionClosed("pool draining: no new connections")
                wait = 0.0 if waited else slot.backoff.wait(self._clock())
                if wait > 0:
                    waited = True
                    await asyncio.sleep(wait)
                    continue
                dial = slot.dial = self._start_dial(key, slot)
            conn = await asyncio.shield(dial)
            if slot.conn is conn and not conn.is_usable():
                raise ConnectionClosed("HBONE connection closed as it was made")
            # Else taken by the callers before this one up to its stream limit (and maybe closed by
            # them already, as a connection that left the pool is): the next round dials again.

    def _start_dial(self, key: PoolKey, slot: _Slot[C]) -> asyncio.Future[C]:
        """Run the connector for `key` as a task; the future it settles is what the waiters share."""
        loop = asyncio.get_running_loop()
        shared: asyncio.Future[C] = loop.create_future()
        task = asyncio.ensure_future(self._connector(key))
        self._dials.add(task)
        task.add_done_callback(lambda t: self._dial_done(key, slot, t, shared))
        return shared

    def _dial_done(
        self, key: PoolKey, slot: _Slot[C], task: asyncio.Future[C], shared: asyncio.Future[C]
    ) -> None:
        """Pool the connection made, or record the failure in the key's backoff; either way settle
        the shared future, which every waiter of the dial sees at once."""
        self._dials.discard(task)
        slot.dial = None
        error = ConnectionClosed("pool closed") if task.cancelled() else task.exception()
        if error is None:
            conn = task.result()
            if self._closed:
                conn.abort()
                error = ConnectionClosed("pool closed")
            else:
                self._dialed.add(conn)
                slot.backoff.succeeded()
                slot.conn, slot.streams, slot.last_used = conn, 0, self._clock()
                self._start_reaper()
                shared.set_result(conn)
                return
        elif not self._closed:
            delay = slot.backoff.failed(self._clock(), self._jitter())
            log.debug("hbone: dial to %s failed (%s); the next waits %.3fs", key.dst, error, delay)
            self._start_reaper()  # which forgets the backoff once it is stale
        shared.set_exception(error)
        shared.exception()  # read here: a dial every waiter gave up on is no unretrieved error
        self._forget_if_unused(key, slot)

    def _count(self, key: PoolKey, slot: _Slot[C], conn: C) -> C:
        """One stream counted against the slot's connection, which leaves the pool once full."""
        slot.streams += 1
        slot.last_used = self._clock()
        if slot.streams >= min(self._max_streams, conn.max_streams):
            slot.conn = None  # full: never handed out by the pool again
            self._forget_if_unused(key, slot)
        self._start_reaper()
        return conn

    def _forget_if_unused(self, key: PoolKey, slot: _Slot[C]) -> None:
        """Drop the key's slot once it holds nothing: no caller, connection, dial or backoff."""
        if (
            slot.users == 0
            and slot.conn is None
            and slot.dial is None
            and self._slots.get(key) is slot
            and slot.backoff.settled(self._clock())
        ):
            del self._slots[key]

    def release_idle(self, now: float | None = None) -> int:
        """Drop pooled connections not checked out for `idle_timeout` (and backoffs gone stale);
        returns how many connections."""
        if now is None:
            now = self._clock()
        released = 0
        for key, slot in list(self._slots.items()):
            conn = slot.conn
            if conn is not None and now - slot.last_used >= self._idle_timeout:
                slot.conn = None
                released += 1
                conn.close()
            self._forget_if_unused(key, slot)
        return released

    def _start_reaper(self) -> None:
        if self._reaper is None and not self._closed:
            self._reaper = asyncio.get_running_loop().create_task(self._reap())

    async def _reap(self) -> None:
        interval = max(min(self._idle_timeout / 2, 30.0), 0.05)
        while True:
            await asyncio.sleep(interval)
            try:
                self.release_idle()
            except Exception:
                log.exception("hbone: pool idle release failed")

    def drain(self) -> None:
        """Stop new dials: from now on checkouts get the pooled connections only (the others fail
        with `ConnectionClosed`); dials in progress finish for their waiters."""
        self._draining = True

    async def close(self) -> None:
        """Stop the pool: no more checkouts; dials in progress are cancelled (their waiters get
        `ConnectionClosed`) and every pooled or checked-out connection aborted.

        Connections that left the pool close when their streams end.
        """
        self._closed = True
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.wait([self._reaper])
            self._reaper = None
        dials = list(self._dials)
        for task in dials:
            task.cancel()
        if dials:
            await asyncio.wait(dials)
        # Listed before the slots let go of them: a weak set forgets a connection no one else holds.
        dialed = list(self._dialed)
        self._slots.clear()
        for conn in dialed:
            conn.abort()
        self._dialed.clear()
