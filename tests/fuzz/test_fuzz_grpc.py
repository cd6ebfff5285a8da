"""The gRPC client's wire without I/O: framed messages read back equal at any split of the bytes;
any other bytes, and any header block, end as messages and a `Status`, never as another exception."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from xds.grpc.wire import CallState, MessageReader, RpcError, Status, frame_message, status_from

MESSAGES = st.lists(st.binary(max_size=300), max_size=6)
CUTS = st.lists(st.integers(1, 64), min_size=1, max_size=40)
TEXT = st.text(max_size=30)
FIELDS = st.lists(
    st.tuples(st.sampled_from(["grpc-status", "grpc-message", ":status", "content-type", "x"]), TEXT),
    max_size=6,
)


def _pieces(data: bytes, cuts: list[int]) -> list[bytes]:
    out, at = [], 0
    for cut in cuts * (len(data) // max(1, sum(cuts)) + 1):
        if at >= len(data):
            break
        out.append(data[at : at + cut])
        at += cut
    return out


@given(MESSAGES, CUTS)
def test_framed_messages_read_back_at_any_split(messages: list[bytes], cuts: list[int]) -> None:
    reader = MessageReader(300)
    out: list[bytes] = []
    for piece in _pieces(b"".join(frame_message(m) for m in messages), cuts):
        out += reader.feed(piece)
    assert out == messages and not reader.partial


@given(st.binary(max_size=400), CUTS, st.integers(0, 200))
def test_any_bytes_are_messages_or_a_status(data: bytes, cuts: list[int], limit: int) -> None:
    reader = MessageReader(limit)
    try:
        for piece in _pieces(data, cuts):
            for message in reader.feed(piece):
                assert len(message) <= limit
    except RpcError as e:
        assert isinstance(e.status, Status)


@given(FIELDS, st.booleans(), st.binary(max_size=100), FIELDS)
def test_any_response_ends_with_a_status(
    headers: list[tuple[str, str]], end: bool, data: bytes, trailers: list[tuple[str, str]]
) -> None:
    call = CallState(50)
    call.response(headers, end)
    call.data(data)
    call.trailers(trailers)
    call.ended()
    assert isinstance(call.status, Status)
    assert isinstance(status_from(trailers), Status)
