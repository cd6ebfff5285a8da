"""HBONE HTTP/2 CONNECT client and server, end to end over real loopback sockets and mTLS."""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from typing import Any

import hpack
import pytest
from h2.errors import ErrorCodes
from h2.settings import SettingCodes

from hbone.client import HboneConnection
from hbone.errors import ConnectionClosed, HboneError, HttpStatusError, StreamReset
from hbone.h2conn import H2Session
from hbone.server import ConnectRequest, HboneServer
from hbone.settings import H2Settings
from hbone.stream import HboneStream
from hbone.tls import TlsCredentials
from tests import h2peer
from tests.certs import CA, issue, make_ca, spiffe
from tests.waiting import eventually_async

pytestmark = pytest.mark.timeout(30)

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

    def __init__(self, handler: Handler, settings: H2Settings, client_settings: H2Settings) -> None:
        self.server_cert = issue(ca(), SERVER_ID)
        self.client_cert = issue(ca(), CLIENT_ID)
        self.tls_errors: list[Exception] = []
        self.server = HboneServer(
            TlsCredentials.build(self.server_cert),
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
            TlsCredentials.build(self.client_cert),
            [self.server_cert.identity],
            settings or self.client_settings,
        )
        self.conns.append(conn)
        return conn

    def server_sessions(self) -> list[H2Session]:
        return list(self.server.sessions)


@pytest.fixture
async def loopback() -> AsyncIterator[Callable[..., Awaitable[Loopback]]]:
    made: list[Loopback] = []

    async def start(
        handler: Handler = echo_handler,
        settings: H2Settings | None = None,
        client_settings: H2Settings | None = None,
    ) -> Loopback:
        lb = Loopback(handler, settings or H2Settings(), client_settings or H2Settings())
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


def recording_echo() -> tuple[Callable[[ConnectRequest], Awaitable[None]], list[ConnectRequest]]:
    """An echo handler that also keeps every request it was given."""
    seen: list[ConnectRequest] = []

    async def handler(req: ConnectRequest) -> None:
        seen.append(req)
        await echo_handler(req)

    return handler, seen


async def test_connect_request_reaches_handler_with_headers(loopback) -> None:
    handler, seen = recording_echo()
    lb = await loopback(handler)
    conn = await lb.connect()
    headers = [
        ("baggage", "k8s.cluster.name=Kubernetes,k8s.namespace.name=client-ns"),
        ("Forwarded", 'for="10.0.0.1:4567";host=echo.default.svc.cluster.local'),
        ("traceparent", "00-0123456789abcdef0123456789abcdef-0123456789abcdef-00"),
    ]
    stream, _ = await open_stream(conn, "[ff06::c3]:80", headers)

    assert len(seen) == 1
    req = seen[0]
    assert req.method == "CONNECT"
    assert req.authority == "[ff06::c3]:80"
    assert req.headers == {
        "baggage": "k8s.cluster.name=Kubernetes,k8s.namespace.name=client-ns",
        "forwarded": 'for="10.0.0.1:4567";host=echo.default.svc.cluster.local',
        "traceparent": "00-0123456789abcdef0123456789abcdef-0123456789abcdef-00",
    }
    assert str(req.peer_identity) == CLIENT_ID
    assert req.local_addr == lb.addr
    assert req.peer_addr == conn.get_extra_info("sockname")
    assert stream.status == 200
    assert stream.response_headers == [("baggage", "k8s.namespace.name=server-ns")]
    assert str(conn.peer_identity) == SERVER_ID
    assert str(stream.get_extra_info("peer_identity")) == SERVER_ID
    assert stream.get_extra_info("peername") == lb.addr
    assert stream.get_extra_info("ssl_object").version() == "TLSv1.3"


