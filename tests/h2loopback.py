"""The HBONE HTTP/2 tests' harness: a CONNECT server and clients over real loopback sockets and mTLS,
protocols that record or echo what a stream delivers, and the transfers both test modules run."""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from typing import Any

import pytest

from hbone.client import HboneConnection
from hbone.h2conn import H2Session
from hbone.server import ConnectRequest, HboneServer
from hbone.settings import H2Settings
from hbone.stream import HboneStream
from hbone.tls import TlsCredentials, TlsPolicy
from tests.certs import CA, issue, make_ca, spiffe

Handler = Callable[[ConnectRequest], Awaitable[None]]
CLIENT_ID = spiffe(namespace="client-ns", sa="client")
SERVER_ID = spiffe(namespace="server-ns", sa="server")

_CA: CA | None = None


def ca() -> CA:
    global _CA
    if _CA is None:
        _CA = make_ca()
    return _CA


class Collector(asyncio.Protocol):
    """Records what a transport delivers; can act as a slow reader."""

    def __init__(self, transport: asyncio.Transport | None = None, *, slow: bool = False) -> None:
        self.transport = transport
        self.data = bytearray()
        self.hash = hashlib.sha256()
        self.count = 0
        self.eof = asyncio.get_running_loop().create_future()
        self.lost: asyncio.Future[Exception | None] = asyncio.get_running_loop().create_future()
        self.lost_calls = 0
        self.slow = slow
        self.paused_reads = 0
        self.pause_writing_calls = 0
        self.resume_writing_calls = 0
        self.keep = True
        self._waiter: asyncio.Future[None] | None = None

    def data_received(self, data: bytes) -> None:
        self.count += len(data)
        self.hash.update(data)
        if self.keep:
            self.data += data
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
        if self.slow and self.transport is not None:
            self.paused_reads += 1
            self.transport.pause_reading()
            asyncio.get_running_loop().call_later(0.002, self.transport.resume_reading)

    def eof_received(self) -> bool:
        if not self.eof.done():
            self.eof.set_result(None)
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost_calls += 1
        if not self.lost.done():
            self.lost.set_result(exc)

    def pause_writing(self) -> None:
        self.pause_writing_calls += 1

    def resume_writing(self) -> None:
        self.resume_writing_calls += 1

    async def wait_for(self, n: int) -> None:
        while self.count < n:
            self._waiter = asyncio.get_running_loop().create_future()
            await asyncio.wait_for(self._waiter, 10)


class Echo(asyncio.Protocol):
    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.lost: asyncio.Future[Exception | None] = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        self.transport.write(data)

    def eof_received(self) -> bool:
        self.transport.write_eof()
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.lost.done():
            self.lost.set_result(exc)


async def echo_handler(req: ConnectRequest) -> None:
    req.respond(200, [("baggage", "k8s.namespace.name=server-ns")])
    req.stream.set_protocol(Echo(req.stream))


class Loopback:
    """An HBONE server on 127.0.0.1 and a way to open client connections to it."""

    def __init__(
        self,
        handler: Handler,
        settings: H2Settings,
        client_settings: H2Settings,
        server_policy: TlsPolicy | None = None,
        client_policy: TlsPolicy | None = None,
    ) -> None:
        self.server_cert = issue(ca(), SERVER_ID)
        self.client_cert = issue(ca(), CLIENT_ID)
        self.client_policy = client_policy
        self.tls_errors: list[Exception] = []
        self.server = HboneServer(
            TlsCredentials.build(self.server_cert, server_policy),
            handler,
            settings,
            "cluster.local",
            lambda peer, local, err: self.tls_errors.append(err),
        )
        self.client_settings = client_settings
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.listener.setblocking(False)
        self.addr: tuple[str, int] = self.listener.getsockname()
        self.conns: list[HboneConnection] = []

    async def dial(self) -> socket.socket:
        sock = socket.socket()
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, self.addr)
        return sock

    async def connect(self, settings: H2Settings | None = None) -> HboneConnection:
        conn = await HboneConnection.open(
            await self.dial(),
            TlsCredentials.build(self.client_cert, self.client_policy),
            [self.server_cert.identity],
            settings or self.client_settings,
        )
        self.conns.append(conn)
        return conn

    def server_sessions(self) -> list[H2Session]:
        return list(self.server.sessions)


