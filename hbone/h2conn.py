"""One HBONE HTTP/2 connection: the `h2` state machine driven by an asyncio protocol.

`H2Session` is the protocol installed on the TLS transport, for both the client and the server side.
It owns the connection-level behaviour: SETTINGS and the 16 MiB connection window, the batching of
outgoing frames (one transport write per received batch), send scheduling of the streams that wait
for flow-control window or for the TLS transport to drain, GOAWAY, the PING keepalive and tearing
everything down. Per-stream behaviour lives in `hbone.stream.HboneStream`.

DATA frames, the bulk of the traffic, take a direct path; everything else goes through `h2`:

* receiving: the session is a `BufferedProtocol`, so the TLS layer decrypts straight into a buffer
  of ours (one per thread and nesting level, reused: no allocation per read). `_split` walks the
  frame headers itself and hands the payload of a DATA frame on an open stream to that stream as
  it arrives, piece by piece, after charging both receive windows in h2's own window managers; h2
  would first reassemble each frame (up to 1 MiB) and copy it three times. Every other frame, and
  any DATA frame h2 must judge (END_STREAM, padding, unknown or closing stream, flow-control or
  size violation, inside a header block), is handed to h2 unchanged and in order.
* sending: `send_data` charges h2's send windows and queues the 9-byte frame header and the
  payload itself (large payloads are not copied: the transport gets them in a `writelines`).
* window updates: what the streams consumed is acknowledged once per received batch (or per
  flush), summed per stream, through h2's window managers; one connection WINDOW_UPDATE at most.

`_H2Connection` adapts h2 4.x in a few places (private API, pinned by `h2<5`):
* h2 formats `repr(frame)` for a trace log on every received frame even when logging is off; that
  costs more than the rest of frame handling for small frames, so `_receive_frame` is re-stated
  without it.
* h2 moves its connection state machine to CLOSED on any GOAWAY, sent or received, after which every
  frame is a protocol error; HTTP/2 lets the streams below the GOAWAY's last stream id finish, so
  GOAWAY is sent and received here without that transition, and the session refuses new streams.
* output is a list of buffers (see `take_output`), and `queue_data` writes a DATA frame into it.
* a new stream past our MAX_CONCURRENT_STREAMS is refused alone (RST_STREAM REFUSED_STREAM) where h2
  would end the connection, and the resets the peer's frames make us send are counted.
* h2's check of received header fields for illegal characters (RFC 9113 §8.2.1) walks every byte
  of every name and value in Python, the largest single cost of receiving a request; the same
  check, with the same errors, is done by regular expressions (`_reject_illegal_characters`).
The private internals relied on are pinned by `tests/test_hbone_h2_internals.py`.

Abuse limits (`hbone.settings.H2Settings`) are enforced by the session, per connection: a frame
larger than our maximum frame size and an oversized header block are refused at their frame
header, before anything is buffered or decoded; streams the peer resets before they are answered,
plus the resets it provokes, are counted per window (rapid reset); breaking a limit is a GOAWAY
naming it, a warning, and the end of that connection only. Requests are handed to `on_request` at
the end of the batch that opened them, so a stream reset in the same batch never starts any work.
While the transport is over its high-water mark, reading stops once the replies to what is read
pile up. A torn-down session ignores every later byte.
"""

from __future__ import annotations

import asyncio
import logging
import re
import struct
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

import h2.events as ev
import h2.utilities
from h2.config import H2Configuration
from h2.connection import ConnectionState, H2Connection, _decode_headers
from h2.errors import ErrorCodes
from h2.exceptions import H2Error, ProtocolError, StreamClosedError, StreamIDTooLowError, TooManyStreamsError
from h2.settings import SettingCodes, Settings
from h2.stream import StreamClosedBy, StreamState
from hyperframe.frame import DataFrame, Frame, GoAwayFrame, HeadersFrame, RstStreamFrame

from hbone import stream as hbone_stream
from hbone.errors import ConnectionClosed, HboneError
from hbone.hpack import StaticEncoder
from hbone.identity import Identity
from hbone.settings import H2Settings
from hbone.stream import HboneStream

log = logging.getLogger("hbone")

DEFAULT_CONNECTION_WINDOW = 65535
# Outgoing frames are handed to the transport at least this often while a large write is framed,
# so the TLS transport's own back-pressure (pause_writing) is seen early.
FLUSH_THRESHOLD = 256 * 1024
# Write-buffer marks of the TLS transport under the session: large, since each write is big.
TRANSPORT_HIGH_WATER = 1024 * 1024
# What the TLS layer may decrypt into our buffer per read.
READ_BUFFER_SIZE = 256 * 1024

Headers = list[tuple[str, str]]

# DATA payloads from this size on are written as separate buffers instead of being copied.
LARGE_DATA = 16 * 1024
_FRAME_HEADER = struct.Struct(">HBBBL")  # length (24 bits as 16+8), type, flags, stream id
_WINDOW_UPDATE = struct.Struct(">HBBBLL")  # a frame header, then the increment
_END_STREAM = 0x1
_PADDED = 0x8
_END_HEADERS = 0x4
_TYPE_DATA = 0
_TYPE_HEADERS = 1
_TYPE_PUSH_PROMISE = 5
_TYPE_WINDOW_UPDATE = 8
_TYPE_CONTINUATION = 9
_HEADER_BLOCK_TYPES = (_TYPE_HEADERS, _TYPE_PUSH_PROMISE, _TYPE_CONTINUATION)
_PREFACE_LEN = 24  # "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", sent by the client first