async def test_a_header_http2_forbids_fails_that_stream_only(loopback) -> None:
    """A CONNECT whose header value holds CR LF is refused before anything is sent; the connection
    goes on carrying streams, and the next one's headers arrive as sent."""
    handler, seen = recording_echo()
    lb = await loopback(handler)
    conn = await lb.connect()
    with pytest.raises(HboneError, match="CR, LF or NUL"):
        await conn.connect("127.0.0.1:8080", [("x-note", "a\r\nInjected: 1")])
    stream, sink = await open_stream(conn, headers=[("x-note", "fine")])
    stream.write(b"ping")
    await eventually_async(lambda: bytes(sink.data) == b"ping", "the echo")
    assert [req.headers for req in seen] == [{"x-note": "fine"}]
    assert conn.is_usable()


async def test_settings_on_the_wire(loopback) -> None:
    lb = await loopback()
    # what the server sends, as a raw client sees it
    peer = await h2peer.RawH2.connect(lb.addr, lb.client_cert)
    try:
        server_settings = await peer.read_until(lambda f: f.type == h2peer.SETTINGS and not f.flags, 5)
        server_window = await peer.read_until(lambda f: f.type == h2peer.WINDOW_UPDATE, 5)
    finally:
        peer.close()
    assert (
        h2peer.settings_of(server_settings).items()
        >= {
            SettingCodes.INITIAL_WINDOW_SIZE: 4194304,
            SettingCodes.MAX_FRAME_SIZE: 1048576,
            SettingCodes.MAX_CONCURRENT_STREAMS: 200,
            SettingCodes.MAX_HEADER_LIST_SIZE: 65536,
        }.items()
    )
    # the connection window raised to 16 MiB with a WINDOW_UPDATE on stream 0
    assert server_window.stream_id == 0
    assert int.from_bytes(server_window.payload, "big") == 16777216 - 65535

    # what the client sends, as a raw server sees it
    raw_server = h2peer.RawH2Server(lb.server_cert)
    await raw_server.start()
    try:
        sock = socket.socket()
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, raw_server.addr)
        opening = asyncio.create_task(
            HboneConnection.open(
                sock, TlsCredentials.build(lb.client_cert), [lb.server_cert.identity], H2Settings()
            )
        )
        server_side = await asyncio.wait_for(raw_server.peers.get(), 5)
        preface = await asyncio.wait_for(server_side.reader.readexactly(24), 5)
        assert preface == h2peer.PREFACE
        client_settings = await server_side.read_until(lambda f: f.type == h2peer.SETTINGS, 5)
        client_window = await server_side.read_until(lambda f: f.type == h2peer.WINDOW_UPDATE, 5)
        server_side.send(h2peer.frame(h2peer.SETTINGS, 0, 0, bytes.fromhex("000300000064")))  # 100 streams
        conn = await asyncio.wait_for(opening, 5)
        assert conn.max_streams == 100
        conn.abort()
        server_side.close()
    finally:
        await raw_server.close()
    assert (
        h2peer.settings_of(client_settings).items()
        >= {
            SettingCodes.INITIAL_WINDOW_SIZE: 4194304,
            SettingCodes.MAX_FRAME_SIZE: 1048576,
            SettingCodes.MAX_HEADER_LIST_SIZE: 16384,
            SettingCodes.ENABLE_PUSH: 0,
        }.items()
    )
    assert client_window.stream_id == 0
    assert int.from_bytes(client_window.payload, "big") == 16777216 - 65535
    conn2 = await lb.connect()
    assert conn2.max_streams == 100  # the pool's limit, below the server's 200


async def test_non_200_raises_and_connection_stays_usable(loopback) -> None:
    async def handler(req: ConnectRequest) -> None:
        if req.authority.startswith("10.0.0.9"):
            req.respond(401, [("baggage", "k8s.namespace.name=server-ns")])
        else:
            await echo_handler(req)

    lb = await loopback(handler)
    conn = await lb.connect()
    with pytest.raises(HttpStatusError) as err:
        await conn.connect("10.0.0.9:80")
    assert str(err.value) == "http status: 401"
    assert err.value.status == 401
    assert err.value.headers == [("baggage", "k8s.namespace.name=server-ns")]

    assert conn.is_usable()
    stream, sink = await open_stream(conn)
    stream.write(b"still fine")
    await sink.wait_for(10)
    assert bytes(sink.data) == b"still fine"
    assert conn.active_streams == 1  # the refused stream is gone
    [srv] = lb.server_sessions()
    assert len(srv.streams) == 1


