"""The sans-IO HTTP/2 core (`hbone.h2core`) as transcripts: frames in, events and frames out, the
time given; no sockets, milliseconds each. The abuse limits first, then RFC 9113's errors, each
the connection or stream error the RFC names, then GOAWAY both ways."""

from __future__ import annotations

import struct

import pytest

from hbone.h2core import STEP_DONE, ErrorCode, H2Core
from hbone.h2core import events as ev
from hbone.settings import H2Settings
from tests.h2core_util import Server, frames, of
from tests.h2peer import (
    ACK,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    PING,
    PREFACE,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    frame,
    ping,
    rst,
)

RST = RST_STREAM


def goaway_of(s: Server) -> int | None:
    codes = [f.error_code for f in s.output() if f.type == GOAWAY]
    return codes[-1] if codes else None


def terminated(s: Server) -> ev.ConnectionTerminated:
    (end,) = of(s.events, ev.ConnectionTerminated)
    assert isinstance(end, ev.ConnectionTerminated)
    return end


# -- abuse limits -------------------------------------------------------------------------------


def test_rapid_reset_ends_the_connection_once_past_the_limit_within_the_window() -> None:
    s = Server(H2Settings(max_resets=10, reset_window=1.0))
    for n in range(10):
        s.feed(s.request(1 + 2 * n) + rst(1 + 2 * n, ErrorCode.CANCEL))
    assert not s.core.terminated
    s.feed(s.request(21) + rst(21, ErrorCode.CANCEL))
    end = terminated(s)
    assert end.error_code == ErrorCode.ENHANCE_YOUR_CALM and end.limit
    assert "rapid reset" in end.message
    assert goaway_of(s) == ErrorCode.ENHANCE_YOUR_CALM


def test_resets_spread_over_windows_are_no_attack() -> None:
    s = Server(H2Settings(max_resets=10, reset_window=1.0))
    for n in range(40):
        s.now = n * 0.2  # 5 per second
        s.feed(s.request(1 + 2 * n) + rst(1 + 2 * n, ErrorCode.CANCEL))
    assert not s.core.terminated


def test_fed_without_the_time_the_core_reads_its_clock_only_to_count_a_reset() -> None:
    """A session feeds its batches without the time: a batch of DATA reads no clock; a reset reads
    it once for its batch, and rapid reset is judged by it as by the time given."""
    reads: list[float] = []
    now = [0.0]

    def clock() -> float:
        reads.append(now[0])
        return now[0]

    settings = H2Settings(max_resets=10, reset_window=1.0)
    core = H2Core(client_side=False, settings=settings, now=0.0, clock=clock)
    core.initiate(settings.local_settings(client_side=False), 0.0)
    s = Server(settings)
    s.core = core

    def feed(data: bytes) -> None:
        core.feed(data)
        while core.step() != STEP_DONE:
            core.take_events()

    feed(PREFACE + frame(SETTINGS, 0, 0) + frame(SETTINGS, ACK, 0) + s.request(1))
    feed(b"".join(frame(DATA, 0, 1, b"x" * 100) for _ in range(50)))
    assert reads == []
    for n in range(40):  # 5 resets a second: within the limit, the windows roll over
        now[0] = n * 0.2
        feed(s.request(3 + 2 * n) + rst(3 + 2 * n, ErrorCode.CANCEL))
    assert len(reads) == 40 and not core.terminated
    feed(b"".join(s.request(83 + 2 * n) + rst(83 + 2 * n, ErrorCode.CANCEL) for n in range(11)))
    assert len(reads) == 41  # one read for the batch
    assert core.terminated


def test_resets_of_answered_streams_are_not_counted() -> None:
    s = Server(H2Settings(max_resets=5))
    for n in range(20):
        sid = 1 + 2 * n
        s.feed(s.request(sid))
        assert s.core.send_headers(sid, [(":status", "200")], end_stream=False)
        s.feed(rst(sid, ErrorCode.CANCEL))
    assert not s.core.terminated