# States are compared by identity: `in` on a set of enum members calls the Python-level
# Enum.__hash__, which costs more per frame than the rest of the check.
_CLIENT_OPEN = ConnectionState.CLIENT_OPEN
_SERVER_OPEN = ConnectionState.SERVER_OPEN
_OPEN = StreamState.OPEN
_HALF_CLOSED_LOCAL = StreamState.HALF_CLOSED_LOCAL
_HALF_CLOSED_REMOTE = StreamState.HALF_CLOSED_REMOTE
_STREAM_CLOSED = hbone_stream.StreamState.CLOSED


# RFC 9113 §8.2.1: a name holds no byte in 0x00-0x20, 0x41-0x5a ("A"-"Z") or 0x7f-0xff, and no
# colon past its first byte; a value holds no NUL, LF or CR, and does not start or end with SP or HTAB.
_BAD_NAME_BYTE = re.compile(rb"[\x00-\x20A-Z\x7f-\xff]")
_BAD_VALUE_BYTE = re.compile(rb"[\x00\n\r]")
_BLANK = (0x20, 0x09)


def _reject_illegal_characters(
    headers: Iterable[tuple[bytes, bytes]], hdr_validation_flags: object
) -> Iterator[tuple[bytes, bytes]]:
    """h2's `_reject_illegal_characters` (same checks, same ProtocolErrors), by regular expression."""
    for header in headers:
        name, value = header[0], header[1]
        bad = _BAD_NAME_BYTE.search(name)
        if bad is not None:
            c = bad.group()[0]
            if 0x41 <= c <= 0x5A:
                raise ProtocolError(f"Received uppercase header name {name!r}.")
            raise ProtocolError(f"Illegal character '{chr(c)}' in header name: {name!r}")
        if name.find(b":", 1) != -1:
            raise ProtocolError(f"Illegal character ':' in header name: {name!r}")
        if value:
            bad = _BAD_VALUE_BYTE.search(value)
            if bad is not None:
                raise ProtocolError(f"Illegal character '{chr(bad.group()[0])}' in header value: {value!r}")
            if value[0] in _BLANK or value[-1] in _BLANK:
                raise ProtocolError(f"Received header value surrounded by whitespace {value!r}")
        yield header


H2_REJECT_ILLEGAL_CHARACTERS = h2.utilities._reject_illegal_characters  # h2's own, for the tests
h2.utilities._reject_illegal_characters = _reject_illegal_characters  # type: ignore[assignment]


class PeerMisbehaved(H2Error):
    """The peer broke a limit of ours (`hbone.settings`): the connection ends with GOAWAY(`error_code`)."""

    def __init__(self, error_code: ErrorCodes, message: str) -> None:
        super().__init__(message)
        self.error_code = error_code


class _ReadBuffers(threading.local):
    """The buffers the TLS layer decrypts into, one per nesting level of `buffer_updated`.

    A session only reads its buffer inside `buffer_updated` and copies out what it keeps, so one
    buffer serves every session of a thread. Levels exist because delivering a payload can feed
    another session synchronously (double HBONE: the inner TLS session is fed from an outer
    stream), which must not decrypt into the buffer being walked.
    """

    def __init__(self) -> None:
        self.depth = 0
        self.views: list[memoryview] = []

    def current(self) -> memoryview:
        views = self.views
        depth = self.depth
        if depth < len(views):
            return views[depth]
        while len(views) <= depth:
            views.append(memoryview(bytearray(READ_BUFFER_SIZE)))
        return views[depth]


_READ = _ReadBuffers()


