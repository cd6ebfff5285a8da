"""The core's DATA path without event objects: `feed` and `step` hand a DATA payload out as a view
of the bytes received (no copy, no object per frame) in the order of the frames around it, and
`take_output_buffer` lays a DATA frame's header beside its payload for one TLS write. `receive`
(built on them) stays checked against h2 by tests/test_h2core_oracle.py and the fuzzers."""

from __future__ import annotations

import struct

import pytest

from hbone.h2core import STEP_DATA, STEP_DONE, STEP_EVENTS, H2Core
from hbone.h2core import events as ev
from hbone.settings import H2Settings
from tests.h2core_util import Server, frames
from tests.h2peer import DATA, END_STREAM, RST_STREAM, frame

PADDED = 0x8


def steps(core: H2Core, data: bytes | bytearray | memoryview) -> list[object]:
    """What `step` reports, in order: a DATA payload as (stream, its bytes, flow length, whether it
    is a view of `data`), the other events as they are."""
    core.feed(data, 0.0)
    seen: list[object] = []
    while True:
        kind = core.step()
        if kind == STEP_DATA:
            view = core.data
            seen.append((core.data_stream_id, view.tobytes(), core.data_flow, view.obj is data))
        elif kind == STEP_EVENTS:
            for event in core.take_events():  # a padded frame cut across reads comes buffered, copied
                is_data = isinstance(event, ev.DataReceived)
                seen.append((event.stream_id, event.data, event.flow_length, False) if is_data else event)
        else:
            assert kind == STEP_DONE
            return seen


def open_server() -> Server:
    s = Server()
    s.feed(s.request(1))
    s.core.send_headers(1, [(":status", "200")], False)
    s.output()
    return s


def test_data_is_handed_out_in_place_between_the_events_of_the_frames_around_it() -> None:
    s = Server()
    received = bytearray(
        s.request(1)
        + frame(DATA, 0, 1, b"hello")
        + frame(DATA, PADDED, 1, bytes([3]) + b"padded" + b"\0" * 3)
        + frame(DATA, END_STREAM, 1, b"end")
        + s.request(3)
        + frame(RST_STREAM, 0, 3, struct.pack(">L", 8))
    )
    seen = steps(s.core, received)
    assert seen == [
        ev.RequestReceived(1, [(":method", "CONNECT"), (":authority", "127.0.0.1:80")], False),
        (1, b"hello", 5, True),
        (1, b"padded", 10, True),  # the flow length counts the padding
        (1, b"end", 3, True),
        ev.StreamEnded(1),
        ev.RequestReceived(3, [(":method", "CONNECT"), (":authority", "127.0.0.1:80")], False),
        ev.StreamReset(3, 8, True),
    ]


@pytest.mark.parametrize("split", [1, 2, 7, 9, 10, 13, 100])
def test_any_split_hands_out_the_same_bytes_and_events_as_receive(split: int) -> None:
    """Frames cut across reads (a payload in pieces, a padded frame buffered whole) give what
    `receive` gives, piece by piece."""
    wire = (
        frame(DATA, 0, 1, b"a" * 40)
        + frame(DATA, PADDED, 1, bytes([5]) + b"b" * 20 + b"\0" * 5)
        + frame(DATA, 0, 1, b"")
        + frame(DATA, END_STREAM, 1, b"c" * 3)
    )
    by_step, by_receive = open_server(), open_server()
    got: list[object] = []
    want: list[ev.Event] = []
    for at in range(0, len(wire), split):
        piece = wire[at : at + split]
        got += steps(by_step.core, piece)
        want += by_receive.feed(piece)
    data = [(sid, chunk, flow) for sid, chunk, flow, _ in (x for x in got if isinstance(x, tuple))]
    assert data == [(e.stream_id, e.data, e.flow_length) for e in want if isinstance(e, ev.DataReceived)]
    assert [x for x in got if not isinstance(x, tuple)] == [
        e for e in want if not isinstance(e, ev.DataReceived)
    ]
    assert b"".join(chunk for _, chunk, _ in data) == b"a" * 40 + b"b" * 20 + b"c" * 3
    assert sum(flow for _, _, flow in data) == 40 + 26 + 3


