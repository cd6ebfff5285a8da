"""The HTTP/2 core's receive path (`hbone.h2core.H2Core.receive`) fed arbitrary bytes, on either
side, after a valid preface or without one: no exception escapes, what it keeps and what it
queues to send stay bounded, and once it has ended the connection it takes nothing more."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from hbone.h2core import H2Core
from hbone.h2core import events as ev
from hbone.settings import H2Settings
from tests.h2peer import ACK, END_HEADERS, HEADERS, PREFACE, SETTINGS, frame

SETTINGS_ = H2Settings(max_concurrent_streams=8, frame_size=16384)

# Frames a peer may send, well-formed or not: any type (a few unknown), flags, stream and payload.
raw_frame = st.builds(
    frame,
    st.sampled_from([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0x10, 0xFA]),
    st.integers(0, 255),
    st.sampled_from([0, 1, 2, 3, 5, 7, 2**31 - 1]),
    st.binary(max_size=80),
)
# A CONNECT request's block (:method CONNECT, :authority a:1, as literals without indexing).
CONNECT_BLOCK = b"\x02\x07CONNECT\x01\x03a:1"
request = st.builds(
    lambda sid, flags: frame(HEADERS, END_HEADERS | flags, sid, CONNECT_BLOCK),
    st.sampled_from([1, 3, 5, 7, 9, 11]),
    st.sampled_from([0, 1]),
)
chunk = st.one_of(raw_frame, request, st.binary(max_size=40))


@given(
    client_side=st.booleans(),
    preface=st.booleans(),
    chunks=st.lists(chunk, max_size=40),
    cuts=st.lists(st.integers(1, 64), max_size=10),
)
def test_arbitrary_bytes_never_escape_as_exceptions(
    client_side: bool, preface: bool, chunks: list[bytes], cuts: list[int]
) -> None:
    core = H2Core(client_side=client_side, settings=SETTINGS_, now=0.0)
    core.initiate(SETTINGS_.local_settings(client_side=client_side), 0.0)
    core.take_output()
    start = b"" if client_side else PREFACE
    data = (start + frame(SETTINGS, 0, 0) + frame(SETTINGS, ACK, 0) if preface else b"") + b"".join(chunks)
    out = 0
    pos = 0
    step = iter(cuts)
    now = 0.0
    while pos < len(data):
        n = next(step, len(data))
        events = core.receive(data[pos : pos + n], now)
        pos += n
        now += 0.01
        out += sum(len(c) for c in core.take_output())
        assert len(core.streams) <= SETTINGS_.max_concurrent_streams
        if any(isinstance(e, ev.ConnectionTerminated) for e in events):
            assert core.terminated
    # Replies (ACKs, resets, a GOAWAY) stay within a small multiple of what came in.
    assert out <= 2 * len(data) + 400
    if core.terminated:
        assert core.receive(frame(SETTINGS, 0, 0) + b"x" * 100, now) == []
        assert core.take_output() == []