class _H2Connection(H2Connection):
    # How many closed streams h2 remembers (to judge frames still in flight on them). Its default,
    # 65,536, is about 6 MB per long-lived connection once reached; frames in flight arrive within a
    # round trip, long before 4,096 further streams have closed.
    MAX_CLOSED_STREAMS = 4096

    def __init__(self, config: H2Configuration) -> None:
        super().__init__(config)
        # Our header blocks: static table and raw literals (see `hbone.hpack`); decoding stays h2's.
        self.encoder: StaticEncoder = StaticEncoder()  # type: ignore[assignment]
        # Output is a list of buffers: small frames accumulate in `_data_to_send` (as in h2), large
        # DATA payloads are queued as they are, sparing the three copies of h2's serialisation.
        self._chunks: list[bytes | bytearray | memoryview] = []
        # RST_STREAMs the peer's frames made us send (frames on streams it closed, refused streams);
        # frames still in flight on a stream we reset are the peer's right, not counted.
        self.provoked_resets = 0

    def _prepare_for_sending(self, frames: list[Frame]) -> None:
        out = self._data_to_send
        for f in frames:
            if type(f) is DataFrame and len(f.data) >= LARGE_DATA and "PADDED" not in f.flags:
                n = f.body_len = len(f.data)
                flags = _END_STREAM if "END_STREAM" in f.flags else 0
                out += _FRAME_HEADER.pack(n >> 8, n & 0xFF, 0, flags, f.stream_id)
                self._chunks.append(out)
                self._chunks.append(f.data)
                out = self._data_to_send = bytearray()
            else:
                out += f.serialize()

    def take_output(self) -> list[bytes | bytearray | memoryview]:
        chunks = self._chunks
        if self._data_to_send:
            chunks.append(self._data_to_send)
            self._data_to_send = bytearray()
        self._chunks = []
        return chunks

    def queue_data(self, stream_id: int, data: bytes | memoryview) -> None:
        """Queue one DATA frame (no flags); the caller has checked the stream and charged the windows."""
        n = len(data)
        out = self._data_to_send
        out += _FRAME_HEADER.pack(n >> 8, n & 0xFF, _TYPE_DATA, 0, stream_id)
        if n >= LARGE_DATA:
            self._chunks.append(out)
            self._chunks.append(data)
            self._data_to_send = bytearray()
        else:
            out += data

    def queue_window_update(self, stream_id: int, increment: int) -> None:
        self._data_to_send += _WINDOW_UPDATE.pack(0, 4, _TYPE_WINDOW_UPDATE, 0, stream_id, increment)

    def _receive_frame(self, frame: Frame) -> list[ev.Event]:
        # Same as h2 4.4's, minus `logger.trace("Received frame: %s", repr(frame))`.
        events: list[ev.Event]
        try:
            frames, events = self._frame_dispatch_table[frame.__class__](frame)
        except StreamClosedError as e:
            if self._stream_is_closed_by_reset(e.stream_id):
                f = RstStreamFrame(e.stream_id)
                f.error_code = e.error_code
                self._prepare_for_sending([f])
                events = e._events
            else:
                raise
        except StreamIDTooLowError as e:
            if self._stream_is_closed_by_reset(e.stream_id):
                f = RstStreamFrame(e.stream_id)
                f.error_code = ErrorCodes.STREAM_CLOSED
                self._prepare_for_sending([f])
                events = []
            elif self._stream_is_closed_by_end(e.stream_id):
                raise StreamClosedError(e.stream_id) from e
            else:
                raise
        except TooManyStreamsError:
            if type(frame) is not HeadersFrame:
                raise
            self._refuse_stream(frame)
            self.provoked_resets += 1
            events = []
        else:
            for f in frames:
                if type(f) is RstStreamFrame:
                    self._count_provoked(f.stream_id)  # e.g. DATA on a stream the peer reset
            self._prepare_for_sending(frames)
            return events
        self._count_provoked(frame.stream_id)
        return events

    def _count_provoked(self, stream_id: int) -> None:
        stream = self.streams.get(stream_id)
        closed_by = stream.closed_by if stream is not None else self._closed_streams.get(stream_id)
        if closed_by is not StreamClosedBy.SEND_RST_STREAM:
            self.provoked_resets += 1

    def _refuse_stream(self, frame: HeadersFrame) -> None:
        """A new stream past our MAX_CONCURRENT_STREAMS: RST_STREAM(REFUSED_STREAM) on it alone
        (RFC 9113 §5.1.2), where h2 would end the whole connection."""
        sid = frame.stream_id
        if sid % 2 == 0 or sid <= self.highest_inbound_stream_id or self.config.client_side:
            raise TooManyStreamsError(f"stream {sid} cannot be opened")
        # The header block is decoded all the same: HPACK's dynamic table is shared by the streams.
        _decode_headers(self.decoder, frame.data)
        self.highest_inbound_stream_id = sid
        self._closed_streams[sid] = StreamClosedBy.SEND_RST_STREAM
        f = RstStreamFrame(sid)
        f.error_code = ErrorCodes.REFUSED_STREAM
        self._prepare_for_sending([f])

    def _receive_goaway_frame(self, frame: GoAwayFrame) -> tuple[list[Frame], list[ev.Event]]:
        event = ev.ConnectionTerminated()
        event.error_code = frame.error_code
        event.last_stream_id = frame.last_stream_id
        event.additional_data = frame.additional_data or None
        return [], [event]

    def send_goaway(self, error_code: int, last_stream_id: int, debug: bytes = b"") -> None:
        f = GoAwayFrame(
            stream_id=0, last_stream_id=last_stream_id, error_code=error_code, additional_data=debug
        )
        self._prepare_for_sending([f])

    def begin(self, local: dict[SettingCodes, int], connection_window: int) -> None:
        """Send the preface: our SETTINGS, then a WINDOW_UPDATE raising the connection window."""
        self.local_settings = Settings(client=self.config.client_side, initial_values=local)
        # Values given as initial_values never go through an ACK, so apply the ones h2 would
        # apply on ACK now; the peer cannot exceed the defaults before it has seen them anyway.
        self.max_inbound_frame_size = self.local_settings.max_frame_size
        if self.local_settings.max_header_list_size is not None:
            self.decoder.max_header_list_size = self.local_settings.max_header_list_size
        self.initiate_connection()
        if connection_window > DEFAULT_CONNECTION_WINDOW:
            self.increment_flow_control_window(connection_window - DEFAULT_CONNECTION_WINDOW)


def decode_headers(raw: list[tuple[bytes, bytes]]) -> Headers:
    return [(k.decode("ascii", "replace").lower(), v.decode("utf-8", "replace")) for k, v in raw]


