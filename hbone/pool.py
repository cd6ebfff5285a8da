"""The client-side pool of HBONE connections.

One pool per proxy instance. Connections are shared only by callers with an equal `PoolKey`. A
checkout takes the key's lock, so under a storm exactly one caller dials and the others wait for its
connection. Streams are counted at checkout; the checkout that reaches the connection's stream limit
takes it out of the pool for good (the next caller dials anew), as the reference does. A pooled
connection not checked out for `idle_timeout` is released; a released or departed connection closes
once its last stream ends. The clock is an input so tests drive idle release directly.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from hbone.errors import ConnectionClosed
from hbone.identity import Identity
from hbone.settings import POOL_IDLE_TIMEOUT, POOL_MAX_STREAMS
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


class _Slot(Generic[C]):
    __slots__ = ("conn", "last_used", "lock", "streams", "users")

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.conn: C | None = None
        self.streams = 0
        self.last_used = 0.0
        self.users = 0  # callers inside checkout; the slot is dropped when none and empty


class Pool(Generic[C]):
    def __init__(
        self,
        connector: Callable[[PoolKey], Awaitable[C]],
        *,
        max_streams: int = POOL_MAX_STREAMS,
        idle_timeout: float = POOL_IDLE_TIMEOUT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._connector = connector
        self._max_streams = max_streams
        self._idle_timeout = idle_timeout
        self._clock = clock
        self._slots: dict[PoolKey, _Slot[C]] = {}
        self._dialed: weakref.WeakSet[C] = weakref.WeakSet()
        self._reaper: asyncio.Task[None] | None = None
        self._closed = False

    def __len__(self) -> int:
        """Number of pooled (reusable) connections."""
        return sum(1 for s in self._slots.values() if s.conn is not None)

    def pooled(self, key: PoolKey) -> C | None:
        slot = self._slots.get(key)
        return slot.conn if slot is not None else None

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
        """A connection for `key` with one stream counted against it; dials when none is pooled."""
        if self._closed:
            raise ConnectionClosed("pool closed")
        slot = self._slots.get(key)
        if slot is not None and slot.conn is not None and not slot.lock.locked() and slot.conn.is_usable():
            # What the locked path below does with a usable pooled connection, which awaits nothing:
            # without the lock's coroutines (most checkouts of a warm pool).
            return self._count(key, slot, slot.conn)
        if slot is None:
            slot = self._slots[key] = _Slot()
        slot.users += 1
        try:
            async with slot.lock:
                conn = slot.conn
                if conn is not None and not conn.is_usable():
                    slot.conn = None
                    conn.close()
                    conn = None
                if conn is None:
                    conn = await self._connector(key)
                    if self._closed:
                        conn.abort()
                        raise ConnectionClosed("pool closed")
                    self._dialed.add(conn)
                    slot.conn = conn
                    slot.streams = 0
                return self._count(key, slot, conn)
        finally:
            slot.users -= 1
            if slot.users == 0 and slot.conn is None and self._slots.get(key) is slot:
                del self._slots[key]

    def _count(self, key: PoolKey, slot: _Slot[C], conn: C) -> C:
        """One stream counted against the slot's connection, which leaves the pool once full."""
        slot.streams += 1
        slot.last_used = self._clock()
        if slot.streams >= min(self._max_streams, conn.max_streams):
            slot.conn = None  # full: never handed out by the pool again
            if slot.users == 0 and self._slots.get(key) is slot:
                del self._slots[key]
        self._start_reaper()
        return conn

    def release_idle(self, now: float | None = None) -> int:
        """Drop pooled connections not checked out for `idle_timeout`; returns how many."""
        if now is None:
            now = self._clock()
        released = 0
        for key, slot in list(self._slots.items()):
            conn = slot.conn
            if conn is None or now - slot.last_used < self._idle_timeout:
                continue
            slot.conn = None
            released += 1
            conn.close()
            if slot.users == 0:
                del self._slots[key]
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

    async def close(self) -> None:
        """Stop the pool: no more checkouts; aborts every pooled or checked-out connection.

        Connections that left the pool close when their streams end.
        """
        self._closed = True
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.wait([self._reaper])
            self._reaper = None
        # Listed before the slots let go of them: a weak set forgets a connection no one else holds.
        dialed = list(self._dialed)
        self._slots.clear()
        for conn in dialed:
            conn.abort()
        self._dialed.clear()
