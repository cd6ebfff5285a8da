"""What a drain waits for: the handlers running and the connections carried, of one proxy."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from ztunnel.proxy.connections import NO_CONTEXT


class TaskSet:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Future[Any]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def track(
        self, coro: Awaitable[asyncio.Future[Any] | None]
    ) -> asyncio.Future[asyncio.Future[Any] | None]:
        """A connection's handler, run as a task."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def hold(self, carried: asyncio.Future[Any]) -> asyncio.Future[Any]:
        """A carried connection (`connections.carry`'s future): a drain waits for it, then cuts it."""
        self._tasks.add(carried)
        carried.add_done_callback(self._tasks.discard, context=NO_CONTEXT)
        return carried

    def pending(self) -> list[asyncio.Future[Any]]:
        """What is still running, less the caller's own task (a drain started by a connection)."""
        current = asyncio.current_task()
        return [t for t in self._tasks if not t.done() and t is not current]
