"""HBONE HTTP/2 CONNECT client and server, end to end over real loopback sockets and mTLS: requests,
settings, statuses, half-closes and flow control of one stream."""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket

import hpack
import pytest
from h2.settings import SettingCodes

from hbone.client import HboneConnection
from hbone.errors import HboneError, HttpStatusError
from hbone.server import ConnectRequest
from hbone.settings import H2Settings
from hbone.stream import HboneStream
from hbone.tls import TlsCredentials
from tests import h2peer
from tests.h2loopback import (
    CLIENT_ID,
    SERVER_ID,
    Collector,
    collect_stream,
    echo_handler,
    loopback_fixture,  # noqa: F401
    open_stream,
    recording_echo,
)
from tests.waiting import eventually_async

pytestmark = pytest.mark.timeout(30)


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
        c = collect_stream(req, server_side)
        await c.eof
        # the client ended its direction; ours keeps flowing
        req.stream.write(b"after your eof")
        await asyncio.sleep(0.01)  # two writes apart in time: the stimulus, not a wait
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
    await eventually_async(lambda: server_side, "the server's banner and end written")
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
    await eventually_async(
        lambda: streams and streams[0].get_write_buffer_size() == len(payload) - 4194304,
        "the server holding what exceeds the window",
    )
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
