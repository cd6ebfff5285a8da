"""Waiting for something that must happen: poll until it does, or fail naming what never came.

The timeouts are generous bounds, never measured durations: a check passes as soon as it holds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

# What is awaited, for the failure message: text, or a function giving it then (e.g. a log's tail).
What = str | Callable[[], str]


def _describe(what: What, timeout: float) -> str:
    return f"timed out after {timeout:g}s waiting for {what() if callable(what) else what}"


def eventually(
    check: Callable[[], object], what: What, timeout: float = 15.0, interval: float = 0.05
) -> None:
    """Call `check` until it returns something true."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(_describe(what, timeout))
        time.sleep(interval)


async def eventually_async(
    check: Callable[[], object],
    what: What,
    timeout: float = 10.0,
    interval: float = 0.05,
    *,
    blocking: bool = False,
) -> None:
    """Call `check` until it returns something true, letting the event loop run in between.
    `blocking`: `check` blocks (e.g. an HTTP request to a server in this process), so it runs in a
    thread."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not (await asyncio.to_thread(check) if blocking else check()):
        if loop.time() > deadline:
            raise AssertionError(_describe(what, timeout))
        await asyncio.sleep(interval)
