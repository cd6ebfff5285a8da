"""The soak's load, run by the generator in the background: echoing streams at a bounded rate, a
bounded churn of short connections, idle held connections probed now and then, and their counters.
"""

from __future__ import annotations

import asyncio
import os
import socket
from typing import Any

from benches.entry import Entry, open_socket, sock_recv_exactly


class Soak:
    """The soak's mix, running in the background until `stop()`: every byte sent is compared."""

    def __init__(self, entry: Entry, streams: int, stream_rate: float, churn_rate: float, idle: int) -> None:
        self.entry = entry
        self.counters = {
            "stream_bytes": 0,
            "churn_connections": 0,
            "idle_held": 0,
            "idle_probes": 0,
            "errors": 0,
            "mismatched": 0,
        }
        self.first_error = ""
        self.idle: list[socket.socket] = []
        self.tasks = [asyncio.ensure_future(self._stream(stream_rate)) for _ in range(streams)]
        self.tasks.append(asyncio.ensure_future(self._churn(churn_rate)))
        self.tasks.append(asyncio.ensure_future(self._idle(idle)))

    def _error(self, e: BaseException) -> None:
        self.counters["errors"] += 1
        self.first_error = self.first_error or repr(e)

    async def _echo(self, sock: socket.socket, data: bytes) -> None:
        await asyncio.get_running_loop().sock_sendall(sock, data)
        if await sock_recv_exactly(sock, len(data)) != data:
            self.counters["mismatched"] += 1

    async def _stream(self, rate: float) -> None:
        """A long-lived connection echoing 16 KiB pieces at `rate` bytes/s; reopened after an error."""
        piece = 16 * 1024
        while True:
            try:
                sock = await open_socket(self.entry, self.entry.echo)
            except OSError as e:
                self._error(e)
                await asyncio.sleep(1)
                continue
            try:
                while True:
                    await self._echo(sock, os.urandom(piece))
                    self.counters["stream_bytes"] += piece
                    await asyncio.sleep(piece / rate)
            except OSError as e:
                self._error(e)
            finally:
                sock.close()

    async def _churn(self, rate: float) -> None:
        """Short connections (connect, 8 bytes, echo, close) at `rate` per second."""
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            try:
                sock = await open_socket(self.entry, self.entry.echo)
                try:
                    await self._echo(sock, os.urandom(8))
                finally:
                    sock.close()
                self.counters["churn_connections"] += 1
            except OSError as e:
                self._error(e)
            next_at += 1 / rate
            await asyncio.sleep(max(0.0, next_at - loop.time()))

    async def _idle(self, count: int) -> None:
        """`count` idle connections, each echoing a byte once a minute or so (one probed every
        60/count s), replaced when one fails."""
        while True:
            while len(self.idle) < count:
                try:
                    sock = await open_socket(self.entry, self.entry.echo)
                    await self._echo(sock, b"i")
                    self.idle.append(sock)
                except OSError as e:
                    self._error(e)
                    await asyncio.sleep(0.5)
            self.counters["idle_held"] = len(self.idle)
            for sock in list(self.idle):
                await asyncio.sleep(60 / max(count, 1))
                try:
                    await self._echo(sock, b"p")
                    self.counters["idle_probes"] += 1
                except OSError as e:
                    self._error(e)
                    self.idle.remove(sock)
                    sock.close()

    def stats(self) -> dict[str, Any]:
        return {**self.counters, "first_error": self.first_error}

    async def stop(self) -> dict[str, Any]:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for sock in self.idle:
            sock.close()
        self.idle.clear()
        return self.stats()