async def test_non_connect_method_is_left_to_the_handler(loopback) -> None:
    seen: list[str] = []

    async def handler(req: ConnectRequest) -> None:
        seen.append(req.method)
        req.respond(400 if req.method != "CONNECT" else 200)

    lb = await loopback(handler)
    peer = await h2peer.RawH2.connect(lb.addr, lb.client_cert)
    try:
        block = peer.encoder.encode(
            [(":method", "GET"), (":scheme", "https"), (":path", "/"), (":authority", "127.0.0.1:80")]
        )
        peer.send(h2peer.frame(h2peer.HEADERS, h2peer.END_HEADERS, 1, block))
        response = await peer.read_until(lambda f: f.type == h2peer.HEADERS, 5)
    finally:
        peer.close()
    assert (":status", "400") in hpack.Decoder().decode(response.payload)
    assert response.flags & h2peer.END_STREAM
    assert seen == ["GET"]


async def test_handler_failure_or_silence_answers_503(loopback) -> None:
    async def handler(req: ConnectRequest) -> None:
        if req.authority == "boom:1":
            raise RuntimeError("handler bug")
        # "silent:1" returns without answering

    lb = await loopback(handler)
    conn = await lb.connect()
    for authority in ("boom:1", "silent:1"):
        with pytest.raises(HttpStatusError, match="http status: 503"):
            await conn.connect(authority)
    assert conn.is_usable()


async def test_echo_and_clean_close(loopback) -> None:
    lb = await loopback()
    conn = await lb.connect()
    stream, sink = await open_stream(conn)
    stream.write(b"hello ")
    stream.write(bytearray(b"world"))
    await sink.wait_for(11)
    assert bytes(sink.data) == b"hello world"
    stream.write_eof()
    await asyncio.wait_for(sink.eof, 5)  # the echo handler half-closes in turn
    assert await asyncio.wait_for(sink.lost, 5) is None
    assert sink.lost_calls == 1
    assert conn.active_streams == 0


async def test_half_close_client_first(loopback) -> None:
    server_side: list[Collector] = []

    async def handler(req: ConnectRequest) -> None:
        req.respond(200)
        c = Collector(req.stream)
        server_side.append(c)
        req.stream.set_protocol(c)
        await c.eof
        # the client ended its direction; ours keeps flowing
        req.stream.write(b"after your eof")
        await asyncio.sleep(0.01)
        req.stream.write(b", still here")
        req.stream.write_eof()

    lb = await loopback(handler)
    conn = await lb.connect()
    stream, sink = await open_stream(conn)
    stream.write(b"request")
    stream.write_eof()
    with pytest.raises(RuntimeError):
        stream.write(b"too late")
    await asyncio.wait_for(sink.eof, 5)
    assert bytes(sink.data) == b"after your eof, still here"
    assert bytes(server_side[0].data) == b"request"
    assert await asyncio.wait_for(sink.lost, 5) is None
    assert await asyncio.wait_for(server_side[0].lost, 5) is None


async def test_half_close_server_first_and_data_before_set_protocol(loopback) -> None:
    server_side: list[Collector] = []

    async def handler(req: ConnectRequest) -> None:
        req.respond(200)
        # written before the client even has its stream: held until it sets a protocol
        req.stream.write(b"banner\n")
        req.stream.write_eof()
        c = Collector(req.stream)
        server_side.append(c)
        req.stream.set_protocol(c)

    lb = await loopback(handler)
    conn = await lb.connect()
    stream = await conn.connect("127.0.0.1:25")
    await asyncio.sleep(0.05)
    sink = Collector(stream)
    stream.set_protocol(sink)
    await asyncio.wait_for(sink.eof, 5)
    assert bytes(sink.data) == b"banner\n"
    assert not stream.is_closing()
    stream.write(b"reply after the server's eof")
    await server_side[0].wait_for(28)
    stream.write_eof()
    await asyncio.wait_for(server_side[0].eof, 5)
    assert bytes(server_side[0].data) == b"reply after the server's eof"
    assert await asyncio.wait_for(sink.lost, 5) is None