@pytest.fixture(name="loopback")
async def loopback_fixture() -> AsyncIterator[Callable[..., Awaitable[Loopback]]]:
    made: list[Loopback] = []

    async def start(
        handler: Handler = echo_handler,
        settings: H2Settings | None = None,
        client_settings: H2Settings | None = None,
        *,
        server_policy: TlsPolicy | None = None,
        client_policy: TlsPolicy | None = None,
    ) -> Loopback:
        lb = Loopback(
            handler, settings or H2Settings(), client_settings or H2Settings(), server_policy, client_policy
        )
        await lb.server.serve(lb.listener)
        made.append(lb)
        return lb

    yield start
    for lb in made:
        for conn in lb.conns:
            conn.abort()
        await lb.server.shutdown(graceful=False)


async def open_stream(
    conn: HboneConnection, authority: str = "127.0.0.1:8080", headers: Sequence[tuple[str, str]] = ()
) -> tuple[HboneStream, Collector]:
    stream = await conn.connect(authority, headers)
    sink = Collector(stream)
    stream.set_protocol(sink)
    return stream, sink


def collect_stream(req: ConnectRequest, into: list[Collector]) -> Collector:
    """Answer the CONNECT with 200 and read its stream into a `Collector`, kept in `into`."""
    req.respond(200)
    c = Collector(req.stream)
    into.append(c)
    req.stream.set_protocol(c)
    return c


def recording_echo() -> tuple[Callable[[ConnectRequest], Awaitable[None]], list[ConnectRequest]]:
    """An echo handler that also keeps every request it was given."""
    seen: list[ConnectRequest] = []

    async def handler(req: ConnectRequest) -> None:
        seen.append(req)
        await echo_handler(req)

    return handler, seen


async def transfer_8mib(lb: Loopback) -> None:
    payload = os.urandom(8 * 1024 * 1024)
    conn = await lb.connect()
    stream = await conn.connect("127.0.0.1:9000")
    sink = Collector(stream, slow=True)
    sink.keep = False
    stream.set_protocol(sink)
    stream.set_write_buffer_limits(high=256 * 1024)
    max_buffered = 0
    view = memoryview(payload)
    for off in range(0, len(payload), 64 * 1024):
        stream.write(view[off : off + 64 * 1024])
        max_buffered = max(max_buffered, stream.get_write_buffer_size())
    stream.write_eof()
    await asyncio.wait_for(sink.eof, 20)
    await asyncio.wait_for(sink.lost, 5)
    assert sink.count == len(payload)
    assert sink.hash.hexdigest() == hashlib.sha256(payload).hexdigest()
    # Flow control was exercised: the receive window ran out, bytes waited in the send buffer
    # past the high-water mark (pause_writing), drained (resume_writing); readers were paused.
    assert max_buffered > 256 * 1024
    assert sink.pause_writing_calls >= 1
    assert sink.resume_writing_calls == sink.pause_writing_calls
    assert sink.paused_reads > 1


async def slow_echo_handler(req: ConnectRequest) -> None:
    req.respond(200)
    stream = req.stream

    class SlowEcho(Collector):
        def data_received(self, data: bytes) -> None:
            stream.write(data)
            super().data_received(data)

        def eof_received(self) -> bool:
            stream.write_eof()
            return True

        def pause_writing(self) -> None:
            stream.pause_reading()

        def resume_writing(self) -> None:
            stream.resume_reading()

    echo = SlowEcho(stream, slow=True)
    echo.keep = False
    stream.set_protocol(echo)


async def on_loop_body(handler: Handler, body: Callable[[Loopback], Awaitable[None]]) -> None:
    lb = Loopback(handler, H2Settings(), H2Settings())
    await lb.server.serve(lb.listener)
    try:
        await body(lb)
    finally:
        for conn in lb.conns:
            conn.abort()
        await lb.server.shutdown(graceful=False)


# The suite runs on uvloop (tests/conftest.py); these run the same code on asyncio's own loop.


def run_on_asyncio_loop(coro: Coroutine[Any, Any, None]) -> None:
    with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as runner:
        runner.run(coro)
