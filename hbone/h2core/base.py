"""The state of one HTTP/2 connection and what our side sends (see `hbone.h2core.connection`)."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

from hpack import Decoder
from hyperframe.frame import (
    Frame,
    GoAwayFrame,
    PingFrame,
    RstStreamFrame,
    SettingsFrame,
)

from hbone.h2core.codes import ErrorCode, H2ConnectionError, H2UsageError, SettingCode
from hbone.h2core.events import Event, StreamReset
from hbone.hpack import StaticEncoder

if TYPE_CHECKING:
    from hbone.settings import H2Settings

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DEFAULT_WINDOW = 65535
DEFAULT_FRAME_SIZE = 16384
MAX_WINDOW = 2**31 - 1
# DATA payloads from this size on are queued as they are (a separate buffer for `writelines`).
LARGE_DATA = 16 * 1024
# Closed streams remembered, to judge frames still in flight on them (RFC 9113 §5.1 "closed").
MAX_CLOSED_STREAMS = 4096

FRAME_HEADER = struct.Struct(">HBBBL")  # length (24 bits as 16+8), type, flags, stream id
_WINDOW_UPDATE = struct.Struct(">HBBBLL")  # a frame header, then the increment
TYPE_DATA = 0x0
TYPE_HEADERS = 0x1
TYPE_PRIORITY = 0x2
TYPE_RST_STREAM = 0x3
TYPE_SETTINGS = 0x4
TYPE_PUSH_PROMISE = 0x5
TYPE_PING = 0x6
TYPE_GOAWAY = 0x7
TYPE_WINDOW_UPDATE = 0x8
TYPE_CONTINUATION = 0x9
FLAG_END_STREAM = 0x1
FLAG_ACK = 0x1
FLAG_END_HEADERS = 0x4
FLAG_PADDED = 0x8
FLAG_PRIORITY = 0x20

# How a closed stream ended, as remembered.
CLOSED_BY_US = 1  # we sent RST_STREAM (or it was refused by GOAWAY): the peer's late frames are ignored
CLOSED_BY_PEER = 2  # the peer's RST_STREAM
CLOSED_ENDED = 3  # END_STREAM both ways
CLOSED_UNKNOWN = 4  # below the highest id, not remembered (forgotten, or skipped by the peer)


class Stream:
    """One open stream (open or half-closed, RFC 9113 §5.1)."""

    __slots__ = (
        "expected_length",
        "headers_received",
        "local_ended",
        "received_length",
        "recv_window",
        "remote_ended",
        "responded",
        "send_window",
        "stream_id",
        "unacked",
    )

    def __init__(self, stream_id: int, send_window: int, recv_window: int) -> None:
        self.stream_id = stream_id
        self.send_window = send_window
        self.recv_window = recv_window  # what the peer may still send
        self.unacked = 0  # consumed, not yet given back with WINDOW_UPDATE
        self.local_ended = False
        self.remote_ended = False
        self.headers_received = False  # client side: the final response arrived
        self.responded = False  # server side: our response HEADERS went out
        self.expected_length: int | None = None  # content-length, when the peer gave one
        self.received_length = 0


class CoreBase:
    """Connection state, the output buffer and every command of our side."""

    def __init__(self, *, client_side: bool, settings: H2Settings, now: float) -> None:
        self.client_side = client_side
        self.settings = settings
        self.streams: dict[int, Stream] = {}
        self._closed: dict[int, int] = {}  # stream id -> CLOSED_*, the last MAX_CLOSED_STREAMS
        self.open_inbound = 0
        self.open_outbound = 0
        self.highest_inbound_stream_id = 0
        self._next_outbound = 1 if client_side else 2
        # Our values (applied at once: a peer keeps within the defaults until it has seen them).
        self._local_window = settings.stream_window
        self._local_max_frame = settings.frame_size
        self._local_max_streams = settings.max_concurrent_streams if not client_side else 2**31
        self._decoder = Decoder(
            settings.client_max_header_list if client_side else settings.server_max_header_list
        )
        self._encoder = StaticEncoder()
        # The peer's values, as its SETTINGS say.
        self.peer_window = DEFAULT_WINDOW
        self.peer_max_frame = DEFAULT_FRAME_SIZE
        self.peer_max_streams = 2**31
        self.peer_settings_received = False
        self.settings_acked = False
        # Connection flow control.
        self.send_window = DEFAULT_WINDOW
        self.recv_window = DEFAULT_WINDOW
        self._recv_window_size = DEFAULT_WINDOW  # what the window is raised back to
        self._unacked = 0
        # GOAWAY: the last stream id each way, once sent / received.
        self.goaway_sent: int | None = None
        self.goaway_received: int | None = None
        self.terminated = False  # a connection error: no more input is taken
        # Output: small frames accumulate in `_out`; large DATA payloads are queued by reference.
        self._out = bytearray()
        self._chunks: list[bytes | bytearray | memoryview] = []
        self._events: list[Event] = []
        # Abuse accounting.
        self._now = now
        self._resets = 0  # streams reset before their answer, and resets provoked, this window
        self._reset_window_start = now
        self._write_blocked = False
        self._blocked_output = 0  # bytes our replies queued while the peer does not read
        # The replies to what was read while the peer does not read passed `paused_output_limit`:
        # read no more until the output drains (a PING or SETTINGS flood stalls, our buffer does not grow).
        self.reading_should_pause = False
        self._preface_deadline: float | None = None  # set by `initiate`

    # -- output ----------------------------------------------------------------------------------

    def take_output(self) -> list[bytes | bytearray | memoryview]:
        """What to send, in order (write it with `writelines`); empty when there is nothing."""
        chunks = self._chunks
        if not chunks and not self._out:
            return []
        if self._out:
            chunks.append(self._out)
            self._out = bytearray()
        self._chunks = []
        return chunks

    def has_output(self) -> bool:
        return bool(self._out or self._chunks)

    def _frame(self, frame: Frame) -> None:
        self._out += frame.serialize()

    def _reply(self, frame: Frame) -> None:
        """A frame the peer's frames make us send: bounded while the peer does not read."""
        data = frame.serialize()
        self._out += data
        if self._write_blocked:
            self._blocked_output += len(data)
            if self._blocked_output > self.settings.paused_output_limit:
                self.reading_should_pause = True

    def set_write_blocked(self, blocked: bool) -> None:
        """The transport is over its high-water mark (True) or drained (False)."""
        self._write_blocked = blocked
        self._blocked_output = 0
        self.reading_should_pause = False

    # -- commands ----------------------------------------------------------------------------------

    def initiate(self, local: dict[SettingCode, int], now: float) -> None:
        """Our preface: the magic (client), SETTINGS, and a WINDOW_UPDATE to the connection window.
        The peer's preface, and its ACK of our SETTINGS, are due within `handshake_timeout` of `now`."""
        if not (self.peer_settings_received and self.settings_acked):
            self._preface_deadline = now + self.settings.handshake_timeout
        if self.client_side:
            self._out += PREFACE
        self._frame(SettingsFrame(0, settings={int(k): v for k, v in local.items()}))
        window = self.settings.connection_window
        if window > DEFAULT_WINDOW:
            self._window_update(0, window - DEFAULT_WINDOW)
            self.recv_window = self._recv_window_size = window

    def open_stream(self, headers: Sequence[tuple[str, str]], end_stream: bool = False) -> int:
        """Send a request's HEADERS on a new stream; returns its id."""
        if self.terminated or self.goaway_received is not None or self.goaway_sent is not None:
            raise H2UsageError("the connection takes no new streams (GOAWAY)")
        if self.open_outbound >= self.peer_max_streams:
            raise H2UsageError(f"the peer allows {self.peer_max_streams} concurrent streams")
        sid = self._next_outbound
        if sid > MAX_WINDOW:
            raise H2UsageError("stream ids exhausted")
        block = self._encoder.encode(headers)  # raises HeaderFieldError before any state changes
        self._next_outbound = sid + 2
        stream = Stream(sid, self.peer_window, self._local_window)
        self.streams[sid] = stream
        self.open_outbound += 1
        self._send_block(sid, block, end_stream)
        if end_stream:
            stream.local_ended = True
        return sid

    def send_headers(self, stream_id: int, headers: Sequence[tuple[str, str]], end_stream: bool) -> bool:
        """Our response (server side); False when the stream cannot take it (reset, ended)."""
        stream = self.streams.get(stream_id)
        if stream is None or stream.local_ended or self.terminated:
            return False
        block = self._encoder.encode(headers)
        stream.responded = True
        self._send_block(stream_id, block, end_stream)
        if end_stream:
            self._local_end(stream)
        return True

    def _send_block(self, sid: int, block: bytes, end_stream: bool) -> None:
        """HEADERS, and CONTINUATIONs for what does not fit the peer's frame size."""
        size = self.peer_max_frame
        n = len(block)
        flags = FLAG_END_STREAM if end_stream else 0
        out = self._out
        if n <= size:
            out += FRAME_HEADER.pack(n >> 8, n & 0xFF, TYPE_HEADERS, flags | FLAG_END_HEADERS, sid)
            out += block
            return
        out += FRAME_HEADER.pack(size >> 8, size & 0xFF, TYPE_HEADERS, flags, sid)
        out += block[:size]
        for at in range(size, n, size):
            piece = block[at : at + size]
            k = len(piece)
            last = FLAG_END_HEADERS if at + size >= n else 0
            out += FRAME_HEADER.pack(k >> 8, k & 0xFF, TYPE_CONTINUATION, last, sid)
            out += piece

    def send_window_of(self, stream_id: int) -> int:
        stream = self.streams.get(stream_id)
        if stream is None or stream.local_ended:
            return 0
        return max(0, min(self.send_window, stream.send_window))

    def send_data(self, stream_id: int, data: bytes | memoryview) -> int:
        """Frame as much of `data` as both send windows allow; returns how many bytes were taken.

        `data` must not change afterwards: payloads from LARGE_DATA on are queued by reference.
        """
        stream = self.streams.get(stream_id)
        if stream is None or stream.local_ended or self.terminated:
            return 0
        total = len(data)
        n = min(self.send_window, stream.send_window, total)
        if n <= 0:
            return 0
        max_frame = self.peer_max_frame
        if n == total and n <= max_frame:
            self._data_frame(stream_id, data)
        else:
            view = memoryview(data)
            for at in range(0, n, max_frame):
                self._data_frame(stream_id, view[at : min(at + max_frame, n)])
        self.send_window -= n
        stream.send_window -= n
        return n

    def _data_frame(self, sid: int, data: bytes | memoryview) -> None:
        n = len(data)
        out = self._out
        out += FRAME_HEADER.pack(n >> 8, n & 0xFF, TYPE_DATA, 0, sid)
        if n >= LARGE_DATA:
            self._chunks.append(out)
            self._chunks.append(data)
            self._out = bytearray()
        else:
            out += data

    def end_stream(self, stream_id: int) -> bool:
        """END_STREAM (an empty DATA frame); False when the stream cannot send any more."""
        stream = self.streams.get(stream_id)
        if stream is None or stream.local_ended or self.terminated:
            return False
        self._out += FRAME_HEADER.pack(0, 0, TYPE_DATA, FLAG_END_STREAM, stream_id)
        self._local_end(stream)
        return True

    def reset_stream(self, stream_id: int, error_code: int) -> bool:
        """RST_STREAM; the stream is closed at once, the peer's frames in flight on it ignored."""
        stream = self.streams.get(stream_id)
        if stream is None or self.terminated:
            return False
        self._frame(RstStreamFrame(stream_id, error_code=int(error_code)))
        self._close(stream, CLOSED_BY_US)
        return True

    def ping(self, opaque: bytes) -> None:
        if not self.terminated:
            self._frame(PingFrame(0, opaque_data=opaque))

    def goaway(self, error_code: int = ErrorCode.NO_ERROR, debug: bytes = b"") -> None:
        """GOAWAY naming the last stream of the peer's we process; later ones are refused."""
        if self.terminated:
            return
        last = self.highest_inbound_stream_id
        if self.goaway_sent is None or last < self.goaway_sent:
            self.goaway_sent = last
        self._frame(
            GoAwayFrame(0, last_stream_id=self.goaway_sent, error_code=int(error_code), additional_data=debug)
        )

    def ack(self, stream_id: int, n: int) -> None:
        """`n` flow-controlled bytes of the stream were consumed: give them back to the peer, once
        half a window is consumed (or a window is spent), summed."""
        if not n or self.terminated:
            return
        stream = self.streams.get(stream_id)
        if stream is not None and not stream.remote_ended:
            unacked = stream.unacked + n
            window = stream.recv_window
            if unacked >= self._local_window >> 1 or not window:
                stream.recv_window = window + unacked
                stream.unacked = 0
                self._window_update(stream_id, unacked)
            else:
                stream.unacked = unacked
        self._ack_connection(n)

    def _ack_connection(self, n: int) -> None:
        unacked = self._unacked + n
        if unacked >= self._recv_window_size >> 1 or not self.recv_window:
            self.recv_window += unacked
            self._unacked = 0
            self._window_update(0, unacked)
        else:
            self._unacked = unacked

    def _window_update(self, sid: int, increment: int) -> None:
        self._out += _WINDOW_UPDATE.pack(0, 4, TYPE_WINDOW_UPDATE, 0, sid, increment)

    # -- stream life -------------------------------------------------------------------------------

    def _local_end(self, stream: Stream) -> None:
        stream.local_ended = True
        if stream.remote_ended:
            self._close(stream, CLOSED_ENDED)

    def _close(self, stream: Stream, how: int) -> None:
        sid = stream.stream_id
        if self.streams.pop(sid, None) is None:
            return
        if (sid & 1) == self.client_side:  # odd ids are the client's
            self.open_outbound -= 1
        else:
            self.open_inbound -= 1
        closed = self._closed
        closed[sid] = how
        if len(closed) > MAX_CLOSED_STREAMS:
            del closed[next(iter(closed))]

    def _stream_error(self, stream_id: int, code: ErrorCode) -> None:
        """RST_STREAM(`code`) for the peer's fault on one stream; counted towards rapid reset."""
        self._reply(RstStreamFrame(stream_id, error_code=int(code)))
        stream = self.streams.get(stream_id)
        if stream is not None:
            self._close(stream, CLOSED_BY_US)
            self._events.append(StreamReset(stream_id, int(code), False))
        elif stream_id not in self._closed:
            self._closed[stream_id] = CLOSED_BY_US
        self._count_resets(1)

    def _count_resets(self, n: int) -> None:
        settings = self.settings
        if self._now - self._reset_window_start >= settings.reset_window:
            self._reset_window_start = self._now
            self._resets = 0
        self._resets += n
        if self._resets > settings.max_resets:
            raise LimitBroken(
                ErrorCode.ENHANCE_YOUR_CALM,
                f"too many stream resets (rapid reset): {self._resets} within {settings.reset_window:g}s",
            )


class LimitBroken(H2ConnectionError):
    """The peer broke one of our abuse limits (`hbone.settings.H2Settings`)."""
