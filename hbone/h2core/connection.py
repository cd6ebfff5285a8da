"""A sans-IO HTTP/2 connection for HBONE's subset of RFC 9113: `H2Core`.

It takes the bytes received and the current time and returns events (`hbone.h2core.events`);
what to send accumulates as bytes, taken with `take_output()`. It never reads a clock, owns no
socket and starts no timer: `deadline()` says when `timer(now)` wants to be called.

The subset: the preface and SETTINGS (with ACK, and the peer's limits honoured), requests and
responses (CONNECT above all), DATA with connection and stream flow control, WINDOW_UPDATE,
RST_STREAM, PING, GOAWAY with last-stream-id semantics both ways (streams at or below it finish),
header blocks over CONTINUATION frames, padding; PRIORITY, unknown frame types and unknown settings
are ignored; no server push. Every protocol error is the connection or stream error RFC 9113 names.

Frames are walked here by their 9-byte headers as the bytes arrive: a DATA payload goes to its
stream piece by piece, as it arrives, without reassembly (it is checked and charged to both
receive windows at its header); every other frame is buffered whole (bounded by our maximum frame
size) and parsed with `hyperframe`, but for HEADERS; header blocks are decoded with `hpack`.
DATA, HEADERS, CONTINUATION and WINDOW_UPDATE frames are serialised by hand, every other frame by
`hyperframe`: those four are what every stream costs (a new stream is two HEADERS, and
`hyperframe` spends more on building and parsing a frame object than the rest of its handling),
and their layouts are fixed and short.

Abuse limits (`hbone.settings.H2Settings`), as functions of the frames and of the time given:
a frame larger than our maximum frame size, and a header block larger than `max_header_block` or
made of more than `max_continuations` CONTINUATIONs, are refused at their frame header, before
their bytes are buffered or decoded; streams the peer resets before we answered them, plus the
resets its frames provoke, are counted per `reset_window` (rapid reset); a new stream past our
MAX_CONCURRENT_STREAMS is refused alone (REFUSED_STREAM); replies to the peer's frames while it
does not read are bounded (`reading_should_pause`); a peer that does not complete its preface (or
acknowledge ours) within `handshake_timeout` is cut (SETTINGS_TIMEOUT).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hpack import HPACKError, OversizedHeaderListError
from hyperframe.exceptions import HyperframeError, InvalidDataError, InvalidPaddingError
from hyperframe.frame import (
    DataFrame,
    Frame,
    GoAwayFrame,
    PingFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

from hbone.h2core import fields
from hbone.h2core.base import (
    CLOSED_BY_PEER,
    CLOSED_BY_US,
    CLOSED_ENDED,
    CLOSED_UNKNOWN,
    FLAG_END_HEADERS,
    FLAG_END_STREAM,
    FLAG_PADDED,
    FLAG_PRIORITY,
    FRAME_HEADER,
    MAX_WINDOW,
    PREFACE,
    TYPE_CONTINUATION,
    TYPE_DATA,
    TYPE_GOAWAY,
    TYPE_HEADERS,
    TYPE_PING,
    TYPE_PRIORITY,
    TYPE_PUSH_PROMISE,
    TYPE_RST_STREAM,
    TYPE_SETTINGS,
    TYPE_WINDOW_UPDATE,
    CoreBase,
    LimitBroken,
    Stream,
)
from hbone.h2core.codes import ErrorCode, H2ConnectionError, H2StreamError, SettingCode
from hbone.h2core.events import (
    ConnectionTerminated,
    DataReceived,
    Event,
    GoAwayReceived,
    PingAcked,
    RequestReceived,
    ResponseReceived,
    SettingsAcked,
    SettingsReceived,
    StreamEnded,
    StreamReset,
    TrailersReceived,
    WindowUpdated,
)

if TYPE_CHECKING:
    from hbone.settings import H2Settings

_KNOWN_TYPES = frozenset(range(10))


def _conn_error(code: ErrorCode, message: str) -> H2ConnectionError:
    return H2ConnectionError(code, message)


class H2Core(CoreBase):
    """One HTTP/2 connection, client or server side, without I/O. Call `initiate` first."""

    def __init__(self, *, client_side: bool, settings: H2Settings, now: float) -> None:
        super().__init__(client_side=client_side, settings=settings, now=now)
        self._preface_left = 0 if client_side else len(PREFACE)
        self._head = bytearray()  # a frame header split across reads
        self._ftype = self._fflags = self._fsid = 0  # the frame being buffered
        self._fbody = bytearray()
        self._fleft = 0  # its bytes still to come
        self._skip = False  # an unknown frame type: its bytes are dropped
        self._data_left = 0  # payload bytes of the current DATA frame still to come
        self._data_sid = 0  # where they go (0: dropped, their connection window given back)
        self._data_end = False
        # A header block being received: its stream, fragments, END_STREAM, size and CONTINUATIONs.
        self._block_sid = 0
        self._block: list[bytes] = []
        self._block_end_stream = False
        self._block_self_dependent = False
        self._block_size = 0
        self._continuations = 0

    # -- input -------------------------------------------------------------------------------------

    def receive(self, data: bytes | bytearray | memoryview, now: float) -> list[Event]:
        """Take received bytes (any split); returns what they meant. Nothing once terminated."""
        events: list[Event] = []
        if self.terminated:
            return events
        self._events = events
        self._now = now
        try:
            self._walk(memoryview(data))
        except H2ConnectionError as e:
            self._terminate(e)
        self._events = []
        return events

    def _terminate(self, e: H2ConnectionError) -> None:
        self._frame(
            GoAwayFrame(
                0,
                last_stream_id=self.highest_inbound_stream_id,
                error_code=int(e.code),
                additional_data=str(e).encode()[:256],
            )
        )
        self.terminated = True
        self._events.append(ConnectionTerminated(int(e.code), str(e), isinstance(e, LimitBroken)))

    def deadline(self) -> float | None:
        """When `timer` must be called next (the preface's deadline), or None."""
        return self._preface_deadline

    def timer(self, now: float) -> list[Event]:
        events: list[Event] = []
        deadline = self._preface_deadline
        if self.terminated or deadline is None or now < deadline:
            return events
        self._events = events
        self._preface_deadline = None
        what = "SETTINGS" if not self.peer_settings_received else "ACK of our SETTINGS"
        self._terminate(
            LimitBroken(
                ErrorCode.SETTINGS_TIMEOUT,
                f"no {what} from the peer within {self.settings.handshake_timeout:g}s",
            )
        )
        self._events = []
        return events

    def _walk(self, data: memoryview) -> None:
        n = len(data)
        pos = 0
        events = self._events
        while pos < n:
            if self._data_left:
                take = min(self._data_left, n - pos)
                self._data_left -= take
                sid = self._data_sid
                if sid:
                    events.append(DataReceived(sid, data[pos : pos + take].tobytes(), take))
                else:
                    self._ack_connection(take)
                pos += take
                if not self._data_left and self._data_end and sid:
                    self._remote_end(sid)
                continue
            if self._fleft:
                take = min(self._fleft, n - pos)
                if not self._skip:
                    self._fbody += data[pos : pos + take]
                pos += take
                self._fleft -= take
                if not self._fleft:
                    self._complete()
                continue
            if self._preface_left:
                take = min(self._preface_left, n - pos)
                at = len(PREFACE) - self._preface_left
                if data[pos : pos + take] != PREFACE[at : at + take]:
                    raise _conn_error(ErrorCode.PROTOCOL_ERROR, "invalid connection preface")
                pos += take
                self._preface_left -= take
                continue
            head = self._head
            if head or n - pos < 9:
                take = min(9 - len(head), n - pos)
                head += data[pos : pos + take]
                pos += take
                if len(head) < 9:
                    return
                fields_ = FRAME_HEADER.unpack(head)
                head.clear()
            else:
                fields_ = FRAME_HEADER.unpack_from(data, pos)
                pos += 9
            hi, lo, ftype, flags, sid = fields_
            self._frame_header((hi << 8) | lo, ftype, flags, sid & 0x7FFFFFFF)

    def _frame_header(self, length: int, ftype: int, flags: int, sid: int) -> None:
        """Judge a frame by its header; DATA is charged and routed here, other frames buffered."""
        if length > self._local_max_frame:
            raise LimitBroken(
                ErrorCode.FRAME_SIZE_ERROR,
                f"frame of {length} bytes, more than the maximum frame size {self._local_max_frame}",
            )
        if not self.peer_settings_received and (ftype != TYPE_SETTINGS or flags & 1):
            raise _conn_error(ErrorCode.PROTOCOL_ERROR, "the preface's first frame is not SETTINGS")
        if self._block_sid:
            if ftype != TYPE_CONTINUATION or sid != self._block_sid:
                raise _conn_error(ErrorCode.PROTOCOL_ERROR, "a header block interrupted")
            self._continuations += 1
            self._block_size += length
            self._check_block()
        elif ftype == TYPE_HEADERS:
            self._block_size = length
            self._continuations = 0
            self._check_block()
        elif ftype == TYPE_CONTINUATION:
            raise _conn_error(ErrorCode.PROTOCOL_ERROR, "CONTINUATION without a header block")
        if ftype == TYPE_DATA and not flags & FLAG_PADDED:
            self._begin_data(sid, length, flags & FLAG_END_STREAM)
            return
        self._ftype, self._fflags, self._fsid = ftype, flags, sid
        self._skip = ftype not in _KNOWN_TYPES
        self._fbody = bytearray()
        self._fleft = length
        if not length:
            self._complete()

    def _check_block(self) -> None:
        settings = self.settings
        if self._continuations > settings.max_continuations:
            raise LimitBroken(
                ErrorCode.ENHANCE_YOUR_CALM,
                f"header block of more than {settings.max_continuations} CONTINUATION frames",
            )
        if self._block_size > settings.max_header_block:
            raise LimitBroken(
                ErrorCode.ENHANCE_YOUR_CALM, f"header block of more than {settings.max_header_block} bytes"
            )

    # -- DATA ----------------------------------------------------------------------------------------

    def _begin_data(self, sid: int, length: int, end: int) -> None:
        """Charge a DATA frame to the windows and decide where its payload goes."""
        self._data_sid = self._data_target(sid, length, bool(end))
        self._data_end = bool(end)
        self._data_left = length
        if not length:
            if self._data_sid and end:
                self._remote_end(self._data_sid)
            self._data_sid = 0

    def _data_target(self, sid: int, length: int, end: bool) -> int:
        if sid == 0:
            raise _conn_error(ErrorCode.PROTOCOL_ERROR, "DATA on stream 0")
        if length > self.recv_window:
            raise _conn_error(ErrorCode.FLOW_CONTROL_ERROR, "DATA beyond the connection window")
        self.recv_window -= length
        stream = self.streams.get(sid)
        if stream is None:
            how = self._closed_how(sid, TYPE_DATA)
            if how != CLOSED_BY_US:
                self._stream_error(sid, ErrorCode.STREAM_CLOSED)
            return 0
        code: ErrorCode | None = None
        if stream.remote_ended:
            code = ErrorCode.STREAM_CLOSED
        elif length > stream.recv_window:
            code = ErrorCode.FLOW_CONTROL_ERROR
        elif self.client_side and not stream.headers_received:
            code = ErrorCode.PROTOCOL_ERROR  # DATA before the response
        else:
            stream.recv_window -= length
            expected = stream.expected_length
            if expected is not None:
                stream.received_length += length  # padding included: checked against 0 below
                if stream.received_length > expected or (end and stream.received_length < expected):
                    code = ErrorCode.PROTOCOL_ERROR
        if code is not None:
            self._stream_error(sid, code)
            return 0
        return sid

    def _closed_how(self, sid: int, ftype: int) -> int:
        """How a stream not open any more ended; raises for a stream never opened (idle)."""
        how = self._closed.get(sid)
        if how is not None:
            return how
        if (sid & 1) == self.client_side:  # ours
            if sid < self._next_outbound:
                return CLOSED_UNKNOWN
        elif sid <= self.highest_inbound_stream_id:
            return CLOSED_UNKNOWN
        raise _conn_error(ErrorCode.PROTOCOL_ERROR, f"frame type {ftype} on idle stream {sid}")

    def _remote_end(self, sid: int) -> None:
        stream = self.streams.get(sid)
        if stream is None:
            return
        stream.remote_ended = True
        self._events.append(StreamEnded(sid))
        if stream.local_ended:
            self._close(stream, CLOSED_ENDED)

    # -- buffered frames -----------------------------------------------------------------------------

    def _complete(self) -> None:
        try:
            self._frame_complete()
        except H2StreamError as e:
            self._stream_error(e.stream_id, e.code)

    def _frame_complete(self) -> None:
        ftype, flags, sid = self._ftype, self._fflags, self._fsid
        body = memoryview(self._fbody)
        self._fbody = bytearray()
        if self._skip:
            return  # an extension frame (RFC 9113 §5.5)
        if ftype == TYPE_CONTINUATION:
            self._block.append(bytes(body))
            if flags & FLAG_END_HEADERS:
                self._block_done()
            return
        if ftype == TYPE_PRIORITY:
            if not sid:
                raise _conn_error(ErrorCode.PROTOCOL_ERROR, "PRIORITY on stream 0")
            if len(body) != 5:
                raise H2StreamError(sid, ErrorCode.FRAME_SIZE_ERROR, "PRIORITY of other than 5 bytes")
            return  # priorities are not used
        if ftype == TYPE_PUSH_PROMISE:
            raise _conn_error(ErrorCode.PROTOCOL_ERROR, "PUSH_PROMISE: push is not enabled")
        if ftype == TYPE_HEADERS:
            self._on_headers(sid, flags, body)
            return
        frame = self._parse(ftype, flags, sid, body)
        if ftype == TYPE_DATA:
            self._on_padded_data(frame)  # type: ignore[arg-type]
        elif ftype == TYPE_WINDOW_UPDATE:
            self._on_window_update(frame)  # type: ignore[arg-type]
        elif ftype == TYPE_RST_STREAM:
            self._on_rst(frame)  # type: ignore[arg-type]
        elif ftype == TYPE_SETTINGS:
            self._on_settings(frame)  # type: ignore[arg-type]
        elif ftype == TYPE_PING:
            self._on_ping(frame)  # type: ignore[arg-type]
        elif ftype == TYPE_GOAWAY:
            self._on_goaway(frame)  # type: ignore[arg-type]

    def _parse(self, ftype: int, flags: int, sid: int, body: memoryview) -> Frame:
        n = len(body)
        if (
            (ftype == TYPE_PING and n != 8)
            or (ftype in (TYPE_RST_STREAM, TYPE_WINDOW_UPDATE) and n != 4)
            or (ftype == TYPE_SETTINGS and (n % 6 or (flags & 1 and n)))
            or (ftype == TYPE_GOAWAY and n < 8)
        ):
            raise _conn_error(ErrorCode.FRAME_SIZE_ERROR, f"frame type {ftype} of {n} bytes")
        if ftype == TYPE_WINDOW_UPDATE and not int.from_bytes(body, "big") & MAX_WINDOW:
            if sid:  # a zero increment: a stream error on a stream, else a connection error
                raise H2StreamError(sid, ErrorCode.PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            raise _conn_error(ErrorCode.PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
        try:
            frame, _ = Frame.parse_frame_header(
                memoryview(FRAME_HEADER.pack(n >> 8, n & 0xFF, ftype, flags, sid))
            )
            frame.parse_body(body)
        except (InvalidPaddingError, InvalidDataError) as e:
            raise _conn_error(ErrorCode.PROTOCOL_ERROR, f"invalid frame: {e}") from None
        except HyperframeError as e:
            raise _conn_error(ErrorCode.FRAME_SIZE_ERROR, f"invalid frame: {e}") from None
        return frame

    # -- header blocks -------------------------------------------------------------------------------

    def _on_headers(self, sid: int, flags: int, body: memoryview) -> None:
        """HEADERS (RFC 9113 §6.2), read here: one per stream each way, the cost of a new stream."""
        if not sid:
            raise _conn_error(ErrorCode.PROTOCOL_ERROR, "HEADERS on stream 0")
        start, end, pad = 0, len(body), 0
        if flags & FLAG_PADDED:
            if not end:
                raise _conn_error(ErrorCode.FRAME_SIZE_ERROR, "padded HEADERS without its pad length")
            pad = body[0]
            start = 1
        self._block_self_dependent = False
        if flags & FLAG_PRIORITY:
            if end - start < 5:
                raise _conn_error(ErrorCode.FRAME_SIZE_ERROR, "HEADERS too short for its priority")
            depends_on = int.from_bytes(body[start : start + 4], "big") & MAX_WINDOW
            self._block_self_dependent = depends_on == sid
            start += 5
        if pad > end - start:
            raise _conn_error(ErrorCode.PROTOCOL_ERROR, "HEADERS padding longer than its payload")
        self._block_end_stream = bool(flags & FLAG_END_STREAM)
        self._block = [bytes(body[start : end - pad])]
        if flags & FLAG_END_HEADERS:
            self._block_done_for(sid)
        else:
            self._block_sid = sid

    def _block_done(self) -> None:
        sid, self._block_sid = self._block_sid, 0
        self._block_done_for(sid)

    def _decode(self, block: bytes) -> list[tuple[bytes, bytes]]:
        try:
            return list(self._decoder.decode(block, raw=True))  # type: ignore[arg-type]
        except OversizedHeaderListError as e:
            raise LimitBroken(ErrorCode.ENHANCE_YOUR_CALM, f"header list too large: {e}") from None
        except (HPACKError, IndexError, ValueError) as e:
            raise _conn_error(ErrorCode.COMPRESSION_ERROR, f"header block not decodable: {e}") from None

    def _block_done_for(self, sid: int) -> None:
        block = self._block[0] if len(self._block) == 1 else b"".join(self._block)
        self._block = []
        end = self._block_end_stream
        raw = self._decode(block)  # first: every block updates the HPACK state, even one refused
        stream = self.streams.get(sid)
        if self._block_self_dependent:
            self.highest_inbound_stream_id = max(self.highest_inbound_stream_id, sid)
            raise H2StreamError(sid, ErrorCode.PROTOCOL_ERROR, "a stream depending on itself")
        if stream is not None:
            self._headers_on_stream(stream, raw, end)
        elif (sid & 1) != self.client_side and sid > self.highest_inbound_stream_id:
            self._new_stream(sid, raw, end)
        else:
            how = self._closed_how(sid, TYPE_HEADERS)
            if how == CLOSED_BY_US:
                return  # in flight when we reset it
            if how == CLOSED_BY_PEER:
                raise H2StreamError(sid, ErrorCode.STREAM_CLOSED, "HEADERS on a reset stream")
            if how == CLOSED_UNKNOWN:  # a new stream must have a higher id than every earlier one
                raise _conn_error(ErrorCode.PROTOCOL_ERROR, f"HEADERS on stream {sid}, below the last")
            raise _conn_error(ErrorCode.STREAM_CLOSED, f"HEADERS on closed stream {sid}")

    def _new_stream(self, sid: int, raw: list[tuple[bytes, bytes]], end: bool) -> None:
        if self.client_side:
            raise _conn_error(ErrorCode.PROTOCOL_ERROR, "the server opened a stream")
        self.highest_inbound_stream_id = sid
        goaway = self.goaway_sent
        if (goaway is not None and sid > goaway) or self.open_inbound >= self._local_max_streams:
            # Past our MAX_CONCURRENT_STREAMS, or after our GOAWAY: this stream alone (§5.1.2).
            raise H2StreamError(sid, ErrorCode.REFUSED_STREAM, "stream refused")
        headers, length = fields.check_request(sid, raw)
        stream = Stream(sid, self.peer_window, self._local_window)
        stream.expected_length = length
        self.streams[sid] = stream
        self.open_inbound += 1
        self._events.append(RequestReceived(sid, headers, end))
        if end:
            if length:
                raise H2StreamError(sid, ErrorCode.PROTOCOL_ERROR, "content-length without a body")
            self._remote_end(sid)

    def _headers_on_stream(self, stream: Stream, raw: list[tuple[bytes, bytes]], end: bool) -> None:
        sid = stream.stream_id
        if stream.remote_ended:
            raise H2StreamError(sid, ErrorCode.STREAM_CLOSED, "HEADERS after END_STREAM")
        if self.client_side and not stream.headers_received:
            headers, status, length = fields.check_response(sid, raw)
            if status < 200:
                if end:
                    raise H2StreamError(sid, ErrorCode.PROTOCOL_ERROR, "an informational response ends")
                return  # 1xx: informational
            stream.headers_received = True
            stream.expected_length = length
            self._events.append(ResponseReceived(sid, headers, end))
        else:
            trailers = fields.check_trailers(sid, raw)
            if not end:
                raise H2StreamError(sid, ErrorCode.PROTOCOL_ERROR, "trailers without END_STREAM")
            self._events.append(TrailersReceived(sid, trailers))
        if end:
            expected = stream.expected_length
            if expected is not None and expected != stream.received_length:
                raise H2StreamError(sid, ErrorCode.PROTOCOL_ERROR, "content-length mismatch")
            self._remote_end(sid)

    # -- other frames ----------------------------------------------------------------------------------

    def _on_padded_data(self, frame: DataFrame) -> None:
        sid = frame.stream_id
        end = "END_STREAM" in frame.flags
        length = frame.body_len
        target = self._data_target(sid, length, end)
        if not target:
            self._ack_connection(length)
            return
        self._events.append(DataReceived(sid, bytes(frame.data), length))
        if end:
            self._remote_end(sid)

    def _on_window_update(self, frame: WindowUpdateFrame) -> None:
        sid = frame.stream_id
        increment = frame.window_increment
        if not sid:
            self.send_window += increment
            if self.send_window > MAX_WINDOW:
                raise _conn_error(ErrorCode.FLOW_CONTROL_ERROR, "connection window beyond 2^31-1")
            self._events.append(WindowUpdated(0))
            return
        stream = self.streams.get(sid)
        if stream is None:
            self._closed_how(sid, TYPE_WINDOW_UPDATE)  # idle: a connection error
            return  # closed: in flight, ignored
        stream.send_window += increment
        if stream.send_window > MAX_WINDOW:
            raise H2StreamError(sid, ErrorCode.FLOW_CONTROL_ERROR, "stream window beyond 2^31-1")
        if not stream.local_ended:
            self._events.append(WindowUpdated(sid))

    def _on_rst(self, frame: RstStreamFrame) -> None:
        sid = frame.stream_id
        stream = self.streams.get(sid)
        if stream is None:
            self._closed_how(sid, TYPE_RST_STREAM)
            return
        self._close(stream, CLOSED_BY_PEER)
        self._events.append(StreamReset(sid, frame.error_code, True))
        if not self.client_side and not stream.responded:
            self._count_resets(1)  # work started for nothing: what rapid reset exploits

    def _on_settings(self, frame: SettingsFrame) -> None:
        if "ACK" in frame.flags:
            if not self.settings_acked:
                self.settings_acked = True
                if self.peer_settings_received:
                    self._preface_deadline = None
            self._events.append(SettingsAcked())
            return
        changed: dict[int, int] = {}
        for code, value in frame.settings.items():
            changed[code] = value
            if code == SettingCode.INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise _conn_error(ErrorCode.FLOW_CONTROL_ERROR, "INITIAL_WINDOW_SIZE beyond 2^31-1")
                delta = value - self.peer_window
                self.peer_window = value
                for stream in self.streams.values():
                    stream.send_window += delta
                    if stream.send_window > MAX_WINDOW:
                        raise _conn_error(ErrorCode.FLOW_CONTROL_ERROR, "a stream window beyond 2^31-1")
            elif code == SettingCode.MAX_FRAME_SIZE:
                if not 16384 <= value <= 16777215:
                    raise _conn_error(ErrorCode.PROTOCOL_ERROR, f"MAX_FRAME_SIZE {value}")
                self.peer_max_frame = value
            elif code == SettingCode.MAX_CONCURRENT_STREAMS:
                self.peer_max_streams = value
            elif code in (SettingCode.ENABLE_PUSH, SettingCode.ENABLE_CONNECT_PROTOCOL) and (
                value > 1 or (code == SettingCode.ENABLE_PUSH and value and self.client_side)
            ):
                raise _conn_error(ErrorCode.PROTOCOL_ERROR, f"setting {code} = {value}")
            # HEADER_TABLE_SIZE: our encoder has no dynamic table; others: unknown, ignored (§6.5.2).
        self._reply(SettingsFrame(0, flags=("ACK",)))
        first = not self.peer_settings_received
        self.peer_settings_received = True
        if first and self.settings_acked:
            self._preface_deadline = None
        self._events.append(SettingsReceived(changed, first))
        if changed.get(SettingCode.INITIAL_WINDOW_SIZE, 0) and self.streams:
            self._events.append(WindowUpdated(0))

    def _on_ping(self, frame: PingFrame) -> None:
        if "ACK" in frame.flags:
            self._events.append(PingAcked(bytes(frame.opaque_data)))
        else:
            self._reply(PingFrame(0, flags=("ACK",), opaque_data=frame.opaque_data))

    def _on_goaway(self, frame: GoAwayFrame) -> None:
        last = frame.last_stream_id
        if self.goaway_received is None or last < self.goaway_received:
            self.goaway_received = last
        refused = [sid for sid in self.streams if (sid & 1) == self.client_side and sid > last]
        for sid in refused:
            self._close(self.streams[sid], CLOSED_BY_US)
        self._events.append(GoAwayReceived(frame.error_code, last, bytes(frame.additional_data), refused))
