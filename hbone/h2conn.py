"""One HBONE HTTP/2 connection: the sans-IO core (`hbone.h2core`) on an asyncio transport.

`H2Session` is the protocol installed on the TLS transport, for both the client and the server side.
It moves bytes between the transport and its `H2Core`, arms the timers the core asks for, and turns
the core's events into calls on the streams (`hbone.stream.HboneStream`). Beside that it owns what
is about I/O: the batching of output (one transport write per received batch), send scheduling of
the streams that wait for flow-control window or for the TLS transport to drain, the PING keepalive,
closing the transport once a drained connection's last stream is over, and tearing everything down.

* receiving: the session is a `BufferedProtocol`, so the TLS layer decrypts straight into a buffer
  of ours (one per thread and nesting level, reused: no allocation per read); the core hands a DATA
  payload out in place (`H2Core.step`: a view of that buffer, no event object), and it goes to its
  stream as it arrives, piece by piece (one copy, out of that buffer).
* sending: the core frames DATA around the payload itself (payloads from 16 KiB on are copied
  only to fill the TLS record of their frame header: the transport gets the rest in a
  `writelines`); received batches are answered with one write.
* window updates: what the streams consumed is given back through the core (`ack`), which sends a
  WINDOW_UPDATE once half a window is consumed; they leave with the next flush.

Requests are handed to `on_request` at the end of the batch that opened them, so a stream reset in
the same batch never starts any work. The abuse limits are the core's; breaking one is a GOAWAY
naming it, a warning, and the end of that connection only. While the transport is over its
high-water mark, reading stops once the replies to what is read pile up (the core says when). A
torn-down session ignores every later byte.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any, cast

from hbone.errors import ConnectionClosed, HboneError
from hbone.h2core import STEP_DATA, STEP_EVENTS, ErrorCode, H2Core, H2UsageError, error_name
from hbone.h2core import events as ev
from hbone.hpack import HeaderFieldError
from hbone.identity import Identity
from hbone.settings import H2Settings
from hbone.stream import HboneStream
from hbone.stream_state import StreamState

log = logging.getLogger("hbone")

# Outgoing frames are handed to the transport at least this often while a large write is framed,
# so the TLS transport's own back-pressure (pause_writing) is seen early.
FLUSH_THRESHOLD = 256 * 1024
# Write-buffer marks of the TLS transport under the session: large, since each write is big.
TRANSPORT_HIGH_WATER = 1024 * 1024
# What the TLS layer may decrypt into our buffer per read.
READ_BUFFER_SIZE = 256 * 1024

Headers = list[tuple[str, str]]

_STREAM_CLOSED = StreamState.CLOSED


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


def _ignore(event: ev.Event) -> None:
    pass


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
        loop = self.loop
        self._core = H2Core(client_side=client_side, settings=settings, now=loop.time(), clock=loop.time)
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
        self._read_paused = False
        self._dead = False
        self._transport_gone = False
        self.close_reason: HboneError | None = None
        self.goaway_received = False
        self.goaway_sent = False
        self._draining = False  # close the transport once the last stream finishes
        self.remote_settings: asyncio.Future[None] = self.loop.create_future()
        self.closed: asyncio.Future[None] = self.loop.create_future()
        self._ping_handle: asyncio.TimerHandle | None = None
        self._pong_handle: asyncio.TimerHandle | None = None
        self._core_timer: asyncio.TimerHandle | None = None
        self._ping_count = 0
        self._flush_scheduled = False
        # Requests of the batch being received: handed to `on_request` at its end, unless reset.
        self._new_requests: list[tuple[HboneStream, Headers]] = []
        self._dispatch: dict[type[ev.Event], Callable[[Any], None]] = {
            ev.DataReceived: self._on_data,
            ev.WindowUpdated: self._on_window_updated,
            ev.StreamEnded: self._on_stream_ended,
            ev.StreamReset: self._on_stream_reset,
            ev.RequestReceived: self._on_request_received,
            ev.ResponseReceived: self._on_response_received,
            ev.SettingsReceived: self._on_remote_settings,
            ev.PingAcked: self._on_ping_ack,
            ev.SettingsAcked: _ignore,
            ev.TrailersReceived: _ignore,  # HBONE carries none worth reading
            ev.GoAwayReceived: self._on_goaway,
            ev.ConnectionTerminated: self._on_terminated,
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
        self._core.set_write_blocked(True)

    def resume_writing(self) -> None:
        self._write_paused = False
        self._core.set_write_blocked(False)
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
        self._core.initiate(self.settings.local_settings(client_side=self.client_side), self.loop.time())
        self.kick()
        self._schedule_ping()
        self._arm_core_timer()
        early, self._early = self._early, None
        for data in early or ():
            if self._dead:
                break
            self._receive(memoryview(data))

    def is_usable(self) -> bool:
        # Sending or receiving a GOAWAY also sets `_draining`.
        return self._started and not (self._dead or self._draining)

    def goaway(self, error_code: int = ErrorCode.NO_ERROR) -> None:
        """Graceful: announce that no new streams are accepted; close once the open ones finish."""
        if self._dead or self.goaway_sent:
            return
        self.goaway_sent = True
        self._draining = True
        if self._started:
            self._core.goaway(error_code)
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
                self._core.goaway(ErrorCode.NO_ERROR)
                self.kick()
            self._teardown(ConnectionClosed("connection closed"), abort=False)

    def _teardown(self, reason: HboneError, *, abort: bool = False) -> None:
        if self._dead:
            return
        self._dead = True
        self.close_reason = reason
        self._early = None
        self._new_requests.clear()
        for handle in (self._ping_handle, self._pong_handle, self._core_timer):
            if handle is not None:
                handle.cancel()
        self._ping_handle = self._pong_handle = self._core_timer = None
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
        core = self._core
        self._in_batch = True
        try:
            core.feed(data)  # no clock read: the core reads `loop.time` if a reset is counted
            dispatch = self._dispatch
            streams = self.streams
            while True:
                step = core.step()
                if step == STEP_DATA:  # a DATA payload, in place: no event object
                    stream = streams.get(core.data_stream_id)
                    if stream is None:
                        core.ack(core.data_stream_id, core.data_flow)
                    else:
                        stream.received_data(core.data.tobytes(), core.data_flow)
                elif step == STEP_EVENTS:
                    for event in core.take_events():
                        dispatch[type(event)](event)
                        if self._dead:
                            return
                else:
                    break
                if self._dead:
                    return
            if self._new_requests:
                self._start_requests()
        finally:
            self._in_batch = False
        if self._dead:
            return
        self._flush_always()
        if core.reading_should_pause and not self._read_paused:
            # The peer does not read what we send: stop reading what makes us reply.
            transport = self.transport
            if transport is not None and not self._transport_gone:
                self._read_paused = True
                transport.pause_reading()
        if self._core_timer is not None and core.deadline() is None:
            self._core_timer.cancel()
            self._core_timer = None

    def _arm_core_timer(self) -> None:
        deadline = self._core.deadline()
        if deadline is not None and not self._dead:
            self._core_timer = self.loop.call_at(deadline, self._core_timer_fired)

    def _core_timer_fired(self) -> None:
        self._core_timer = None
        if self._dead:
            return
        for event in self._core.timer(self.loop.time()):
            self._dispatch[type(event)](event)
        if not self._dead:
            self._arm_core_timer()

    def _on_terminated(self, event: ev.ConnectionTerminated) -> None:
        if event.limit:
            log.warning(
                "hbone: closing the connection of %s (%s) with GOAWAY %s: %s",
                self.extra.get("peername"),
                self.peer_identity,
                error_name(event.error_code),
                event.message,
            )
        self.goaway_sent = True
        self._flush_always()  # the core queued a GOAWAY naming the error
        self._teardown(ConnectionClosed(f"http2 protocol error: {event.message}"))

    def _start_requests(self) -> None:
        new, self._new_requests = self._new_requests, []
        on_request = self._on_request
        assert on_request is not None  # only the server side queues requests
        for stream, headers in new:
            if stream.state is not _STREAM_CLOSED and not self._dead:
                on_request(stream, headers)

    def _on_data(self, event: ev.DataReceived) -> None:
        stream = self.streams.get(event.stream_id)
        if stream is None:
            self._core.ack(event.stream_id, event.flow_length)
            return
        stream.received_data(event.data, event.flow_length)

    def _on_window_updated(self, event: ev.WindowUpdated) -> None:
        if not self._pending:
            return
        if event.stream_id == 0:
            self._pump_pending()
        else:
            stream = self._pending.get(event.stream_id)
            if stream is not None:
                stream.window_available()

    def _on_stream_ended(self, event: ev.StreamEnded) -> None:
        stream = self.streams.get(event.stream_id)
        if stream is not None:
            stream.received_end()

    def _on_stream_reset(self, event: ev.StreamReset) -> None:
        stream = self.streams.get(event.stream_id)
        if stream is not None:
            stream.received_reset(event.error_code)

    def _on_request_received(self, event: ev.RequestReceived) -> None:
        sid = event.stream_id
        if self._on_request is None:
            self._core.reset_stream(sid, ErrorCode.REFUSED_STREAM)
            return
        stream = HboneStream(self, sid, high_water=self.settings.server_send_buffer)
        self.streams[sid] = stream
        self._new_requests.append((stream, event.headers))

    def _on_response_received(self, event: ev.ResponseReceived) -> None:
        stream = self.streams.get(event.stream_id)
        if stream is not None:
            stream.received_response(event.headers)

    def _on_remote_settings(self, event: ev.SettingsReceived) -> None:
        if not self.remote_settings.done():
            self.remote_settings.set_result(None)

    def _on_goaway(self, event: ev.GoAwayReceived) -> None:
        self.goaway_received = True
        self._draining = True
        if event.error_code != ErrorCode.NO_ERROR:
            self._teardown(
                ConnectionClosed(f"connection closed by peer: GOAWAY {error_name(event.error_code)}")
            )
            return
        # Streams we opened that the peer did not process are refused; the others carry on.
        refused = ConnectionClosed("stream refused: peer sent GOAWAY")
        for sid in event.refused:
            stream = self.streams.get(sid)
            if stream is not None:
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
        self._core.ping(self._ping_count.to_bytes(8, "big"))
        self.kick()
        self._pong_handle = self.loop.call_later(self.settings.ping_timeout, self._ping_timed_out)

    def _on_ping_ack(self, event: ev.PingAcked) -> None:
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
            self._core.goaway(ErrorCode.NO_ERROR)
            self._flush_always()
        self._teardown(ConnectionClosed("keepalive timeout"), abort=True)

    # -- sending -------------------------------------------------------------------------------

    def _flush_always(self) -> None:
        self._unflushed = 0
        chunks = self._core.take_output()
        if not chunks:
            return
        transport = self.transport
        if transport is not None and not self._transport_gone:
            if len(chunks) == 1:
                transport.write(chunks[0])
            else:
                transport.writelines(chunks)

    def kick(self) -> None:
        """Flush now unless a received batch is being handled (its end flushes); streams call this too."""
        if not self._in_batch:
            self._flush_always()

    def open_stream(self, headers: list[tuple[str, str]], *, flush: bool = True) -> HboneStream:
        """Send a request's HEADERS; `flush=False` leaves them queued for the caller's first write."""
        if not self.is_usable():
            raise self.close_reason or ConnectionClosed("connection is not usable (closing)")
        try:
            sid = self._core.open_stream(headers)
        except (H2UsageError, HeaderFieldError) as e:
            raise HboneError(f"cannot open stream: {e}") from e
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
        try:
            if not self._core.send_headers(stream_id, headers, end_stream):
                return False
        except HeaderFieldError:
            return False
        if flush:
            self.kick()
        return True

    def send_data(self, stream_id: int, data: bytes | memoryview) -> int:
        """Frame as much of `data` as the windows allow; returns how many bytes were taken.

        `data` must not change afterwards: large payloads are queued by reference.
        """
        if self._write_paused or self._dead:
            return 0
        core = self._core
        total = len(data)
        if total <= FLUSH_THRESHOLD:
            sent = core.send_data(stream_id, data)
            self._unflushed += sent
        else:
            view = memoryview(data)
            sent = 0
            while sent < total:
                n = core.send_data(stream_id, view[sent : sent + FLUSH_THRESHOLD])
                sent += n
                self._unflushed += n
                if n < FLUSH_THRESHOLD:
                    break  # a window is spent
                if self._unflushed >= FLUSH_THRESHOLD and not self._in_batch:
                    self._flush_always()
                    if self._write_paused:
                        return sent
        if self._unflushed >= FLUSH_THRESHOLD and not self._in_batch:
            self._flush_always()
        return sent

    def end_stream(self, stream_id: int) -> None:
        if not self._dead and self._core.end_stream(stream_id):
            self.kick()

    def reset(self, stream_id: int, error_code: int) -> None:
        if not self._dead and self._core.reset_stream(stream_id, error_code):
            self.kick()

    def ack(self, stream_id: int, n: int) -> None:
        """`n` flow-controlled bytes of the stream were consumed: give them back to the peer (the
        core sends a WINDOW_UPDATE past half a window); they leave with the end of the received
        batch, or soon after when this happens outside one."""
        if n and not self._dead:
            core = self._core
            core.ack(stream_id, n)
            if not self._in_batch and core.has_output():
                self._flush_soon()

    def _flush_soon(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self._scheduled_flush)

    def _scheduled_flush(self) -> None:
        self._flush_scheduled = False
        if not self._dead:
            self.kick()

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
        return self._core.peer_max_streams
