"""The engine of an HBONE connection (`hbone/engine.py`): its socket and TLS, as seen on the wire.

A TCP middlebox between an HBONE client and server records the client's ciphertext, so the tests
read the TLS records it sent: a DATA frame's header does not cost a record of its own.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Awaitable, Callable

import pytest

from hbone.client import HboneConnection
from hbone.tls import TlsCredentials
from tests.h2loopback import Collector, Loopback, collect_stream, loopback_fixture  # noqa: F401
from tests.waiting import eventually_async

pytestmark = pytest.mark.timeout(60)

_APPLICATION_DATA = 23
_TLS13_OVERHEAD = 1 + 16  # the inner content type and the AEAD tag
_MAX_PLAINTEXT = 16384


class Middlebox:
    """Forwards TCP both ways between a client and `upstream`, keeping what the client sent."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.sent = bytearray()
        self.server: asyncio.Server | None = None
        self.tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> tuple[str, int]:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[:2]

    async def _serve(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        ur, uw = await asyncio.open_connection(*self.upstream)

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter, keep: bytearray | None) -> None:
            while data := await r.read(65536):
                if keep is not None:
                    keep += data
                w.write(data)
                await w.drain()
            w.close()

        for t in (pipe(cr, uw, self.sent), pipe(ur, cw, None)):
            task = asyncio.ensure_future(t)
            self.tasks.add(task)

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        if self.server is not None:
            self.server.close()


def records(stream: bytes | bytearray, start: int) -> list[tuple[int, int]]:
    """(content type, length) of each whole TLS record beginning at or after `start`."""
    out = []
    off = 0
    while off + 5 <= len(stream):
        length = int.from_bytes(stream[off + 3 : off + 5], "big")
        if off + 5 + length > len(stream):
            break
        if off >= start:
            out.append((stream[off], length))
        off += 5 + length
    return out


async def test_a_large_write_leaves_in_full_records_without_one_for_a_frame_header(
    loopback: Callable[..., Awaitable[Loopback]],
) -> None:
    sinks: list[Collector] = []

    async def handler(req: object) -> None:
        collect_stream(req, sinks)  # type: ignore[arg-type]

    lb = await loopback(handler)
    box = Middlebox(lb.addr)
    addr = await box.start()
    try:
        sock = socket.socket()
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, addr)
        conn = await HboneConnection.open(
            sock,
            TlsCredentials.build(lb.client_cert),
            [lb.server_cert.identity],
            lb.client_settings,
        )
        stream = await conn.connect("127.0.0.1:9000")
        await eventually_async(lambda: len(sinks) == 1, "the server's stream")
        mark = len(box.sent)  # the handshake, the preface and the CONNECT are before this
        payload = os.urandom(96 * 1024)
        stream.write(payload)
        await eventually_async(lambda: sinks[0].count == len(payload), "the payload at the server")
        assert bytes(sinks[0].data) == payload
        sent = records(box.sent, mark)
        data_records = [length for kind, length in sent if kind == _APPLICATION_DATA]
        # The frame header went in the same record as its payload: every record but the last is full
        # (written apart, the header took a record of its own, then the payload's records followed).
        assert data_records, str(sent)
        assert all(length == _MAX_PLAINTEXT + _TLS13_OVERHEAD for length in data_records[:-1]), str(sent)
        plaintext = sum(length - _TLS13_OVERHEAD for length in data_records)
        assert len(data_records) == -(-plaintext // _MAX_PLAINTEXT)
        conn.abort()
    finally:
        await box.close()
