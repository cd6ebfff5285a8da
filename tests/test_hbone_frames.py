"""The session (`hbone.h2conn` on its core, `hbone.h2core`), its DATA path above all, fed without
sockets: frame sequences from a real `h2` client, split at random points, with malformed frames
mixed in. Each case ends in correct delivery or a typed protocol error, never another exception,
and a torn-down session never parses again.

The budget is `FUZZ_EXAMPLES` examples per target (a bounded default under `make test`).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from typing import Any

import pytest
from h2.config import H2Configuration
from h2.connection import H2Connection
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hbone.errors import ConnectionClosed
from hbone.h2conn import H2Session
from hbone.settings import H2Settings
from hbone.stream import HboneStream
from tests.h2peer import frame

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "150"))
# Under `make test` the examples are derived from a fixed seed, so a run is repeatable; `make fuzz`
# (FUZZ_EXAMPLES set) explores anew each time.
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize="FUZZ_EXAMPLES" not in os.environ,
)


class MemoryTransport(asyncio.Transport):
    """Where the session under test writes; nothing is sent anywhere."""

    def __init__(self) -> None:
        super().__init__()
        self.out = bytearray()
        self.closed = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def write(self, data: Any) -> None:
        self.out += data

    def writelines(self, list_of_data: Any) -> None:
        for data in list_of_data:
            self.out += data

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class Received(asyncio.Protocol):
    def __init__(self) -> None:
        self.data = bytearray()
        self.eof = False
        self.lost = False

    def data_received(self, data: bytes) -> None:
        self.data += data

    def eof_received(self) -> bool:
        self.eof = True
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True


class Harness:
    """A server-side session on a memory transport; every request is answered 200 and read."""

    def __init__(self) -> None:
        self.requests: list[HboneStream] = []
        self.received: dict[int, Received] = {}
        self.session = H2Session(client_side=False, settings=H2Settings(), on_request=self._on_request)
        self.transport = MemoryTransport()
        self.session.connection_made(self.transport)
        self.session.start()

    def _on_request(self, stream: HboneStream, headers: list[tuple[str, str]]) -> None:
        self.requests.append(stream)
        stream.respond(200)
        sink = self.received[stream.stream_id] = Received()
        stream.set_protocol(sink)

    def feed(self, data: bytes, cuts: list[int]) -> None:
        for piece in split(data, cuts):
            self.session.data_received(piece)


def split(data: bytes, cuts: list[int]) -> Iterator[bytes]:
    last = 0
    for cut in sorted({c % (len(data) + 1) for c in cuts}):
        yield data[last:cut]
        last = cut
    yield data[last:]


def run(coro: Any) -> Any:
    with asyncio.Runner() as runner:
        return runner.run(coro)


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)  # deliveries scheduled with call_soon


def protocol_error_or_alive(h: Harness) -> None:
    reason = h.session.close_reason
    if reason is not None:
        assert isinstance(reason, ConnectionClosed)
        assert str(reason).startswith(("http2 protocol error", "connection closed")), reason


# One step of a well-behaved client: open a stream, send on one, end one, reset one, PING, SETTINGS.
op = st.one_of(
    st.tuples(st.just("open")),
    st.tuples(st.just("data"), st.integers(0, 7), st.integers(0, 40_000), st.integers(0, 20), st.booleans()),
    st.tuples(st.just("end"), st.integers(0, 7)),
    st.tuples(st.just("reset"), st.integers(0, 7)),
    st.tuples(st.just("ping")),
    st.tuples(st.just("settings")),
)


def client_bytes(ops: list[tuple[Any, ...]]) -> tuple[bytes, dict[int, bytes], set[int], set[int]]:
    """What a real h2 client sends for `ops`; the bytes sent per stream, ended and reset streams."""
    client = H2Connection(H2Configuration(client_side=True, header_encoding=None))
    client.initiate_connection()
    streams: list[int] = []
    sent: dict[int, bytes] = {}
    ended: set[int] = set()
    reset: set[int] = set()
    for step in ops:
        kind = step[0]
        if kind == "open" and len(streams) < 8:
            sid = client.get_next_available_stream_id()
            client.send_headers(sid, [(":method", "CONNECT"), (":authority", "127.0.0.1:80")])
            streams.append(sid)
            sent[sid] = b""
        elif kind == "ping":
            client.ping(os.urandom(8))
        elif kind == "settings":
            client.update_settings({})
        elif kind == "open":
            continue  # no more than 8 streams
        elif streams:
            sid = streams[step[1] % len(streams)]
            if sid in ended or sid in reset:
                continue
            if kind == "data":
                _, _, size, pad, end = step
                # Every frame fits the flow-control windows, its padding included.
                cost = pad + 1 if pad else 0
                payload = bytearray()
                while True:
                    chunk = min(size - len(payload), 16_000, client.local_flow_control_window(sid) - cost)
                    if chunk < 0:
                        break
                    last = len(payload) + chunk == size
                    piece = os.urandom(chunk)
                    client.send_data(sid, piece, end_stream=end and last, pad_length=pad or None)
                    payload += piece
                    if last:
                        if end:
                            ended.add(sid)
                        break
                    if chunk == 0:
                        break  # the window is spent
                sent[sid] += bytes(payload)
            elif kind == "end":
                client.end_stream(sid)
                ended.add(sid)
            elif kind == "reset":
                client.reset_stream(sid)
                reset.add(sid)
    return client.data_to_send(), sent, ended, reset


@FUZZ
@given(ops=st.lists(op, max_size=30), cuts=st.lists(st.integers(0, 1 << 20), max_size=12))
def test_valid_sequences_at_any_split_are_delivered_exactly(
    ops: list[tuple[Any, ...]], cuts: list[int]
) -> None:
    async def case() -> None:
        data, sent, ended, reset = client_bytes(ops)
        h = Harness()
        h.feed(data, cuts)
        await settle()
        assert h.session.close_reason is None, h.session.close_reason
        for sid, payload in sent.items():
            if sid in reset:
                continue
            sink = h.received[sid]
            assert bytes(sink.data) == payload
            assert sink.eof == (sid in ended)

    run(case())


# Frames a peer may send, well-formed or not: random type, flags, stream and payload.
raw_frame = st.builds(
    lambda t, f, s, p: frame(t, f, s, p),
    st.sampled_from([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0xFA]),
    st.integers(0, 255),
    st.sampled_from([0, 1, 3, 5, 2, 2**31 - 1]),
    st.binary(max_size=64),
)


@FUZZ
@given(
    ops=st.lists(op, max_size=15),
    junk=st.lists(st.tuples(st.integers(0, 1 << 16), raw_frame | st.binary(max_size=32)), max_size=6),
    cuts=st.lists(st.integers(0, 1 << 20), max_size=12),
)
def test_malformed_frames_end_in_a_protocol_error_never_a_crash(
    ops: list[tuple[Any, ...]], junk: list[tuple[int, bytes]], cuts: list[int]
) -> None:
    async def case() -> None:
        data, _, _, _ = client_bytes(ops)
        preface = 24 + 9 + 12  # the client preface, its SETTINGS and more: keep the start intact
        stream = bytearray(data)
        for at, extra in sorted(junk, reverse=True):
            pos = preface + at % (len(stream) - preface + 1) if len(stream) > preface else len(stream)
            stream[pos:pos] = extra
        h = Harness()
        h.feed(bytes(stream), cuts)
        await settle()
        protocol_error_or_alive(h)
        if h.session.close_reason is not None:
            before = len(h.requests)
            h.feed(data, [])  # late bytes after the teardown: ignored
            assert len(h.requests) == before

    run(case())


def test_late_bytes_after_an_abort_mid_data_are_ignored() -> None:
    async def case() -> None:
        client = H2Connection(H2Configuration(client_side=True, header_encoding=None))
        client.initiate_connection()
        client.send_headers(1, [(":method", "CONNECT"), (":authority", "127.0.0.1:80")])
        head = client.data_to_send()
        client.send_data(1, b"x" * 10_000)
        data = client.data_to_send()
        client.send_headers(3, [(":method", "CONNECT"), (":authority", "127.0.0.1:81")])
        later = client.data_to_send()
        h = Harness()
        h.feed(head + data[:5000], [])
        await settle()
        assert len(h.received[1].data) == 5000 - 9
        h.session.abort()
        h.feed(data[5000:] + later, [1000, 2000])  # the rest of the DATA frame, then a new request
        await settle()
        assert len(h.requests) == 1
        assert isinstance(h.session.close_reason, ConnectionClosed)

    run(case())


@pytest.mark.parametrize("claimed", [2**24 - 1, H2Settings().frame_size + 1])
def test_oversized_frame_header_alone_ends_the_session(claimed: int) -> None:
    async def case() -> None:
        client = H2Connection(H2Configuration(client_side=True, header_encoding=None))
        client.initiate_connection()
        h = Harness()
        h.feed(client.data_to_send() + frame(0, 0, 1, length=claimed), [])
        assert "maximum frame size" in str(h.session.close_reason)
        assert h.transport.closed

    run(case())


def test_data_in_flight_on_a_stream_we_reset_is_no_attack() -> None:
    """A client uploading while the server resets its streams (the app went away) sends DATA that
    crosses the RST_STREAM: each is answered, none counts towards the rapid-reset limit."""

    async def case() -> None:
        client = H2Connection(H2Configuration(client_side=True, header_encoding=None))
        client.initiate_connection()
        h = Harness()
        limit = H2Settings().max_resets
        for n in range(3):
            sid = client.get_next_available_stream_id()
            client.send_headers(sid, [(":method", "CONNECT"), (":authority", "127.0.0.1:80")])
            h.feed(client.data_to_send(), [])
            h.requests[-1].reset()  # the server side gives up on it
            for _ in range(limit // 2):
                client.send_data(sid, b"x")
            h.feed(client.data_to_send(), [7, 100, 1000])
            assert h.session.close_reason is None, (n, h.session.close_reason)
        await settle()

    run(case())