def test_provoked_resets_count_too() -> None:
    """MadeYouReset: frames that make us reset (DATA on a stream the peer reset) count as resets."""
    s = Server(H2Settings(max_resets=5))
    s.feed(s.request(1))
    s.core.send_headers(1, [(":status", "200")], end_stream=False)
    s.feed(rst(1, ErrorCode.CANCEL))  # answered: not counted
    for _ in range(5):
        s.feed(frame(DATA, 0, 1, b"x"))
    assert not s.core.terminated
    resets = [f for f in s.output() if f.type == RST]
    assert [f.error_code for f in resets] == [ErrorCode.STREAM_CLOSED] * 5
    s.feed(frame(DATA, 0, 1, b"x"))
    assert terminated(s).error_code == ErrorCode.ENHANCE_YOUR_CALM


def test_frames_in_flight_on_a_stream_we_reset_are_ignored_and_not_counted() -> None:
    s = Server(H2Settings(max_resets=3))
    s.feed(s.request(1))
    s.core.reset_stream(1, ErrorCode.CANCEL)
    s.output()
    events = s.feed(frame(DATA, 0, 1, b"x" * 100) * 20 + frame(WINDOW_UPDATE, 0, 1, struct.pack(">L", 5)))
    assert events == [] and not s.core.terminated
    assert all(f.type != RST for f in s.output())  # the connection window still comes back:
    s.core.ack(0, 0)
    assert s.core.recv_window + 2000 >= s.settings.connection_window


def test_header_block_size_is_refused_at_the_frame_header_before_its_bytes() -> None:
    s = Server()
    limit = s.settings.max_header_block
    s.feed(frame(HEADERS, 0, 1, b"\x82"))  # no END_HEADERS
    # Only the 9-byte header of a CONTINUATION that would take the block past the limit.
    s.feed(struct.pack(">HBBBL", limit >> 8, limit & 0xFF, CONTINUATION, 0, 1))
    end = terminated(s)
    assert end.error_code == ErrorCode.ENHANCE_YOUR_CALM and "header block" in end.message


def test_continuation_flood_is_refused_past_the_count() -> None:
    s = Server()
    s.feed(frame(HEADERS, 0, 1, b""))
    for _ in range(s.settings.max_continuations):
        s.feed(frame(CONTINUATION, 0, 1, b""))
    assert not s.core.terminated
    s.feed(frame(CONTINUATION, 0, 1, b""))
    assert "CONTINUATION" in terminated(s).message


def test_frame_larger_than_our_maximum_is_refused_at_its_header() -> None:
    s = Server()
    n = s.settings.frame_size + 1
    s.feed(struct.pack(">HBBBL", n >> 8, n & 0xFF, DATA, 0, 1))
    assert terminated(s).error_code == ErrorCode.FRAME_SIZE_ERROR


def test_streams_past_our_maximum_are_refused_alone() -> None:
    s = Server(H2Settings(max_concurrent_streams=2))
    s.feed(s.request(1) + s.request(3) + s.request(5, "10.0.0.5:80"))
    assert [e.stream_id for e in of(s.events, ev.RequestReceived)] == [1, 3]  # type: ignore[attr-defined]
    refused = [f for f in s.output() if f.type == RST]
    assert [(f.stream_id, f.error_code) for f in refused] == [(5, ErrorCode.REFUSED_STREAM)]
    # The refused block was decoded all the same: a later block referring to its fields still decodes.
    s.core.send_headers(1, [(":status", "200")], end_stream=True)
    s.feed(frame(DATA, END_STREAM, 1, b""))
    s.feed(s.request(7, "10.0.0.5:80"))
    (last,) = of(s.events, ev.RequestReceived)[-1:]
    assert last.stream_id == 7 and (":authority", "10.0.0.5:80") in last.headers  # type: ignore[attr-defined]


def test_replies_to_a_peer_that_does_not_read_are_bounded() -> None:
    s = Server(H2Settings(paused_output_limit=1000))
    s.core.set_write_blocked(True)
    s.feed(ping() * 50)  # 50 ACKs of 17 bytes: below the limit
    assert not s.core.reading_should_pause
    s.feed(ping() * 20)
    assert s.core.reading_should_pause
    s.core.set_write_blocked(False)
    assert not s.core.reading_should_pause


