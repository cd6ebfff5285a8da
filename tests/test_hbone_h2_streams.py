"""HBONE HTTP/2 CONNECT over real loopback sockets and mTLS: large and concurrent transfers, resets,
GOAWAY, keepalive, and the same code on asyncio's own loop."""

from __future__ import annotations

import asyncio
import gc
import socket
import sys

import pytest
from h2.errors import ErrorCodes

from hbone.client import HboneConnection
from hbone.errors import ConnectionClosed, HboneError, HttpStatusError, StreamResetError
from hbone.server import ConnectRequest
from hbone.settings import H2Settings
from hbone.tls import TlsCredentials
from tests import h2peer
from tests.h2loopback import (
    Collector,
    Echo,
    Loopback,
    collect_stream,
    echo_handler,
    loopback_fixture,  # noqa: F401
    on_loop_body,
    open_stream,
    run_on_asyncio_loop,
    slow_echo_handler,
    transfer_8mib,
)
from tests.waiting import eventually_async

pytestmark = pytest.mark.timeout(30)


async def test_8mib_both_ways_with_slow_readers(loopback) -> None:
    lb = await loopback(slow_echo_handler)
    await transfer_8mib(lb)


async def test_150_concurrent_streams_on_one_connection(loopback) -> None:
    lb = await loopback()
    conn = await lb.connect()
    streams = await asyncio.gather(*(open_stream(conn, f"10.0.0.1:{1000 + i}") for i in range(150)))
    assert conn.active_streams == 150
    assert len(lb.server_sessions()) == 1
    for i, (stream, _) in enumerate(streams):
        stream.write(f"message {i}".encode())
        stream.write_eof()
    for i, (_, sink) in enumerate(streams):
        await asyncio.wait_for(sink.eof, 5)
        assert bytes(sink.data) == f"message {i}".encode()
        assert await asyncio.wait_for(sink.lost, 5) is None
    assert conn.active_streams == 0


async def test_ended_streams_leave_no_memory_behind(loopback) -> None:
    """What a stream allocates goes when the stream and its connection end, on both sides: after
    three rounds of a connection carrying 300 echoed streams, the allocator holds no more blocks
    than after the first. (The compiled build once kept an empty dict of every stream, forever.)"""
    lb = await loopback()

    async def round_of(streams: int) -> int:
        conn = await lb.connect()
        for i in range(streams):
            stream, sink = await open_stream(conn, f"10.0.0.1:{1000 + i}")
            stream.write(b"ping")
            stream.write_eof()
            assert await asyncio.wait_for(sink.lost, 5) is None
            assert bytes(sink.data) == b"ping"
        conn.close()
        await asyncio.wait_for(conn.wait_closed(), 5)
        lb.conns.remove(conn)
        await eventually_async(lambda: not lb.server_sessions(), "the server's sessions ended")
        gc.collect()
        return sys.getallocatedblocks()

    after_first = await round_of(300)
    await round_of(300)
    await round_of(300)

    def kept() -> int:
        gc.collect()
        return sys.getallocatedblocks() - after_first

    # Until the transports' last callbacks have run (a leak never gets there).
    await eventually_async(lambda: kept() / 600 < 0.05, lambda: f"{kept()} blocks kept")


async def test_client_abort_is_a_clean_end_for_the_server(loopback) -> None:
    server_side: list[Collector] = []

    async def handler(req: ConnectRequest) -> None:
        collect_stream(req, server_side)

    lb = await loopback(handler)
    conn = await lb.connect()
    stream, sink = await open_stream(conn)
    stream.write(b"partial")
    await server_side[0].wait_for(7)
    stream.abort()  # RST_STREAM(CANCEL)
    assert await asyncio.wait_for(sink.lost, 5) is None
    await asyncio.wait_for(server_side[0].eof, 5)
    assert await asyncio.wait_for(server_side[0].lost, 5) is None
    assert conn.is_usable()


async def test_reset_with_error_code_fails_only_that_stream(loopback) -> None:
    async def handler(req: ConnectRequest) -> None:
        req.respond(200)
        if req.authority == "reset:1":
            req.stream.set_protocol(Collector(req.stream))
            req.stream.reset(ErrorCodes.INTERNAL_ERROR)
        else:
            req.stream.set_protocol(Echo(req.stream))

    lb = await loopback(handler)
    conn = await lb.connect()
    other, other_sink = await open_stream(conn)
    stream, sink = await open_stream(conn, "reset:1")
    exc = await asyncio.wait_for(sink.lost, 5)
    assert isinstance(exc, StreamResetError)
    assert exc.error_code == ErrorCodes.INTERNAL_ERROR
    assert not sink.eof.done()
    assert stream.is_closing()
    other.write(b"unaffected")
    await other_sink.wait_for(10)
    assert bytes(other_sink.data) == b"unaffected"
    assert conn.is_usable()


async def test_reset_before_response_raises_stream_reset(loopback) -> None:
    async def handler(req: ConnectRequest) -> None:
        req.stream.reset(ErrorCodes.CANCEL if req.authority == "cancel:1" else ErrorCodes.REFUSED_STREAM)

    lb = await loopback(handler)
    conn = await lb.connect()
    with pytest.raises(StreamResetError) as err:
        await conn.connect("127.0.0.1:80")
    assert err.value.error_code == ErrorCodes.REFUSED_STREAM
    with pytest.raises(StreamResetError) as err:
        await conn.connect("cancel:1")  # even a "clean" reset is a failed CONNECT
    assert err.value.error_code == ErrorCodes.CANCEL
    assert conn.active_streams == 0  # nothing left behind on either side
    assert [len(s.streams) for s in lb.server_sessions()] == [0]
    assert conn.is_usable()


