"""HTTP/2 and TLS abuse against an in-process HBONE server over real loopback mTLS: each attack gets
its GOAWAY or RST with the right error code within a bound, while an unrelated tunnel keeps every byte.

The attacker is `tests.h2peer.RawH2`, a client that writes raw frames with a certificate of the
server's trust domain (the issue only needs that much).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import AsyncIterator

import pytest

from hbone.client import HboneConnection
from hbone.errors import HttpStatusError
from hbone.server import ConnectRequest, HboneServer
from hbone.settings import H2Settings
from hbone.stream import HboneStream
from hbone.tls import TlsCredentials
from tests import h2peer
from tests.certs import issue, make_ca, spiffe
from tests.h2peer import RawH2, frame, ping, rst
from tests.waiting import eventually_async

pytestmark = pytest.mark.timeout(60)


class Echo(asyncio.Protocol):
    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.transport.write(data)

    def eof_received(self) -> bool:
        self.transport.write_eof()
        return True


class Sink(asyncio.Protocol):
    def __init__(self) -> None:
        self.data = bytearray()
        self.changed = asyncio.Event()

    def data_received(self, data: bytes) -> None:
        self.data += data
        self.changed.set()

    def eof_received(self) -> bool:
        return True

    async def wait_for(self, n: int, timeout: float = 10.0) -> None:
        async def wait() -> None:
            while len(self.data) < n:
                self.changed.clear()
                await self.changed.wait()

        await asyncio.wait_for(wait(), timeout)


class Target:
    """An HBONE server whose handler echoes, holds ("hold:"), never answers ("forever:") or keeps
    what arrives ("sink:", in `sinks`)."""

    def __init__(self, settings: H2Settings) -> None:
        ca = make_ca()
        self.server_cert = issue(ca, spiffe(namespace="server-ns", sa="server"))
        self.client_cert = issue(ca, spiffe(namespace="client-ns", sa="attacker"))
        self.handled: list[str] = []
        self.cancelled: list[str] = []
        self.tls_errors: list[Exception] = []
        self.release = asyncio.Event()
        self.sinks: dict[str, Sink] = {}
        self.server = HboneServer(
            TlsCredentials.build(self.server_cert),
            self._handle,
            settings,
            "cluster.local",
            lambda peer, local, err: self.tls_errors.append(err),
        )
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(512)
        self.addr: tuple[str, int] = self.listener.getsockname()
        self.conns: list[HboneConnection] = []
        self.peers: list[RawH2] = []

    async def _handle(self, req: ConnectRequest) -> None:
        self.handled.append(req.authority)
        try:
            if req.authority.startswith("hold:"):
                await self.release.wait()
            elif req.authority.startswith("forever:"):
                await asyncio.Event().wait()
            elif req.authority.startswith("deny:"):
                req.respond(401)
                return
        except asyncio.CancelledError:
            self.cancelled.append(req.authority)
            raise
        req.respond(200)
        if req.authority.startswith("sink:"):
            req.stream.set_protocol(self.sinks.setdefault(req.authority, Sink()))
            return
        req.stream.set_protocol(Echo(req.stream))

    async def connect(self) -> HboneConnection:
        sock = socket.socket()
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, self.addr)
        conn = await HboneConnection.open(
            sock, TlsCredentials.build(self.client_cert), [self.server_cert.identity], H2Settings()
        )
        self.conns.append(conn)
        return conn

    async def raw(self, **kw: int) -> RawH2:
        peer = await RawH2.connect(self.addr, self.client_cert, **kw)
        self.peers.append(peer)
        return peer


@pytest.fixture
async def target() -> AsyncIterator[Target]:
    t = Target(H2Settings())
    await t.server.serve(t.listener)
    yield t
    for peer in t.peers:
        peer.close()
    for conn in t.conns:
        conn.abort()
    await t.server.shutdown(graceful=False)


async def open_echo(conn: HboneConnection) -> tuple[HboneStream, Sink]:
    stream = await conn.connect("127.0.0.1:80")
    sink = Sink()
    stream.set_protocol(sink)
    return stream, sink


class Bystander:
    """An unrelated tunnel that keeps echoing during an attack: every byte must come back."""

    def __init__(self, stream: HboneStream, sink: Sink) -> None:
        self.stream, self.sink = stream, sink
        self.sent = bytearray()
        self.longest_wait = 0.0
        self._stop = asyncio.Event()
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while not self._stop.is_set():
            chunk = os.urandom(512)
            self.sent += chunk
            started = time.monotonic()
            self.stream.write(chunk)
            await self.sink.wait_for(len(self.sent), timeout=10.0)
            self.longest_wait = max(self.longest_wait, time.monotonic() - started)
            await asyncio.sleep(0.005)  # pacing the bystander, not a wait

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.wait_for(self.task, 15)
        assert bytes(self.sink.data) == bytes(self.sent)


async def test_rapid_reset_gets_goaway_enhance_your_calm_and_spares_the_others(target, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="hbone")
    bystander = Bystander(*await open_echo(await target.connect()))
    peer = await target.raw()
    pairs = 5000  # five times the limit
    sid = 1
    for _ in range(pairs // 250):
        burst = b""
        for _ in range(250):
            burst += peer.connect_headers(sid) + rst(sid)
            sid += 2
        peer.send(burst)
        try:
            await asyncio.wait_for(peer.writer.drain(), 5)
        except (ConnectionError, TimeoutError):
            break
    goaway = await peer.goaway(10)
    assert goaway.error_code == h2peer.ENHANCE_YOUR_CALM
    # Streams reset in the batch that opened them never reach the handler; at most a few that a
    # read split from their reset do (and those are cancelled).
    assert len(target.handled) < 50, len(target.handled)
    assert "rapid reset" in caplog.text
    await bystander.stop()
    assert bystander.longest_wait < 5.0
    stream, sink = await open_echo(await target.connect())  # new connections are served
    stream.write(b"after")
    await sink.wait_for(5)


async def test_resets_below_the_limit_keep_the_connection_and_nothing_behind(target) -> None:
    peer = await target.raw()
    burst = b"".join(peer.connect_headers(sid) + rst(sid) for sid in range(1, 1000, 2))  # 500 pairs
    peer.send(burst + peer.connect_headers(1001))
    response = await peer.read_until(lambda f: f.type == h2peer.HEADERS and f.stream_id == 1001, 10)
    assert response.stream_id == 1001
    assert not [f for f in peer.received if f.type == h2peer.GOAWAY]
    [session] = target.server.sessions
    assert list(session.streams) == [1001]  # the reset ones are forgotten at once
    assert len(target.handled) < 10


async def test_made_you_reset_counts_resets_the_server_is_provoked_into(target) -> None:
    peer = await target.raw()
    peer.send(peer.connect_headers(1, "hold:1") + rst(1))
    # DATA on the stream it reset: each one makes the server answer RST_STREAM(STREAM_CLOSED).
    peer.send(frame(h2peer.DATA, 0, 1, b"x") * 1500)
    goaway = await peer.goaway(10)
    assert goaway.error_code == h2peer.ENHANCE_YOUR_CALM
    resets = [f for f in peer.received if f.type == h2peer.RST_STREAM]
    assert 0 < len(resets) <= 1001
    assert {f.error_code for f in resets} == {h2peer.STREAM_CLOSED}


async def test_handler_of_a_reset_stream_is_cancelled(target) -> None:
    conn = await target.connect()
    connecting = asyncio.create_task(conn.connect("forever:1"))
    await eventually_async(lambda: target.handled == ["forever:1"], "the handler to start")
    connecting.cancel()  # the client gives up: RST_STREAM(CANCEL)
    await eventually_async(lambda: target.cancelled == ["forever:1"], "the handler to be cancelled")
    # and when the whole connection goes
    connecting = asyncio.create_task(conn.connect("forever:2"))
    await eventually_async(lambda: "forever:2" in target.handled, "the second handler to start")
    conn.abort()
    await eventually_async(lambda: "forever:2" in target.cancelled, "the second handler to be cancelled")
    with pytest.raises(Exception):  # noqa: B017 - the connect fails with the connection
        await connecting


async def test_streams_past_the_limit_are_refused_one_by_one(target) -> None:
    peer = await target.raw()
    limit = H2Settings().max_concurrent_streams
    sids = list(range(1, 2 * limit + 2, 2))
    peer.send(b"".join(peer.connect_headers(sid, f"hold:{sid}") for sid in sids))
    refused = await peer.read_until(lambda f: f.type == h2peer.RST_STREAM, 10)
    assert (refused.stream_id, refused.error_code) == (sids[-1], h2peer.REFUSED_STREAM)
    await eventually_async(lambda: len(target.handled) == limit, "the admitted streams' handlers")
    target.release.set()
    answered: set[int] = set()

    def all_answered(f: h2peer.Frame) -> bool:
        if f.type == h2peer.HEADERS:
            answered.add(f.stream_id)
        return len(answered) == limit

    await peer.read_until(all_answered, 10)
    assert answered == set(sids[:-1])
    assert not [f for f in peer.received if f.type == h2peer.GOAWAY]


@pytest.mark.parametrize("ftype", [h2peer.DATA, h2peer.HEADERS, 0xFA])
async def test_oversized_frame_is_refused_at_its_header(target, ftype: int) -> None:
    peer = await target.raw()
    if ftype == h2peer.DATA:
        peer.send(peer.connect_headers(1))
    peer.send(frame(ftype, 0, 1, b"", length=16 * 1024 * 1024 - 1))  # only the 9-byte header
    goaway = await peer.goaway(5)
    assert goaway.error_code == h2peer.FRAME_SIZE_ERROR


async def test_header_block_is_bounded_before_it_is_decoded(target) -> None:
    peer = await target.raw()
    bystander = Bystander(*await open_echo(await target.connect()))
    # What could be one huge Huffman literal: never buffered past the bound, never decoded.
    started = time.monotonic()
    peer.send(frame(h2peer.HEADERS, 0, 1, b"\x00\x7f" + os.urandom(60_000)))
    for _ in range(3):
        peer.send(frame(h2peer.CONTINUATION, 0, 1, os.urandom(60_000)))
    goaway = await peer.goaway(5)
    assert goaway.error_code == h2peer.ENHANCE_YOUR_CALM
    assert time.monotonic() - started < 5
    await bystander.stop()


async def test_continuation_flood_is_bounded_by_count(target) -> None:
    peer = await target.raw()
    peer.send(frame(h2peer.HEADERS, 0, 1, peer.connect_headers(1)[9:]))
    peer.send(frame(h2peer.CONTINUATION, 0, 1) * 1000)
    goaway = await peer.goaway(5)
    assert goaway.error_code == h2peer.ENHANCE_YOUR_CALM


@pytest.mark.parametrize("flood", [ping(), frame(h2peer.SETTINGS, 0, 0)], ids=["ping", "settings"])
async def test_flood_from_a_peer_that_does_not_read_is_bounded(target, flood: bytes) -> None:
    bystander = Bystander(*await open_echo(await target.connect()))
    peer = await target.raw(rcvbuf=4096)
    chunk = flood * 4096
    sent = 0
    budget = 16 * 1024 * 1024  # far past what the server may buffer for it
    while sent < budget:
        peer.send(chunk)
        try:
            await asyncio.wait_for(peer.writer.drain(), 1.0)
        except TimeoutError:
            break  # the server stopped reading us
        sent += len(chunk)
    assert sent < budget, "the server kept reading a peer that never reads its replies"
    flooded = [s for s in target.server.sessions if s.peer_identity and s.peer_identity.service_account]
    buffered = max(s.transport.get_write_buffer_size() for s in flooded if s.transport is not None)
    # the transport's high-water mark, the replies allowed past it, one read's worth of replies
    assert buffered < 1024 * 1024 + 64 * 1024 + 512 * 1024, buffered
    await bystander.stop()


async def test_half_a_client_hello_is_cheap_and_closed_at_the_handshake_timeout() -> None:
    t = Target(H2Settings(handshake_timeout=1.0))
    await t.server.serve(t.listener)
    try:
        tasks_before = len(asyncio.all_tasks())
        loop = asyncio.get_running_loop()
        held = []
        for _ in range(100):
            s = socket.socket()
            s.setblocking(False)
            await loop.sock_connect(s, t.addr)
            await loop.sock_sendall(s, b"\x16\x03\x01\x02\x00" + b"\x01" * 100)  # of a 512-byte record
            held.append(s)
        started = time.monotonic()
        await t.connect()  # accepted after the 100 (one backlog, in order): they are all pending now
        assert len(asyncio.all_tasks()) <= tasks_before + 2  # no task, no TLS object per pending one
        for s in held:
            try:
                assert await asyncio.wait_for(loop.sock_recv(s, 1), 10) == b""
            except ConnectionResetError:
                pass
            s.close()
        assert time.monotonic() - started < 5.0
        assert sum("no complete ClientHello" in str(e) for e in t.tls_errors) == 100
    finally:
        for conn in t.conns:
            conn.abort()
        await t.server.shutdown(graceful=False)


async def test_bytes_that_are_not_tls_are_dropped_at_once(target) -> None:
    loop = asyncio.get_running_loop()
    s = socket.socket()
    s.setblocking(False)
    await loop.sock_connect(s, target.addr)
    started = time.monotonic()
    await loop.sock_sendall(s, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    try:
        assert await asyncio.wait_for(loop.sock_recv(s, 1), 5) == b""
    except ConnectionResetError:
        pass
    s.close()
    assert time.monotonic() - started < 2.0  # long before the 10 s handshake timeout
    assert [str(e) for e in target.tls_errors] == ["tls handshake error: not a TLS handshake record"]


async def test_early_data_goes_with_the_connect_and_is_dropped_on_refusal(target) -> None:
    conn = await target.connect()
    stream = await conn.connect("127.0.0.1:80", early_data=b"hello before 200")
    sink = Sink()
    stream.set_protocol(sink)
    await sink.wait_for(16)
    assert bytes(sink.data) == b"hello before 200"
    with pytest.raises(HttpStatusError, match="401"):
        await conn.connect("deny:1", early_data=b"x" * 100_000)
    assert conn.is_usable()
    stream, sink = await open_echo(conn)
    stream.write(b"still fine")
    await sink.wait_for(10)


ONE_BYTE_FRAMES = 100_000


async def test_100000_one_byte_data_frames_all_arrive_from_a_raw_peer(target) -> None:
    """No budget on small DATA frames: a peer that frames every byte alone (100,000 frames on one
    stream, 1 MB on the wire for 100 kB) is legitimate traffic, not an attack: every byte reaches
    the app in order, and the connection is not sent a GOAWAY or a reset."""
    peer = await target.raw()
    peer.send(peer.connect_headers(1, "sink:raw"))
    await peer.read_until(lambda f: f.type == h2peer.HEADERS and f.stream_id == 1, 10.0)
    payload = bytes(i % 251 for i in range(ONE_BYTE_FRAMES))
    wire = b"".join(frame(h2peer.DATA, 0, 1, payload[i : i + 1]) for i in range(ONE_BYTE_FRAMES))
    for at in range(0, len(wire), 64 * 1024):
        peer.send(wire[at : at + 64 * 1024])
        await asyncio.wait_for(peer.writer.drain(), 10.0)
    peer.send(frame(h2peer.DATA, h2peer.END_STREAM, 1) + ping(b"all-sent"))
    await eventually_async(lambda: "sink:raw" in target.sinks, "the stream's sink")
    sink = target.sinks["sink:raw"]
    await sink.wait_for(ONE_BYTE_FRAMES, timeout=30.0)
    await peer.read_until(lambda f: f.type == h2peer.PING and f.flags & h2peer.ACK, 10.0)
    assert bytes(sink.data) == payload
    assert not [f for f in peer.received if f.type in (h2peer.GOAWAY, h2peer.RST_STREAM)], peer.summary()
    # the window they used came back (WINDOW_UPDATE past half a window, stream and connection)
    assert any(f.type == h2peer.WINDOW_UPDATE and f.stream_id == 0 for f in peer.received)


async def test_100000_one_byte_writes_of_our_client_all_arrive(target) -> None:
    """The same through our own client, a DATA frame (and a TLS record) per one-byte write."""
    conn = await target.connect()
    stream = await conn.connect("sink:client")
    stream.set_protocol(Sink())
    payload = bytes(i % 251 for i in range(ONE_BYTE_FRAMES))
    for i in range(ONE_BYTE_FRAMES):
        stream.write(payload[i : i + 1])
        if i % 1000 == 999:
            await asyncio.sleep(0)  # let the loop carry what is written, as an app's loop does
    stream.write_eof()
    await eventually_async(lambda: "sink:client" in target.sinks, "the stream's sink")
    sink = target.sinks["sink:client"]
    await sink.wait_for(ONE_BYTE_FRAMES, timeout=40.0)
    assert bytes(sink.data) == payload
    assert conn.is_usable()