@pytest.mark.parametrize("acked", [False, True])
def test_a_peer_that_never_completes_its_preface_is_cut(acked: bool) -> None:
    from hbone.h2core import H2Core

    settings = H2Settings(handshake_timeout=5.0)
    core = H2Core(client_side=False, settings=settings, now=100.0)
    core.initiate(settings.local_settings(client_side=False), 100.0)
    if acked:
        core.receive(PREFACE + frame(SETTINGS, 0, 0), 101.0)  # never acknowledges ours
    assert core.deadline() == 105.0
    assert core.timer(104.9) == []
    (end,) = core.timer(105.0)
    assert isinstance(end, ev.ConnectionTerminated) and end.error_code == ErrorCode.SETTINGS_TIMEOUT
    assert core.terminated


def test_a_completed_preface_clears_the_deadline() -> None:
    s = Server()
    assert s.core.deadline() is None
    assert s.core.timer(1e9) == []


# -- RFC 9113 errors ------------------------------------------------------------------------------


CONNECTION_ERRORS = {
    "DATA on stream 0": (frame(DATA, 0, 0, b"x"), ErrorCode.PROTOCOL_ERROR),
    "DATA on an idle stream": (frame(DATA, 0, 9, b"x"), ErrorCode.PROTOCOL_ERROR),
    "PING of 7 bytes": (frame(PING, 0, 0, b"1234567"), ErrorCode.FRAME_SIZE_ERROR),
    "PING on a stream": (frame(PING, 0, 1, b"12345678"), ErrorCode.PROTOCOL_ERROR),
    "SETTINGS on a stream": (frame(SETTINGS, 0, 1), ErrorCode.PROTOCOL_ERROR),
    "SETTINGS of 5 bytes": (frame(SETTINGS, 0, 0, b"\x00\x04\x00\x00\x00"), ErrorCode.FRAME_SIZE_ERROR),
    "SETTINGS ACK with a payload": (frame(SETTINGS, ACK, 0, b"\x00" * 6), ErrorCode.FRAME_SIZE_ERROR),
    "INITIAL_WINDOW_SIZE past 2^31-1": (
        frame(SETTINGS, 0, 0, struct.pack(">HL", 4, 2**31)),
        ErrorCode.FLOW_CONTROL_ERROR,
    ),
    "MAX_FRAME_SIZE below 16384": (
        frame(SETTINGS, 0, 0, struct.pack(">HL", 5, 100)),
        ErrorCode.PROTOCOL_ERROR,
    ),
    "ENABLE_PUSH of 2": (frame(SETTINGS, 0, 0, struct.pack(">HL", 2, 2)), ErrorCode.PROTOCOL_ERROR),
    "connection WINDOW_UPDATE of 0": (frame(WINDOW_UPDATE, 0, 0, b"\x00" * 4), ErrorCode.PROTOCOL_ERROR),
    "connection window past 2^31-1": (
        frame(WINDOW_UPDATE, 0, 0, struct.pack(">L", 2**31 - 1)),
        ErrorCode.FLOW_CONTROL_ERROR,
    ),
    "WINDOW_UPDATE of 3 bytes": (frame(WINDOW_UPDATE, 0, 0, b"\x00\x00\x01"), ErrorCode.FRAME_SIZE_ERROR),
    "RST_STREAM on stream 0": (frame(RST, 0, 0, b"\x00" * 4), ErrorCode.PROTOCOL_ERROR),
    "RST_STREAM on an idle stream": (frame(RST, 0, 7, b"\x00" * 4), ErrorCode.PROTOCOL_ERROR),
    "CONTINUATION without HEADERS": (frame(CONTINUATION, END_HEADERS, 1, b""), ErrorCode.PROTOCOL_ERROR),
    "a frame inside a header block": (frame(HEADERS, 0, 1, b"\x82") + ping(), ErrorCode.PROTOCOL_ERROR),
    "PUSH_PROMISE": (frame(5, END_HEADERS, 1, b"\x00\x00\x00\x02"), ErrorCode.PROTOCOL_ERROR),
    "GOAWAY of 4 bytes": (frame(GOAWAY, 0, 0, b"\x00" * 4), ErrorCode.FRAME_SIZE_ERROR),
    "an undecodable header block": (
        frame(HEADERS, END_HEADERS, 1, b"\xff\xff\xff\xff"),
        ErrorCode.COMPRESSION_ERROR,
    ),
    "padding as long as the frame": (frame(DATA, 0x8, 1, b"\x05abc"), ErrorCode.PROTOCOL_ERROR),
    "a stream id below the last one": (b"", ErrorCode.PROTOCOL_ERROR),
}