def test_flow_control_and_errors_on_the_in_place_path_are_as_before() -> None:
    """DATA beyond the stream's window resets that stream (its bytes given back to the
    connection window); DATA in flight on a stream we reset is dropped; on stream 0 a connection error."""
    settings = H2Settings(stream_window=16384)
    s = Server(settings)
    s.feed(s.request(1) + s.request(3))
    s.output()
    seen = steps(s.core, frame(DATA, 0, 1, b"x" * 16384) + frame(DATA, 0, 1, b"y") + frame(DATA, 0, 3, b"z"))
    assert seen == [(1, b"x" * 16384, 16384, True), ev.StreamReset(1, 3, False), (3, b"z", 1, True)]
    assert [(f.type, f.stream_id, f.error_code) for f in s.output()] == [(RST_STREAM, 1, 3)]
    seen = steps(s.core, frame(DATA, 0, 1, b"late") + frame(DATA, 0, 0, b"bad") + frame(DATA, 0, 3, b"lost"))
    assert seen == [ev.ConnectionTerminated(1, "DATA on stream 0", False)]
    assert s.core.terminated
    assert steps(s.core, frame(DATA, 0, 3, b"more")) == []


def test_the_output_buffer_holds_a_large_data_frame_beside_its_header() -> None:
    """From 16 KiB on a payload is queued by reference (`take_output` returns it apart: a TLS
    record of its own for the 9-byte header before it); `take_output_buffer` returns one buffer."""
    payload = bytes(range(256)) * 160  # 40 KiB: three frames at the default maximum frame size
    apart, joined = open_server(), open_server()
    for s in (apart, joined):
        s.core.ack(1, 0)
        s.core.send_window = s.core.streams[1].send_window = 1 << 20
        assert s.core.send_data(1, payload) == len(payload)
        s.core.end_stream(1)
    chunks = apart.core.take_output()
    assert len(chunks) > 1 and any(len(c) == len(payload) or len(c) == 16384 for c in chunks)
    buffer = joined.core.take_output_buffer()
    assert isinstance(buffer, bytearray)
    assert bytes(buffer) == b"".join(bytes(c) for c in chunks)
    sent = frames(bytes(buffer))
    assert [(f.type, len(f.payload)) for f in sent] == [(DATA, 16384), (DATA, 16384), (DATA, 8192), (DATA, 0)]
    assert b"".join(f.payload for f in sent) == payload
    assert joined.core.take_output_buffer() == bytearray()


@pytest.mark.parametrize("before", [0, 1, 100, 16384 - 9, 20000])
def test_a_large_data_frames_header_shares_a_tls_record_with_its_payload(before: int) -> None:
    """Each chunk of `take_output` is sealed into TLS records of its own (16 KiB of plaintext at
    most): the chunk holding a large DATA frame's header is filled to a whole number of records
    with the head of its payload, so the header never costs a record of its own; the rest of the
    payload is not copied."""
    s = open_server()
    s.core.send_window = s.core.streams[1].send_window = 1 << 20
    small = b"s" * before  # smaller frames queued ahead, in the same output
    for at in range(0, before, 1000):
        s.core.send_data(1, small[at : at + 1000])
    payload = bytes(range(256)) * 200  # 50 KiB: one frame (our peer allows 1 MiB frames)
    s.core.streams[1].send_window = s.core.send_window = 1 << 20
    s.core.peer_max_frame = 1 << 20
    assert s.core.send_data(1, payload) == len(payload)
    chunks = s.core.take_output()
    head, rest = chunks
    assert len(head) % 16384 == 0
    records = -(-len(head) // 16384) + -(-len(rest) // 16384)
    assert records == -(-(len(head) + len(rest)) // 16384)  # as few as one buffer would take
    assert isinstance(rest, memoryview) and rest.obj is payload  # not copied
    sent = frames(b"".join(bytes(c) for c in chunks))
    assert b"".join(f.payload for f in sent) == small + payload
