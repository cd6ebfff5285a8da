"""The private `h2` internals the session's DATA fast path and output batching rely on, pinned in
one place: an `h2` upgrade that moves any of them fails here, by name, before anything subtler.

`hbone/h2conn.py` re-states `H2Connection._receive_frame`, serialises into `_data_to_send`, reads
and charges the window managers directly, and decodes a refused stream's header block itself.
"""

from __future__ import annotations

import inspect

import h2
import h2.connection
import h2.exceptions
import h2.frame_buffer
import h2.stream
import h2.utilities
import h2.windows
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.exceptions import StreamClosedError
from h2.stream import StreamClosedBy, StreamState
from hypothesis import given, settings
from hypothesis import strategies as st


def open_server_stream() -> tuple[H2Connection, int]:
    client = H2Connection(H2Configuration(client_side=True, header_encoding=None))
    client.initiate_connection()
    client.send_headers(1, [(":method", "CONNECT"), (":authority", "127.0.0.1:80")])
    server = H2Connection(H2Configuration(client_side=False, header_encoding=None))
    server.initiate_connection()
    server.receive_data(client.data_to_send())
    return server, 1


def test_h2_major_version_is_the_one_the_session_was_written_for() -> None:
    assert h2.__version__.startswith("4."), h2.__version__


def test_connection_internals() -> None:
    server, sid = open_server_stream()
    assert isinstance(server._data_to_send, bytearray)
    assert callable(server._prepare_for_sending)
    assert set(server._frame_dispatch_table) >= {
        h2.connection.DataFrame,
        h2.connection.HeadersFrame,
        h2.connection.RstStreamFrame,
        h2.connection.GoAwayFrame,
    }
    # `_receive_frame` is re-stated: its signature and the helpers it calls must stay.
    assert list(inspect.signature(H2Connection._receive_frame).parameters) == ["self", "frame"]
    for name in ("_stream_is_closed_by_reset", "_stream_is_closed_by_end", "_stream_id_is_outbound"):
        assert callable(getattr(server, name)), name
    assert isinstance(server._closed_streams, dict)
    # Our bound on the closed streams h2 remembers takes effect through this class attribute.
    from hbone.h2conn import _H2Connection

    ours = _H2Connection(H2Configuration(client_side=False, header_encoding=None))
    assert getattr(ours._closed_streams, "_size_limit", None) == _H2Connection.MAX_CLOSED_STREAMS == 4096
    assert StreamClosedBy.SEND_RST_STREAM
    assert "_events" in inspect.signature(StreamClosedError.__init__).parameters or hasattr(
        StreamClosedError(1), "_events"
    )
    assert isinstance(server.incoming_buffer, h2.frame_buffer.FrameBuffer)
    assert server.incoming_buffer._headers_buffer == []
    assert server.highest_inbound_stream_id == sid
    assert callable(h2.connection._decode_headers)
    assert server.max_inbound_frame_size == 16384


def test_stream_internals() -> None:
    server, sid = open_server_stream()
    stream = server.streams[sid]
    assert stream.state_machine.state is StreamState.OPEN
    assert stream.state_machine.headers_received is True
    assert stream._expected_content_length is None
    assert stream._actual_content_length == 0
    assert isinstance(stream._inbound_window_manager, h2.windows.WindowManager)
    assert isinstance(stream.outbound_flow_control_window, int)
    assert stream.closed_by is None
    server.reset_stream(sid)
    assert stream.closed_by is StreamClosedBy.SEND_RST_STREAM


def test_window_manager_internals_and_their_threshold() -> None:
    server, sid = open_server_stream()
    for manager in (server._inbound_flow_control_window_manager, server.streams[sid]._inbound_window_manager):
        assert isinstance(manager, h2.windows.WindowManager)
        size = manager.max_window_size
        assert manager.current_window_size == size
        # The session adds to `_bytes_processed` itself below half the window, which is only
        # right while `process_bytes` emits nothing before that point.
        manager.window_consumed(size // 2 - 1)
        assert not manager.process_bytes(size // 2 - 1)
        assert manager._bytes_processed == size // 2 - 1
        manager.window_consumed(1)
        manager._bytes_processed += 1
        assert manager._maybe_update_window() == size // 2
        assert manager.current_window_size == size


def _outcome(check: object, headers: list[tuple[bytes, bytes]]) -> object:
    try:
        return list(check(headers, None))  # type: ignore[operator]
    except h2.exceptions.ProtocolError as e:
        return str(e)


@settings(max_examples=400, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.binary(max_size=12) | st.sampled_from([b":method", b"baggage", b"Forwarded", b"a:b"]),
            st.binary(max_size=24) | st.sampled_from([b"CONNECT", b" x", b"x\t", b"a\r\nb", b""]),
        ),
        max_size=4,
    )
)
def test_header_character_check_is_h2s(headers: list[tuple[bytes, bytes]]) -> None:
    """The regular-expression check installed in h2 accepts and refuses exactly what h2's own does,
    with the same error."""
    from hbone import h2conn

    assert h2.utilities._reject_illegal_characters is h2conn._reject_illegal_characters
    assert _outcome(h2conn._reject_illegal_characters, headers) == _outcome(
        h2conn.H2_REJECT_ILLEGAL_CHARACTERS, headers
    )