@pytest.mark.parametrize("case", list(CONNECTION_ERRORS))
def test_connection_errors_end_in_goaway_with_the_rfc_code(case: str) -> None:
    s = Server()
    data, code = CONNECTION_ERRORS[case]
    if case == "padding as long as the frame":
        s.feed(s.request(1))
    if case == "a stream id below the last one":
        data = s.request(5) + s.request(3)
    s.feed(data)
    assert terminated(s).error_code == code, s.events
    assert goaway_of(s) == code
    assert s.feed(s.request(101)) == []  # nothing more is taken


STREAM_ERRORS = {
    "an uppercase field name": (
        lambda s: frame(HEADERS, END_HEADERS, 3, s.block(Bad="x")),
        ErrorCode.PROTOCOL_ERROR,
    ),
    "a connection-specific field": (
        lambda s: frame(HEADERS, END_HEADERS, 3, s.block(connection="close")),
        ErrorCode.PROTOCOL_ERROR,
    ),
    "CONNECT with a :path": (
        lambda s: frame(
            HEADERS,
            END_HEADERS,
            3,
            bytes(s.encoder.encode([(":method", "CONNECT"), (":authority", "a:1"), (":path", "/")])),
        ),
        ErrorCode.PROTOCOL_ERROR,
    ),
    "DATA beyond the stream window": (
        lambda s: s.request(3) + frame(DATA, 0, 3, b"x" * 16384) * (s.settings.stream_window // 16384 + 1),
        ErrorCode.FLOW_CONTROL_ERROR,
    ),
    "HEADERS after END_STREAM": (
        lambda s: (
            frame(HEADERS, END_HEADERS | END_STREAM, 3, s.block())
            + frame(HEADERS, END_HEADERS | END_STREAM, 3, s.block())
        ),
        ErrorCode.STREAM_CLOSED,
    ),
    "DATA after END_STREAM": (
        lambda s: frame(HEADERS, END_HEADERS | END_STREAM, 3, s.block()) + frame(DATA, 0, 3, b"x"),
        ErrorCode.STREAM_CLOSED,
    ),
    "trailers without END_STREAM": (
        lambda s: s.request(3) + frame(HEADERS, END_HEADERS, 3, b"\x40\x01a\x01b"),
        ErrorCode.PROTOCOL_ERROR,
    ),
    "a stream WINDOW_UPDATE of 0": (
        lambda s: s.request(3) + frame(WINDOW_UPDATE, 0, 3, b"\x00" * 4),
        ErrorCode.PROTOCOL_ERROR,
    ),
    "a stream window past 2^31-1": (
        lambda s: s.request(3) + frame(WINDOW_UPDATE, 0, 3, struct.pack(">L", 2**31 - 1)),
        ErrorCode.FLOW_CONTROL_ERROR,
    ),
    "PRIORITY of 4 bytes": (lambda s: frame(2, 0, 3, b"\x00" * 4), ErrorCode.FRAME_SIZE_ERROR),
}


@pytest.mark.parametrize("case", list(STREAM_ERRORS))
def test_stream_errors_reset_that_stream_alone(case: str) -> None:
    s = Server(H2Settings(stream_window=65535))
    make, code = STREAM_ERRORS[case]
    s.feed(s.request(1, "10.0.0.9:80"))  # a bystander
    s.feed(make(s))
    assert not s.core.terminated, s.events
    out = [f for f in s.output() if f.type == RST]
    assert [(f.stream_id, f.error_code) for f in out] == [(3, code)], out
    s.feed(frame(DATA, END_STREAM, 1, b"still here"))
    assert ev.DataReceived(1, b"still here", 10) in s.events


def test_unknown_frames_and_settings_are_ignored() -> None:
    s = Server()
    events = s.feed(frame(0xFA, 0xFF, 0, b"whatever") + frame(SETTINGS, 0, 0, struct.pack(">HL", 0x99, 7)))
    assert not s.core.terminated
    assert events == [ev.SettingsReceived({0x99: 7}, first=False)]
    assert [f.type for f in s.output()] == [SETTINGS]  # its ACK


def test_padded_and_split_header_blocks_and_data_are_read() -> None:
    s = Server()
    block = s.block()
    padded = bytes([3]) + block[:2] + b"\x00" * 3
    s.feed(frame(HEADERS, 0x8, 1, padded) + frame(CONTINUATION, 0, 1, block[2:4]))
    s.feed(frame(CONTINUATION, END_HEADERS, 1, block[4:]))
    s.feed(frame(DATA, 0x8 | END_STREAM, 1, bytes([4]) + b"abc" + b"\x00" * 4))
    assert of(s.events, ev.RequestReceived)[0].headers[:2] == [
        (":method", "CONNECT"),
        (":authority", "127.0.0.1:80"),
    ]  # type: ignore[attr-defined]
    assert of(s.events, ev.DataReceived) == [ev.DataReceived(1, b"abc", 8)]
    assert of(s.events, ev.StreamEnded) == [ev.StreamEnded(1)]


# -- GOAWAY both ways -------------------------------------------------------------------------------


def test_goaway_sent_lets_the_streams_below_finish_and_refuses_the_rest() -> None:
    s = Server()
    s.feed(s.request(1) + s.request(3))
    s.core.goaway()
    (sent,) = [f for f in s.output() if f.type == GOAWAY]
    assert sent.last_stream_id == 3 and sent.error_code == 0
    s.feed(s.request(5) + frame(DATA, END_STREAM, 3, b"late but fine"))
    assert [(f.stream_id, f.error_code) for f in s.output() if f.type == RST] == [
        (5, ErrorCode.REFUSED_STREAM)
    ]
    assert ev.DataReceived(3, b"late but fine", 13) in s.events
    assert s.core.send_headers(1, [(":status", "200")], end_stream=False)
    assert s.core.send_data(1, b"answer") == 6


def test_goaway_received_refuses_our_streams_above_its_last_id_only() -> None:
    from hbone.h2core import H2Core

    settings = H2Settings()
    client = H2Core(client_side=True, settings=settings, now=0.0)
    client.initiate(settings.local_settings(client_side=True), 0.0)
    client.receive(frame(SETTINGS, 0, 0) + frame(SETTINGS, ACK, 0), 0.0)
    ids = [client.open_stream([(":method", "CONNECT"), (":authority", f"10.0.0.{n}:80")]) for n in range(3)]
    assert ids == [1, 3, 5]
    events = client.receive(frame(GOAWAY, 0, 0, struct.pack(">LL", 1, 0)), 0.0)
    assert events == [ev.GoAwayReceived(0, 1, b"", [3, 5])]
    with pytest.raises(Exception, match="GOAWAY"):
        client.open_stream([(":method", "CONNECT"), (":authority", "10.0.0.9:80")])
    block = b"\x88"  # :status 200
    events = client.receive(frame(HEADERS, END_HEADERS, 1, block) + frame(DATA, END_STREAM, 1, b"ok"), 0.0)
    assert events == [
        ev.ResponseReceived(1, [(":status", "200")], False),
        ev.DataReceived(1, b"ok", 2),
        ev.StreamEnded(1),
    ]
    assert client.send_data(1, b"more") == 4
    frames(b"".join(bytes(c) for c in client.take_output()))