class H2Session(asyncio.BufferedProtocol):
    """The protocol of one HBONE connection's TLS transport.

    Received bytes before `start()` (the TLS peer check happens in between) are held and processed
    on `start()`; nothing is sent before it.
    """

    def __init__(
        self,
        *,
        client_side: bool,
        settings: H2Settings,
        on_request: Callable[[HboneStream, Headers], None] | None = None,
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.client_side = client_side
        self.settings = settings
        self._on_request = on_request
        # Outbound fields are checked by our encoder (`hbone.hpack`), before h2 sees them.
        self._h2 = _H2Connection(
            H2Configuration(
                client_side=client_side,
                header_encoding=None,
                validate_outbound_headers=False,
                normalize_outbound_headers=False,
            )
        )
        self.transport: asyncio.Transport | None = None
        self.extra: dict[str, Any] = {}
        self.peer_identity: Identity | None = None
        self.streams: dict[int, HboneStream] = {}
        # Streams with outbound bytes waiting for window or for the transport to drain.
        self._pending: dict[int, HboneStream] = {}
        self._early: list[bytes] | None = []
        self._started = False
        self._in_batch = False
        self._unflushed = 0
        self._write_paused = False
        self._dead = False
        self._transport_gone = False
        self.close_reason: HboneError | None = None
        self.goaway_received = False
        self.goaway_sent = False
        self._draining = False  # close the transport once the last stream finishes
        self._refuse_above = 2**31  # streams above this id are refused (after our GOAWAY)
        self.remote_settings: asyncio.Future[None] = self.loop.create_future()
        self.closed: asyncio.Future[None] = self.loop.create_future()
        self._ping_handle: asyncio.TimerHandle | None = None
        self._pong_handle: asyncio.TimerHandle | None = None
        self._ping_count = 0
        # The frame splitter (see `_split`): where the received byte stream is.
        self._preface_left = 0 if client_side else _PREFACE_LEN
        self._header = bytearray()  # a frame header split across reads
        self._to_h2 = bytearray()  # bytes of frames for h2, fed at the next boundary that needs it
        self._h2_left = 0  # bytes of the current frame still to go to h2
        self._data_left = 0  # payload bytes of the current direct DATA frame still to come
        self._data_stream: HboneStream | None = None
        # Flow-controlled bytes consumed per stream, acknowledged to h2 at the next flush.
        self._acks: dict[int, int] = {}
        self._flush_scheduled = False
        # Abuse accounting (limits in `hbone.settings`).
        self._max_frame = settings.frame_size
        self._header_block = 0  # compressed bytes of the header block being received
        self._continuations = 0
        self._resets = 0  # streams reset before their answer, and resets provoked, this window
        self._reset_window_start = self.loop.time()
        self._provoked_seen = 0
        self._paused_output = 0  # bytes our replies added while the transport was over its mark
        self._read_paused = False
        # Requests of the batch being received: handed to `on_request` at its end, unless reset.
        self._new_requests: list[tuple[HboneStream, Headers]] = []
        self._dispatch: dict[type[ev.Event], Callable[[Any], None]] = {
            ev.DataReceived: self._on_data,
            ev.WindowUpdated: self._on_window_updated,
            ev.StreamEnded: self._on_stream_ended,
            ev.StreamReset: self._on_stream_reset,
            ev.RequestReceived: self._on_request_received,
            ev.ResponseReceived: self._on_response_received,
            ev.RemoteSettingsChanged: self._on_remote_settings,
            ev.PingAckReceived: self._on_ping_ack,
            ev.ConnectionTerminated: self._on_goaway,
        }

    # -- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement the interface without subclassing asyncio.Transport.
        transport = cast(asyncio.Transport, transport)
        if self.transport is not None:
            return
        self.transport = transport
        for name in ("peername", "sockname", "ssl_object", "peercert", "cipher"):
            self.extra[name] = transport.get_extra_info(name)
        transport.set_write_buffer_limits(high=TRANSPORT_HIGH_WATER)
        if self._dead:
            transport.abort()

    def get_buffer(self, sizehint: int) -> memoryview:
        return _READ.current()

    def buffer_updated(self, nbytes: int) -> None:
        if self._dead:
            return  # torn down: late bytes are not parsed
        reads = _READ
        depth = reads.depth
        view = reads.views[depth][:nbytes]  # the buffer `get_buffer` returned at this depth
        if not self._started:
            if self._early is not None:
                self._early.append(view.tobytes())
            return
        reads.depth = depth + 1
        try:
            self._receive(view)
        finally:
            reads.depth = depth

    def data_received(self, data: bytes) -> None:
        """For transports that do not use `get_buffer` (the bytes are ours to keep)."""
        if self._dead:
            return
        if not self._started:
            if self._early is not None:
                self._early.append(bytes(data))
            return
        self._receive(memoryview(data))

    def eof_received(self) -> bool:
        return False  # the TLS transport closes; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport_gone = True
        if exc is None:
            reason = ConnectionClosed(
                "connection closed by peer" if not self._draining else "connection closed"
            )
        else:
            reason = ConnectionClosed(f"connection lost: {exc}")
            reason.__cause__ = exc
        self._teardown(reason)
        if not self.closed.done():
            self.closed.set_result(None)

    def pause_writing(self) -> None:
        self._write_paused = True
        self._paused_output = 0

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._read_paused:
            self._read_paused = False
            if self.transport is not None and not self._dead and not self._transport_gone:
                self.transport.resume_reading()
        self._pump_pending()
        self.kick()

    # -- life cycle ----------------------------------------------------------------------------

    def start(self) -> None:
        """Send the preface and process what arrived meanwhile; start the keepalive."""
        if self._started or self._dead:
            return
        self._started = True
        self._h2.begin(
            self.settings.local_settings(client_side=self.client_side), self.settings.connection_window
        )
        self.kick()
        self._schedule_ping()
        early, self._early = self._early, None
        for data in early or ():
            if self._dead:
                break
            self._receive(memoryview(data))

    def is_usable(self) -> bool:
        # Sending or receiving a GOAWAY also sets `_draining`.
        return self._started and not (self._dead or self._draining)

    def goaway(self, error_code: int = ErrorCodes.NO_ERROR) -> None:
        """Graceful: announce that no new streams are accepted; close once the open ones finish."""
        if self._dead or self.goaway_sent:
            return
        self.goaway_sent = True
        self._draining = True
        last = self._h2.highest_inbound_stream_id
        self._refuse_above = last
        if self._started:
            self._h2.send_goaway(error_code, last)
            self.kick()
        self._maybe_close_idle()

    def drain(self) -> None:
        """Client side graceful close: no new streams; close once the open ones finish."""
        if self._dead:
            return
        self._draining = True
        self._maybe_close_idle()

    def abort(self, reason: HboneError | None = None) -> None:
        self._teardown(reason or ConnectionClosed("connection aborted"), abort=True)

    def _maybe_close_idle(self) -> None:
        if self._draining and not self.streams and not self._dead:
            if self._started and not self.goaway_sent and not self.goaway_received:
                self.goaway_sent = True
                self._h2.send_goaway(ErrorCodes.NO_ERROR, self._h2.highest_inbound_stream_id)
                self.kick()
            self._teardown(ConnectionClosed("connection closed"), abort=False)

    def _teardown(self, reason: HboneError, *, abort: bool = False) -> None:
        if self._dead:
            return
        self._dead = True
        self.close_reason = reason
        self._early = None
        self._data_stream = None
        self._data_left = 0
        self._new_requests.clear()
        for handle in (self._ping_handle, self._pong_handle):
            if handle is not None:
                handle.cancel()
        self._ping_handle = self._pong_handle = None
        streams = list(self.streams.values())
        self.streams.clear()
        self._pending.clear()
        for stream in streams:
            stream.session_lost(reason)
        if not self.remote_settings.done():
            self.remote_settings.set_exception(reason)
            self.remote_settings.exception()  # retrieved: a failed open() reports it itself
        transport = self.transport
        if transport is not None and not self._transport_gone:
            if abort:
                transport.abort()
            else:
                self._flush_always()
                transport.close()
        elif transport is None and not self.closed.done():
            self.closed.set_result(None)

    # -- receiving -----------------------------------------------------------------------------

    def _receive(self, data: memoryview) -> None:
        if self._dead:
            return
        self._in_batch = True
        try:
            self._split(data)
            if self._new_requests and not self._dead:
                self._start_requests()
        except PeerMisbehaved as e:
            self._in_batch = False
            self._misbehaved(e)
            return
        except H2Error as e:
            self._in_batch = False
            self._flush_always()  # h2 queued a GOAWAY naming the error
            self._teardown(ConnectionClosed(f"http2 protocol error: {e}"))
            return
        finally:
            self._in_batch = False
        if not self._dead:
            self._flush_always()

    def _misbehaved(self, e: PeerMisbehaved) -> None:
        log.warning(
            "hbone: closing the connection of %s (%s) with GOAWAY %s: %s",
            self.extra.get("peername"),
            self.peer_identity,
            e.error_code.name,
            e,
        )
        self._h2.send_goaway(e.error_code, self._h2.highest_inbound_stream_id, str(e).encode())
        self.goaway_sent = True
        self._flush_always()
        self._teardown(ConnectionClosed(f"http2 protocol error: {e}"))

    def _count_resets(self, n: int) -> None:
        now = self.loop.time()
        settings = self.settings
        if now - self._reset_window_start >= settings.reset_window:
            self._reset_window_start = now
            self._resets = 0
        self._resets += n
        if self._resets > settings.max_resets:
            raise PeerMisbehaved(
                ErrorCodes.ENHANCE_YOUR_CALM,
                f"too many stream resets (rapid reset): {self._resets} within {settings.reset_window:g}s",
            )

    def _check_header_block(self, ftype: int, flags: int, length: int) -> None:
        """Bound a header block by its frame headers, before its bytes are buffered or decoded."""
        if ftype == _TYPE_CONTINUATION:
            self._header_block += length
            self._continuations += 1
            if self._continuations > self.settings.max_continuations:
                raise PeerMisbehaved(
                    ErrorCodes.ENHANCE_YOUR_CALM,
                    f"header block of more than {self.settings.max_continuations} CONTINUATION frames",
                )
        else:
            self._header_block = length
            self._continuations = 0
        if self._header_block > self.settings.max_header_block:
            raise PeerMisbehaved(
                ErrorCodes.ENHANCE_YOUR_CALM,
                f"header block of more than {self.settings.max_header_block} bytes",
            )
        if flags & _END_HEADERS:
            self._header_block = self._continuations = 0

    def _start_requests(self) -> None:
        new, self._new_requests = self._new_requests, []
        on_request = self._on_request
        assert on_request is not None  # only the server side queues requests
        for stream, headers in new:
            if stream.state is not _STREAM_CLOSED and not self._dead:
                on_request(stream, headers)

    def _split(self, data: memoryview) -> None:
        """Walk the frames in `data`: DATA payloads straight to their streams, the rest to h2."""
        n = len(data)
        pos = 0
        to_h2 = self._to_h2
        while pos < n:
            if self._data_left:
                take = min(self._data_left, n - pos)
                piece = data[pos : pos + take].tobytes()  # out of the shared read buffer
                pos += take
                self._data_left -= take
                stream = self._data_stream
                if stream is not None:
                    stream.received_data(piece, take)
                if self._dead:
                    return
                continue
            if self._h2_left or self._preface_left:
                take = min(self._h2_left or self._preface_left, n - pos)
                to_h2 += data[pos : pos + take]
                pos += take
                if self._h2_left:
                    self._h2_left -= take
                else:
                    self._preface_left -= take
                continue
            header = self._header
            if header or n - pos < 9:
                take = min(9 - len(header), n - pos)
                header += data[pos : pos + take]
                pos += take
                if len(header) < 9:
                    break
                head: bytes | memoryview = bytes(header)
                header.clear()
            else:
                head = data[pos : pos + 9]
                pos += 9
            hi, lo, ftype, flags, sid = _FRAME_HEADER.unpack(head)
            length = (hi << 8) | lo
            if length > self._max_frame:
                # Said as soon as the header is seen, not after buffering up to 16 MiB of it.
                raise PeerMisbehaved(
                    ErrorCodes.FRAME_SIZE_ERROR,
                    f"frame of {length} bytes, more than the maximum frame size {self._max_frame}",
                )
            if ftype == _TYPE_DATA:
                if length and not flags & (_END_STREAM | _PADDED):
                    if to_h2:
                        self._feed_h2()  # the frames before this one may open, end or reset its stream
                        if self._dead:
                            return
                    stream = self._direct_data_stream(sid & 0x7FFFFFFF, length)
                    if stream is not None:
                        self._data_left = length
                        self._data_stream = stream
                        continue
            elif ftype in _HEADER_BLOCK_TYPES:
                self._check_header_block(ftype, flags, length)
            to_h2 += head
            self._h2_left = length
        if to_h2 and not self._dead:
            self._feed_h2()

    def _direct_data_stream(self, sid: int, length: int) -> HboneStream | None:
        """The stream a DATA frame's payload can go to directly, its windows charged; else None."""
        stream = self.streams.get(sid)
        if stream is None:
            return None
        h2c = self._h2
        h2s = h2c.streams.get(sid)
        if h2s is None:
            return None
        state = h2s.state_machine.state
        conn_state = h2c.state_machine.state
        if (
            not (state is _OPEN or state is _HALF_CLOSED_LOCAL)
            or not (conn_state is _CLIENT_OPEN or conn_state is _SERVER_OPEN)
            or not h2s.state_machine.headers_received
            or h2s._expected_content_length is not None
            or length > h2c.max_inbound_frame_size
            or h2c.incoming_buffer._headers_buffer
        ):
            return None
        conn_window = h2c._inbound_flow_control_window_manager
        stream_window = h2s._inbound_window_manager
        if length > conn_window.current_window_size or length > stream_window.current_window_size:
            return None  # a flow-control violation: h2 says so
        conn_window.current_window_size -= length
        stream_window.current_window_size -= length
        h2s._actual_content_length += length
        return stream

    def _feed_h2(self) -> None:
        data = bytes(self._to_h2)
        self._to_h2.clear()
        h2c = self._h2
        queued = len(h2c._data_to_send)
        events = h2c.receive_data(data)
        if self._write_paused:
            # The peer does not read what we send: stop reading what makes us reply.
            self._paused_output += len(h2c._data_to_send) - queued
            if self._paused_output > self.settings.paused_output_limit and not self._read_paused:
                transport = self.transport
                if transport is not None and not self._transport_gone:
                    self._read_paused = True
                    transport.pause_reading()
        if h2c.provoked_resets != self._provoked_seen:
            n = h2c.provoked_resets - self._provoked_seen
            self._provoked_seen = h2c.provoked_resets
            self._count_resets(n)
        dispatch = self._dispatch
        for event in events:
            handler = dispatch.get(type(event))
            if handler is not None:
                handler(event)
            if self._dead:
                return

    def _on_data(self, event: ev.DataReceived) -> None:
        stream = self.streams.get(event.stream_id)  # type: ignore[arg-type]
        if stream is None:
            self.ack(event.stream_id, event.flow_controlled_length)  # type: ignore[arg-type]
            return
        stream.received_data(event.data, event.flow_controlled_length)  # type: ignore[arg-type]

    def _on_window_updated(self, event: ev.WindowUpdated) -> None:
        if not self._pending:
            return
        if event.stream_id == 0:
            self._pump_pending()
        else:
            stream = self._pending.get(event.stream_id)  # type: ignore[arg-type]
            if stream is not None:
                stream.window_available()

    def _on_stream_ended(self, event: ev.StreamEnded) -> None:
        stream = self.streams.get(event.stream_id)  # type: ignore[arg-type]
        if stream is not None:
            stream.received_end()

    def _on_stream_reset(self, event: ev.StreamReset) -> None:
        stream = self.streams.get(event.stream_id)  # type: ignore[arg-type]
        if stream is not None:
            unanswered = not self.client_side and not stream.responded
            stream.received_reset(int(event.error_code))  # type: ignore[arg-type]
            if unanswered:
                self._count_resets(1)  # work started for nothing: what rapid reset exploits

    def _on_request_received(self, event: ev.RequestReceived) -> None:
        sid: int = event.stream_id  # type: ignore[assignment]
        if self.client_side or self._on_request is None or sid > self._refuse_above:
            self.reset(sid, ErrorCodes.REFUSED_STREAM)
            self._count_resets(1)
            return
        stream = HboneStream(self, sid, high_water=self.settings.server_send_buffer)
        self.streams[sid] = stream
        self._new_requests.append((stream, decode_headers(event.headers)))  # type: ignore[arg-type]

    def _on_response_received(self, event: ev.ResponseReceived) -> None:
        stream = self.streams.get(event.stream_id)  # type: ignore[arg-type]
        if stream is not None:
            stream.received_response(decode_headers(event.headers))  # type: ignore[arg-type]

    def _on_remote_settings(self, event: ev.RemoteSettingsChanged) -> None:
        if not self.remote_settings.done():
            self.remote_settings.set_result(None)
        # Only a grown initial window can unblock a stream: other SETTINGS do not walk them.
        window = event.changed_settings.get(SettingCodes.INITIAL_WINDOW_SIZE)
        if window is not None and self._pending and window.new_value > (window.original_value or 0):
            self._pump_pending()

    def _on_goaway(self, event: ev.ConnectionTerminated) -> None:
        self.goaway_received = True
        self._draining = True
        last = event.last_stream_id or 0
        if event.error_code != ErrorCodes.NO_ERROR:
            self._teardown(ConnectionClosed(f"connection closed by peer: GOAWAY {event.error_code!s}"))
            return
        # Streams we opened that the peer did not process are refused; the others carry on.
        refused = ConnectionClosed("stream refused: peer sent GOAWAY")
        for sid, stream in list(self.streams.items()):
            if sid > last and self._h2._stream_id_is_outbound(sid):
                stream.session_lost(refused)
        self._maybe_close_idle()

    # -- keepalive -----------------------------------------------------------------------------

    def _schedule_ping(self) -> None:
        if self.settings.ping_interval > 0 and not self._dead:
            self._ping_handle = self.loop.call_later(self.settings.ping_interval, self._send_ping)

    def _send_ping(self) -> None:
        self._ping_handle = None
        if self._dead:
            return
        self._ping_count += 1
        try:
            self._h2.ping(self._ping_count.to_bytes(8, "big"))
        except H2Error as e:
            self._teardown(ConnectionClosed(f"keepalive ping failed: {e}"), abort=True)
            return
        self.kick()
        self._pong_handle = self.loop.call_later(self.settings.ping_timeout, self._ping_timed_out)

    def _on_ping_ack(self, event: ev.PingAckReceived) -> None:
        if self._pong_handle is not None:
            self._pong_handle.cancel()
            self._pong_handle = None
            self._schedule_ping()

    def _ping_timed_out(self) -> None:
        self._pong_handle = None
        if self._dead:
            return
        log.warning(
            "hbone: keepalive timeout, no PING reply within %.1fs; closing connection",
            self.settings.ping_timeout,
        )
        if not self.client_side and not self.goaway_sent:
            self.goaway_sent = True
            self._h2.send_goaway(ErrorCodes.NO_ERROR, self._h2.highest_inbound_stream_id)
            self._flush_always()
        self._teardown(ConnectionClosed("keepalive timeout"), abort=True)

    # -- sending -------------------------------------------------------------------------------

    def _flush_always(self) -> None:
        self._unflushed = 0
        if self._acks:
            self._apply_acks()
        h2c = self._h2
        transport = self.transport
        if h2c._chunks:
            chunks = h2c.take_output()
            if transport is not None and not self._transport_gone:
                transport.writelines(chunks)
        elif h2c._data_to_send:
            out = h2c._data_to_send
            h2c._data_to_send = bytearray()
            if transport is not None and not self._transport_gone:
                transport.write(out)

    def kick(self) -> None:
        """Flush now unless a received batch is being handled (its end flushes); streams call this too."""
        if not self._in_batch:
            self._flush_always()

    def open_stream(self, headers: list[tuple[str, str]], *, flush: bool = True) -> HboneStream:
        """Send a request's HEADERS; `flush=False` leaves them queued for the caller's first write."""
        if not self.is_usable():
            raise self.close_reason or ConnectionClosed("connection is not usable (closing)")
        encoder = self._h2.encoder
        try:
            encoder.prepare(headers)
            sid = self._h2.get_next_available_stream_id()
            self._h2.send_headers(sid, headers)
        except H2Error as e:
            raise HboneError(f"cannot open stream: {e}") from e
        finally:
            encoder.discard()
        stream = HboneStream(self, sid, high_water=self.settings.client_send_buffer, client_side=True)
        self.streams[sid] = stream
        if flush:
            self.kick()
        return stream

    def send_headers(
        self, stream_id: int, headers: list[tuple[str, str]], end_stream: bool, *, flush: bool = True
    ) -> bool:
        """Queue HEADERS and flush; `flush=False` leaves them queued for the caller's next flush
        (one TLS record and one syscall for a 200 and the first data)."""
        if self._dead:
            return False
        encoder = self._h2.encoder
        try:
            encoder.prepare(headers)
            self._h2.send_headers(stream_id, headers, end_stream=end_stream)
        except H2Error:
            return False
        finally:
            encoder.discard()
        if flush:
            self.kick()
        return True

    def send_data(self, stream_id: int, data: bytes | memoryview) -> int:
        """Frame as much of `data` as the windows allow; returns how many bytes were taken.

        `data` must not change afterwards: large payloads are queued by reference.
        """
        if self._write_paused or self._dead:
            return 0
        h2c = self._h2
        h2s = h2c.streams.get(stream_id)
        if h2s is None:
            return 0
        state = h2s.state_machine.state
        conn_state = h2c.state_machine.state
        if not (state is _OPEN or state is _HALF_CLOSED_REMOTE) or not (
            conn_state is _CLIENT_OPEN or conn_state is _SERVER_OPEN
        ):
            return 0  # ending or ended: its end (or reset) event drops the rest
        total = len(data)
        n = min(h2c.outbound_flow_control_window, h2s.outbound_flow_control_window, total)
        if n <= 0:
            return 0
        max_frame = h2c.max_outbound_frame_size
        if n == total and n <= max_frame:
            h2c.queue_data(stream_id, data)
            h2c.outbound_flow_control_window -= n
            h2s.outbound_flow_control_window -= n
            self._unflushed += n
            sent = n
        else:
            view = memoryview(data)
            sent = 0
            while sent < n:
                size = min(max_frame, n - sent)
                h2c.queue_data(stream_id, view[sent : sent + size])
                h2c.outbound_flow_control_window -= size
                h2s.outbound_flow_control_window -= size
                self._unflushed += size
                sent += size
                if self._unflushed >= FLUSH_THRESHOLD and not self._in_batch:
                    self._flush_always()
                    if self._write_paused:
                        return sent
        if self._unflushed >= FLUSH_THRESHOLD and not self._in_batch:
            self._flush_always()
        return sent

    def end_stream(self, stream_id: int) -> None:
        if self._dead:
            return
        try:
            self._h2.end_stream(stream_id)
        except H2Error:
            return
        self.kick()

    def reset(self, stream_id: int, error_code: int) -> None:
        if self._dead:
            return
        try:
            self._h2.reset_stream(stream_id, error_code)
        except H2Error:
            return
        self.kick()

    def ack(self, stream_id: int, n: int) -> None:
        """`n` flow-controlled bytes of the stream were consumed: give them back to the peer.

        Summed per stream and handed to h2 at the next flush: the end of the received batch, or
        soon after when this happens outside one.
        """
        if n and not self._dead:
            acks = self._acks
            acks[stream_id] = acks.get(stream_id, 0) + n
            if not self._in_batch:
                self._flush_soon()

    def _flush_soon(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self._scheduled_flush)

    def _scheduled_flush(self) -> None:
        self._flush_scheduled = False
        if not self._dead:
            self.kick()

    def _apply_acks(self) -> None:
        """What was consumed since the last flush, given back through h2's window managers.

        `WindowManager.process_bytes` adds to `_bytes_processed` and then decides; it only ever
        emits an update once half the window is processed or the window is empty, so below that
        the addition alone is the whole effect and the call is skipped.
        """
        acks, self._acks = self._acks, {}
        h2c = self._h2
        streams = h2c.streams
        total = 0
        for sid, n in acks.items():
            total += n
            h2s = streams.get(sid)
            if h2s is None:
                continue
            state = h2s.state_machine.state
            # As h2: only streams still open in some direction get their window back.
            if state is _OPEN or state is _HALF_CLOSED_LOCAL or state is _HALF_CLOSED_REMOTE:
                manager = h2s._inbound_window_manager
                manager._bytes_processed += n
                if (
                    manager._bytes_processed >= manager.max_window_size // 2
                    or not manager.current_window_size
                ):
                    increment = manager._maybe_update_window()
                    if increment:
                        h2c.queue_window_update(sid, increment)
        manager = h2c._inbound_flow_control_window_manager
        manager._bytes_processed += total
        if manager._bytes_processed >= manager.max_window_size // 2 or not manager.current_window_size:
            increment = manager._maybe_update_window()
            if increment:
                h2c.queue_window_update(0, increment)

    def want_window(self, stream: HboneStream) -> None:
        self._pending[stream.stream_id] = stream

    def window_satisfied(self, stream: HboneStream) -> None:
        self._pending.pop(stream.stream_id, None)

    def _pump_pending(self) -> None:
        for stream in list(self._pending.values()):
            if self._write_paused or self._dead:
                return
            stream.window_available()

    def forget(self, stream: HboneStream) -> None:
        self.streams.pop(stream.stream_id, None)
        self._pending.pop(stream.stream_id, None)
        self._maybe_close_idle()

    @property
    def remote_max_concurrent_streams(self) -> int:
        return int(self._h2.remote_settings.max_concurrent_streams)
