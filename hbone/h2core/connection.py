"""A sans-IO HTTP/2 connection for HBONE's subset of RFC 9113: `H2Core`.

It takes the bytes received and the time and returns events (`hbone.h2core.events`); what to send
accumulates as bytes (`take_output()`). One class: state, our side's commands, the receive path.
The time is an input (given, or a clock given, read only when a decision needs it); it owns no
socket and starts no timer: `deadline()` says when `timer(now)` wants to be called.

The subset: the preface and SETTINGS (with ACK, and the peer's limits honoured), requests and
responses (CONNECT above all), DATA with connection and stream flow control, WINDOW_UPDATE,
RST_STREAM, PING, GOAWAY with last-stream-id semantics both ways (streams at or below it finish),
header blocks over CONTINUATION frames, padding; PRIORITY, unknown frame types and unknown settings
are ignored; no server push. Every protocol error is the connection or stream error RFC 9113 names.

Frames are walked by their 9-byte headers as the bytes arrive. A DATA frame is checked and charged
to both receive windows at its header and its payload handed out in place (`step`: a view of the
bytes received, no object), in pieces when cut across reads, never reassembled; every other frame
is buffered whole (bounded by our maximum frame size) and parsed with `hyperframe`, but HEADERS;
header blocks are decoded with `hpack`. DATA, HEADERS, CONTINUATION and WINDOW_UPDATE, what every
stream costs, are serialised by hand, the rest by `hyperframe`.

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

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Final

from hpack import Decoder, HPACKError, OversizedHeaderListError
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
from hbone.h2core.codes import (
    ErrorCode,
    H2ConnectionError,
    H2StreamError,
    H2UsageError,
    LimitBroken,
    SettingCode,
)
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
from hbone.h2core.frames import (
    DEFAULT_FRAME_SIZE,
    DEFAULT_WINDOW,
    FLAG_END_HEADERS,
    FLAG_END_STREAM,
    FLAG_PADDED,
    FLAG_PRIORITY,
    FRAME_HEADER,
    LARGE_DATA,
    MAX_WINDOW,
    PREFACE,
    TLS_RECORD,
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
    WINDOW_UPDATE_FRAME,
    parse_frame,
)
from hbone.h2core.streams import (
    CLOSED_BY_PEER,
    CLOSED_BY_US,
    CLOSED_ENDED,
    CLOSED_UNKNOWN,
    MAX_CLOSED_STREAMS,
    Stream,
)
from hbone.hpack import StaticEncoder

if TYPE_CHECKING:
    from hbone.settings import H2Settings

_KNOWN_TYPES = frozenset(range(10))
_NOTHING = memoryview(b"")

# What `H2Core.step` reports.
STEP_DONE: Final = 0
STEP_EVENTS: Final = 1
STEP_DATA: Final = 2


class H2Core:
    """One HTTP/2 connection, client or server side, without I/O. Call `initiate` first."""

    def __init__(
        self, *, client_side: bool, settings: H2Settings, now: float, clock: Callable[[], float] | None = None
    ) -> None:
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
        self._now: float | None = now
        self._clock = clock
        self._resets = 0  # streams reset before their answer, and resets provoked, this window
        self._reset_window_start = now
        self._write_blocked = False
        self._blocked_output = 0  # bytes our replies queued while the peer does not read
        # The replies to what was read while the peer does not read passed `paused_output_limit`:
        # read no more until the output drains (a PING or SETTINGS flood stalls, our buffer does not grow).
        self.reading_should_pause = False
        self._preface_deadline: float | None = None  # set by `initiate`
        # The receive path: where the bytes being walked belong.
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
        # The bytes `step` walks, and the DATA payload it handed out last; `feed` without the time
        # reads `clock` when a decision needs it.
        self._input = _NOTHING
        self._pos = 0
        self.data = _NOTHING
        self.data_stream_id = 0
        self.data_flow = 0

    # -- output ----------------------------------------------------------------------------------

    def take_output(self) -> list[bytes | bytearray | memoryview]:
        """What to send, in order (write it with `writelines`); empty when there is nothing."""
        chunks = self._chunks
        if self._out:
            chunks.append(self._out)
            self._out = bytearray()
        self._chunks = []
        return chunks

    def take_output_buffer(self) -> bytearray:
        """What to send, as one buffer (empty when there is nothing): a DATA frame's header and its
        payload adjacent, so that one TLS write carries both (payloads queued by reference are
        copied here, once)."""
        out = self._out
        self._out = bytearray()
        chunks = self._chunks
        if not chunks:
            return out
        self._chunks = []
        chunks.append(out)
        return bytearray().join(chunks)

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
        if n < LARGE_DATA:
            out += data
            return
        # Its head fills the header's TLS record (chunks are sealed apart), the rest by reference.
        head = -len(out) % TLS_RECORD
        out += data[:head]
        self._chunks.append(out)
        self._chunks.append(memoryview(data)[head:] if head else data)
        self._out = bytearray()

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
        self._out += WINDOW_UPDATE_FRAME.pack(0, 4, TYPE_WINDOW_UPDATE, 0, sid, increment)

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
        now = self._now
        if now is None:  # fed without the time: the clock, once per batch, and only here
            clock = self._clock
            if clock is None:
                raise H2UsageError("fed without the time, and no clock given")
            now = self._now = clock()
        if now - self._reset_window_start >= settings.reset_window:
            self._reset_window_start = now
            self._resets = 0
        self._resets += n
        if self._resets > settings.max_resets:
            raise LimitBroken(
                ErrorCode.ENHANCE_YOUR_CALM,
                f"too many stream resets (rapid reset): {self._resets} within {settings.reset_window:g}s",
            )

    # -- input -------------------------------------------------------------------------------------

    def receive(self, data: bytes | bytearray | memoryview, now: float) -> list[Event]:
        """Take received bytes (any split); returns what they meant. Nothing once terminated.

        Every DATA payload is a `DataReceived` here, copied out; `feed` and `step` hand it out in place.
        """
        events: list[Event] = []
        if self.terminated:
            return events
        self.feed(data, now)
        while True:
            step = self.step()
            if step == STEP_DATA:
                events.append(DataReceived(self.data_stream_id, self.data.tobytes(), self.data_flow))
            elif step == STEP_EVENTS:
                events += self.take_events()
            else:
                return events

    def feed(self, data: bytes | bytearray | memoryview, now: float | None = None) -> None:
        """Take received bytes (any split), walked by `step`: all of them, before the next `feed`.

        `now` None: the time is read from the `clock` given, once, only if a frame of the batch
        needs it (a reset counted towards rapid reset): a batch of DATA costs no clock read."""
        self._now = now
        self._input = memoryview(data)
        self._pos = 0

    def step(self) -> int:
        """Walk the bytes fed on, to the next thing to handle:

        * `STEP_DATA`: a DATA payload, in place: `data` (a view of the bytes fed, good until the
          next `feed`: copy what is kept) for stream `data_stream_id`, which used `data_flow` bytes
          of the receive windows (padding included; give them back with `ack` once consumed);
        * `STEP_EVENTS`: anything else, in order: `take_events()` (a padded DATA frame cut
          across reads is buffered whole and comes as a `DataReceived`);
        * `STEP_DONE`: every byte fed is walked (and nothing once terminated).

        Payloads and events keep the order of the frames that carried them."""
        if self._events:
            return STEP_EVENTS
        if not self.terminated and self._pos < len(self._input):
            try:
                if self._walk():
                    return STEP_DATA
            except H2ConnectionError as e:
                self._terminate(e)
            if self._events:
                return STEP_EVENTS
        self._input = self.data = _NOTHING
        return STEP_DONE

    def take_events(self) -> list[Event]:
        """The events `step` reported (`STEP_EVENTS`), in order."""
        events = self._events
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

    def _walk(self) -> bool:
        """Walk the input until a DATA payload is handed out (True) or it is spent; stop before
        the next frame while events wait to be taken. (A connection error raised here ends the
        input: where it stopped does not matter.)"""
        data = self._input
        n = len(data)
        pos = self._pos
        events = self._events
        while pos < n and not events:
            if self._data_left:
                take = min(self._data_left, n - pos)
                self._data_left -= take
                sid = self._data_sid
                pos += take
                if not sid:
                    self._ack_connection(take)
                    continue
                self.data = data[pos - take : pos]
                self.data_stream_id = sid
                self.data_flow = take
                if not self._data_left and self._data_end:
                    self._remote_end(sid)
                self._pos = pos
                return True
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
                    raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "invalid connection preface")
                pos += take
                self._preface_left -= take
                continue
            head = self._head
            if head or n - pos < 9:
                take = min(9 - len(head), n - pos)
                head += data[pos : pos + take]
                pos += take
                if len(head) < 9:
                    break
                hi, lo, ftype, flags, sid = FRAME_HEADER.unpack(head)
                head.clear()
            else:
                hi, lo, ftype, flags, sid = FRAME_HEADER.unpack_from(data, pos)
                pos += 9
            length = (hi << 8) | lo
            sid &= 0x7FFFFFFF
            if (
                ftype == TYPE_DATA
                and length <= n - pos
                and (not flags & FLAG_PADDED or (length and data[pos] < length))
            ):
                pos += length
                if self._whole_data(data, pos - length, length, flags, sid):
                    self._pos = pos
                    return True
                continue
            self._frame_header(length, ftype, flags, sid)
        self._pos = pos
        return False

    def _frame_header(self, length: int, ftype: int, flags: int, sid: int) -> None:
        """Judge a frame by its header; DATA is charged and routed here, other frames buffered."""
        self._check_header(length, ftype, flags, sid)
        if ftype == TYPE_DATA and not flags & FLAG_PADDED:
            self._begin_data(sid, length, flags & FLAG_END_STREAM)
            return
        self._ftype, self._fflags, self._fsid = ftype, flags, sid
        self._skip = ftype not in _KNOWN_TYPES
        self._fbody = bytearray()
        self._fleft = length
        if not length:
            self._complete()

    def _check_header(self, length: int, ftype: int, flags: int, sid: int) -> None:
        if length > self._local_max_frame:
            raise LimitBroken(
                ErrorCode.FRAME_SIZE_ERROR,
                f"frame of {length} bytes, more than the maximum frame size {self._local_max_frame}",
            )
        if not self.peer_settings_received and (ftype != TYPE_SETTINGS or flags & 1):
            raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "the preface's first frame is not SETTINGS")
        if self._block_sid:
            if ftype != TYPE_CONTINUATION or sid != self._block_sid:
                raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "a header block interrupted")
            self._continuations += 1
            self._block_size += length
            self._check_block()
        elif ftype == TYPE_HEADERS:
            self._block_size = length
            self._continuations = 0
            self._check_block()
        elif ftype == TYPE_CONTINUATION:
            raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "CONTINUATION without a header block")

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

    def _whole_data(self, data: memoryview, at: int, length: int, flags: int, sid: int) -> bool:
        """A DATA frame whose payload (valid padding included) is all in `data` from `at`: charged,
        and its payload handed out in place (True) or dropped, its window given back (False)."""
        self._check_header(length, TYPE_DATA, flags, sid)
        end = bool(flags & FLAG_END_STREAM)
        target = self._data_target(sid, length, end)
        if not target:
            if length:
                self._ack_connection(length)
            return False
        start, stop = at, at + length
        if flags & FLAG_PADDED:
            start += 1
            stop -= data[at]
        elif not length:
            if end:
                self._remote_end(target)
            return False
        self.data = data[start:stop]
        self.data_stream_id = target
        self.data_flow = length
        if end:
            self._remote_end(target)
        return True

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
            raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "DATA on stream 0")
        if length > self.recv_window:
            raise H2ConnectionError(ErrorCode.FLOW_CONTROL_ERROR, "DATA beyond the connection window")
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
        raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, f"frame type {ftype} on idle stream {sid}")

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
                sid, self._block_sid = self._block_sid, 0
                self._block_done_for(sid)
            return
        if ftype == TYPE_PRIORITY:
            if not sid:
                raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "PRIORITY on stream 0")
            if len(body) != 5:
                raise H2StreamError(sid, ErrorCode.FRAME_SIZE_ERROR, "PRIORITY of other than 5 bytes")
            return  # priorities are not used
        if ftype == TYPE_PUSH_PROMISE:
            raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "PUSH_PROMISE: push is not enabled")
        if ftype == TYPE_HEADERS:
            self._on_headers(sid, flags, body)
            return
        frame = parse_frame(ftype, flags, sid, body)
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

    # -- header blocks -------------------------------------------------------------------------------

    def _on_headers(self, sid: int, flags: int, body: memoryview) -> None:
        """HEADERS (RFC 9113 §6.2), read here: one per stream each way, the cost of a new stream."""
        if not sid:
            raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "HEADERS on stream 0")
        start, end, pad = 0, len(body), 0
        if flags & FLAG_PADDED:
            if not end:
                raise H2ConnectionError(ErrorCode.FRAME_SIZE_ERROR, "padded HEADERS without its pad length")
            pad = body[0]
            start = 1
        self._block_self_dependent = False
        if flags & FLAG_PRIORITY:
            if end - start < 5:
                raise H2ConnectionError(ErrorCode.FRAME_SIZE_ERROR, "HEADERS too short for its priority")
            depends_on = int.from_bytes(body[start : start + 4], "big") & MAX_WINDOW
            self._block_self_dependent = depends_on == sid
            start += 5
        if pad > end - start:
            raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "HEADERS padding longer than its payload")
        self._block_end_stream = bool(flags & FLAG_END_STREAM)
        self._block = [bytes(body[start : end - pad])]
        if flags & FLAG_END_HEADERS:
            self._block_done_for(sid)
        else:
            self._block_sid = sid

    def _decode(self, block: bytes) -> list[tuple[bytes, bytes]]:
        try:
            return list(self._decoder.decode(block, raw=True))  # type: ignore[arg-type]
        except OversizedHeaderListError as e:
            raise LimitBroken(ErrorCode.ENHANCE_YOUR_CALM, f"header list too large: {e}") from None
        except (HPACKError, IndexError, ValueError) as e:
            raise H2ConnectionError(ErrorCode.COMPRESSION_ERROR, f"header block not decodable: {e}") from None

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
                raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, f"HEADERS on stream {sid}, below the last")
            raise H2ConnectionError(ErrorCode.STREAM_CLOSED, f"HEADERS on closed stream {sid}")

    def _new_stream(self, sid: int, raw: list[tuple[bytes, bytes]], end: bool) -> None:
        if self.client_side:
            raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, "the server opened a stream")
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
                raise H2ConnectionError(ErrorCode.FLOW_CONTROL_ERROR, "connection window beyond 2^31-1")
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
                    raise H2ConnectionError(ErrorCode.FLOW_CONTROL_ERROR, "INITIAL_WINDOW_SIZE beyond 2^31-1")
                delta = value - self.peer_window
                self.peer_window = value
                for stream in self.streams.values():
                    stream.send_window += delta
                    if stream.send_window > MAX_WINDOW:
                        raise H2ConnectionError(ErrorCode.FLOW_CONTROL_ERROR, "a stream window beyond 2^31-1")
            elif code == SettingCode.MAX_FRAME_SIZE:
                if not 16384 <= value <= 16777215:
                    raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, f"MAX_FRAME_SIZE {value}")
                self.peer_max_frame = value
            elif code == SettingCode.MAX_CONCURRENT_STREAMS:
                self.peer_max_streams = value
            elif code in (SettingCode.ENABLE_PUSH, SettingCode.ENABLE_CONNECT_PROTOCOL) and (
                value > 1 or (code == SettingCode.ENABLE_PUSH and value and self.client_side)
            ):
                raise H2ConnectionError(ErrorCode.PROTOCOL_ERROR, f"setting {code} = {value}")
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