async def test_unread_data_is_not_acknowledged(loopback) -> None:
    streams: list[HboneStream] = []
    payload = os.urandom(5 * 1024 * 1024)  # more than the 4 MiB stream window

    async def handler(req: ConnectRequest) -> None:
        if req.authority.endswith(":81"):
            await echo_handler(req)
            return
        req.respond(200)
        req.stream.write(payload)
        req.stream.write_eof()
        streams.append(req.stream)
        req.stream.set_protocol(Collector(req.stream))

    lb = await loopback(handler)
    conn = await lb.connect()
    stream = await conn.connect("127.0.0.1:80")
    stream.pause_reading()
    sink = Collector(stream)
    stream.set_protocol(sink)
    # Nothing consumed, so no WINDOW_UPDATE: the server still holds what exceeds the window.
    for _ in range(500):
        if streams and streams[0].get_write_buffer_size() == len(payload) - 4194304:
            break
        await asyncio.sleep(0.01)
    # A round trip on another stream: a WINDOW_UPDATE sent before it would have reached the
    # server, and let it send more, before this echo comes back.
    other, other_sink = await open_stream(conn, "127.0.0.1:81")
    other.write(b"ping")
    await other_sink.wait_for(4)
    assert sink.count == 0
    assert streams[0].get_write_buffer_size() == len(payload) - 4194304
    stream.resume_reading()
    await asyncio.wait_for(sink.eof, 10)
    assert sink.hash.hexdigest() == hashlib.sha256(payload).hexdigest()
    assert streams[0].get_write_buffer_size() == 0


async def test_tls_transport_backpressure_holds_stream_data(loopback) -> None:
    server_streams: list[HboneStream] = []

    async def handler(req: ConnectRequest) -> None:
        req.respond(200)
        req.stream.set_protocol(Collector(req.stream))
        server_streams.append(req.stream)

    lb = await loopback(handler)
    conn = await lb.connect()
    _, sink = await open_stream(conn)
    [session] = lb.server_sessions()
    session.pause_writing()  # as the TLS transport does when its buffer is full
    server_streams[0].write(b"x" * 1000)
    # A later answer on another stream overtakes the held DATA: had it been sent, it came first.
    await open_stream(conn, "127.0.0.1:81")
    assert sink.count == 0
    assert server_streams[0].get_write_buffer_size() == 1000
    session.resume_writing()
    await sink.wait_for(1000)
    assert server_streams[0].get_write_buffer_size() == 0


async def test_eof_received_returning_false_closes_the_stream(loopback) -> None:
    lost: list[Exception | None] = []

    class Plain(asyncio.Protocol):
        def connection_lost(self, exc: Exception | None) -> None:
            lost.append(exc)

    async def handler(req: ConnectRequest) -> None:
        req.respond(200)
        req.stream.set_protocol(Plain())  # eof_received returns None: the stream closes

    lb = await loopback(handler)
    conn = await lb.connect()
    stream, sink = await open_stream(conn)
    stream.write_eof()
    await asyncio.wait_for(sink.eof, 5)
    assert await asyncio.wait_for(sink.lost, 5) is None
    await eventually_async(lambda: lost == [None], "the server protocol's connection_lost", 5)


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


async def test_client_abort_is_a_clean_end_for_the_server(loopback) -> None:
    server_side: list[Collector] = []

    async def handler(req: ConnectRequest) -> None:
        req.respond(200)
        c = Collector(req.stream)
        server_side.append(c)
        req.stream.set_protocol(c)

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
    assert isinstance(exc, StreamReset)
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
    with pytest.raises(StreamReset) as err:
        await conn.connect("127.0.0.1:80")
    assert err.value.error_code == ErrorCodes.REFUSED_STREAM
    with pytest.raises(StreamReset) as err:
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
    for _ in range(100):
        if not conn.is_usable():
            break
        await asyncio.sleep(0.01)
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