async def test_graceful_goaway_lets_open_stream_finish(loopback) -> None:
    lb = await loopback()
    conn = await lb.connect()
    stream, sink = await open_stream(conn)
    stream.write(b"before")
    await sink.wait_for(6)

    shutdown = asyncio.create_task(lb.server.shutdown(graceful=True))
    await eventually_async(lambda: not conn.is_usable(), "the GOAWAY received")
    assert not conn.is_usable()  # GOAWAY received
    with pytest.raises(ConnectionClosed):
        await conn.connect("127.0.0.1:80")

    stream.write(b" and after goaway")
    await sink.wait_for(23)
    assert not shutdown.done()
    stream.write_eof()
    await asyncio.wait_for(sink.eof, 5)
    assert bytes(sink.data) == b"before and after goaway"
    assert await asyncio.wait_for(sink.lost, 5) is None
    await asyncio.wait_for(shutdown, 5)
    await asyncio.wait_for(conn.wait_closed(), 5)


async def test_abrupt_shutdown_kills_streams(loopback) -> None:
    lb = await loopback()
    conn = await lb.connect()
    _stream, sink = await open_stream(conn)
    await lb.server.shutdown(graceful=False)
    exc = await asyncio.wait_for(sink.lost, 5)
    assert isinstance(exc, ConnectionClosed)
    await asyncio.wait_for(conn.wait_closed(), 5)
    assert not conn.is_usable()


async def test_client_close_waits_for_streams(loopback) -> None:
    lb = await loopback()
    conn = await lb.connect()
    stream, sink = await open_stream(conn)
    conn.close()
    assert not conn.is_usable()
    with pytest.raises(HboneError):
        await conn.connect("127.0.0.1:80")
    stream.write(b"still open")
    await sink.wait_for(10)
    stream.write_eof()
    assert await asyncio.wait_for(sink.lost, 5) is None
    await asyncio.wait_for(conn.wait_closed(), 5)


async def test_keepalive_tears_down_when_peer_stops_answering(loopback) -> None:
    lb = await loopback()
    raw_server = h2peer.RawH2Server(lb.server_cert)
    await raw_server.start()
    try:
        sock = socket.socket()
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, raw_server.addr)
        # A PING answered late under load is no timeout: 2 s, well inside the 5 s waited for the close.
        quick = H2Settings(ping_interval=0.05, ping_timeout=2.0)
        opening = asyncio.create_task(
            HboneConnection.open(sock, TlsCredentials.build(lb.client_cert), [lb.server_cert.identity], quick)
        )
        peer = await asyncio.wait_for(raw_server.peers.get(), 5)
        await asyncio.wait_for(peer.reader.readexactly(24), 5)
        peer.send(h2peer.frame(h2peer.SETTINGS, 0, 0))
        conn = await asyncio.wait_for(opening, 5)
        connecting = asyncio.create_task(open_stream(conn))
        request = await peer.read_until(lambda f: f.type == h2peer.HEADERS, 5)
        status = peer.encoder.encode([(":status", "200")])
        peer.send(h2peer.frame(h2peer.HEADERS, h2peer.END_HEADERS, request.stream_id, status))
        _stream, sink = await asyncio.wait_for(connecting, 5)
        answered: list[h2peer.Frame] = []
        for _ in range(3):  # several PINGs answered: still alive
            f = await peer.read_until(
                lambda f: f.type == h2peer.PING and not f.flags and f not in answered, 5
            )
            answered.append(f)
            peer.send(h2peer.frame(h2peer.PING, h2peer.ACK, 0, f.payload))
        assert conn.is_usable()
        # the peer goes silent
        await asyncio.wait_for(conn.wait_closed(), 5)
        assert not conn.is_usable()
        assert "keepalive timeout" in str(conn.close_reason)
        exc = await asyncio.wait_for(sink.lost, 5)
        assert isinstance(exc, ConnectionClosed)
        peer.close()
    finally:
        await raw_server.close()


async def test_received_frames_are_not_formatted(loopback, monkeypatch) -> None:
    import hyperframe.frame

    def boom(self: object) -> str:
        raise AssertionError("repr(frame) computed on the receive path")

    lb = await loopback()
    conn = await lb.connect()
    monkeypatch.setattr(hyperframe.frame.Frame, "__repr__", boom)
    stream, sink = await open_stream(conn)
    stream.write(b"x" * 100_000)
    await sink.wait_for(100_000)


def test_asyncio_loop_echo_half_close_and_status() -> None:
    async def handler(req: ConnectRequest) -> None:
        if req.authority == "deny:1":
            req.respond(401)
        else:
            await echo_handler(req)

    async def body(lb: Loopback) -> None:
        conn = await lb.connect()
        with pytest.raises(HttpStatusError, match="http status: 401"):
            await conn.connect("deny:1")
        stream, sink = await open_stream(conn)
        stream.write(b"asyncio")
        stream.write_eof()
        await asyncio.wait_for(sink.eof, 5)
        assert bytes(sink.data) == b"asyncio"
        assert await asyncio.wait_for(sink.lost, 5) is None

    run_on_asyncio_loop(on_loop_body(handler, body))


def test_asyncio_loop_8mib_both_ways_with_slow_readers() -> None:
    run_on_asyncio_loop(on_loop_body(slow_echo_handler, transfer_8mib))
