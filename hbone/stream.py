"""One HBONE CONNECT stream, presented as an `asyncio.Transport`.

A generic relay splices it with a TCP transport: bytes written become DATA frames as the peer's
flow-control window allows (the rest is buffered, with `pause_writing`/`resume_writing` on the
write-buffer marks); received DATA is handed to the protocol and the receive window is released as
it is consumed, so a paused reader stops the peer. `write_eof` sends END_STREAM; END_STREAM and a
clean reset (NO_ERROR, CANCEL) arrive as `eof_received`; any other reset ends the stream with
`StreamResetError`; a dead connection ends it with `ConnectionClosed`.

The module owns both sides of the session/stream boundary as typed protocols: `StreamSession` is
what a stream needs of its HTTP/2 connection, `SessionStream` the events the connection delivers
to a stream. The stream's life cycle is one `StreamState`, changed only through `TRANSITIONS`
(the two directions' ends, the EOF handed to the protocol, `close()`), as h11 does for HTTP/1.1.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from hbone.errors import HboneError, StreamResetError
from hbone.h2core.codes import ErrorCode
from hbone.identity import Identity
from hbone.stream_state import TRANSITIONS, StreamEvent, StreamState

log = logging.getLogger("hbone")

_CLEAN_RESETS = (ErrorCode.NO_ERROR, ErrorCode.CANCEL)


class StreamSession(Protocol):
    """What a stream needs of the HTTP/2 connection it belongs to (`hbone.h2conn.H2Session`)."""

    loop: asyncio.AbstractEventLoop
    extra: dict[str, Any]
    peer_identity: Identity | None

    @property
    def transport(self) -> asyncio.Transport | None: ...

    def send_data(self, stream_id: int, data: bytes | memoryview) -> int: ...

    def send_headers(
        self, stream_id: int, headers: list[tuple[str, str]], end_stream: bool, *, flush: bool = True
    ) -> bool: ...

    def end_stream(self, stream_id: int) -> None: ...

    def reset(self, stream_id: int, error_code: int) -> None: ...

    def ack(self, stream_id: int, n: int) -> None: ...

    def kick(self) -> None: ...

    def want_window(self, stream: HboneStream) -> None: ...

    def window_satisfied(self, stream: HboneStream) -> None: ...

    def forget(self, stream: HboneStream) -> None: ...


class SessionStream(Protocol):
    """The events an HTTP/2 connection delivers to one of its streams (`HboneStream` is one)."""

    def received_data(self, data: bytes, flow_len: int) -> None:
        """A DATA payload (`flow_len` flow-controlled bytes, padding included) arrived."""

    def received_end(self) -> None:
        """The peer ended its direction (END_STREAM)."""

    def received_reset(self, error_code: int) -> None:
        """The peer reset the stream (RST_STREAM)."""

    def received_response(self, headers: list[tuple[str, str]]) -> None:
        """Client side: the response HEADERS arrived."""

    def window_available(self) -> None:
        """The send window grew, or the connection's transport drained: send what waits."""

    def session_lost(self, reason: HboneError) -> None:
        """The connection is gone, or refused the stream (GOAWAY)."""


_OPEN = StreamState.OPEN
_CLOSED = StreamState.CLOSED
_BOTH_ENDED = StreamState.BOTH_ENDED
_RECV_DONE = StreamState.RECV_DONE

_SEND_END = StreamEvent.SEND_END
_RECV_END = StreamEvent.RECV_END
_EOF_DELIVERED = StreamEvent.EOF_DELIVERED
_CLOSE = StreamEvent.CLOSE
_RESET = StreamEvent.RESET


class HboneStream(asyncio.Transport):
    """A CONNECT stream. Data received before the first `set_protocol` is held, unacknowledged.

    Server side, `on_abandoned` (if set) is called once when the peer resets the stream or the
    connection is lost before the stream was answered: whoever works on the answer can stop.
    """

    # One per proxied connection on each side, most of them idle: slots, and the two queues
    # (a deque is ~600 bytes even empty) only exist while something waits in them.
    __slots__ = (
        "_client_side",
        "_deliver_scheduled",
        "_eof_requested",
        "_high",
        "_inbox",
        "_loop",
        "_lost_delivered",
        "_lost_exc",
        "_low",
        "_outbox",
        "_outbox_size",
        "_protocol",
        "_reading",
        "_response",
        "_session",
        "_state",
        "_writer_paused",
        "on_abandoned",
        "responded",
        "response_headers",
        "status",
        "stream_id",
    )

    def __init__(
        self, session: StreamSession, stream_id: int, *, high_water: int, client_side: bool = False
    ) -> None:
        # No `super().__init__()`: all it does is store an `extra` mapping in a slot of
        # asyncio.BaseTransport, which `get_extra_info` below never reads; and the compiled build's
        # deallocator does not release slots of an interpreted base class, so that mapping (an
        # empty dict) outlived every stream: a leak of 64 bytes per stream, for good.
        self._session = session
        self._loop = session.loop
        self.stream_id = stream_id
        self._client_side = client_side
        self._state = _OPEN
        self.status: int | None = None
        self.response_headers: list[tuple[str, str]] = []
        self._response: asyncio.Future[None] | None = self._loop.create_future() if client_side else None
        self._protocol: asyncio.BaseProtocol | None = None
        # inbound
        self._inbox: deque[tuple[bytes, int]] | None = None
        self._reading = True
        self._deliver_scheduled = False
        # outbound
        self._outbox: deque[bytes | memoryview] | None = None
        self._outbox_size = 0
        self._eof_requested = False  # write_eof/close called: END_STREAM after the outbox
        self._high = high_water
        self._low = high_water // 4
        self._writer_paused = False
        # the end
        self._lost_exc: Exception | None = None
        self._lost_delivered = False
        self.responded = False  # server side: a response was sent
        self.on_abandoned: Callable[[], object] | None = None

    def __repr__(self) -> str:
        return f"<HboneStream id={self.stream_id} state={self._state.name}>"

    @property
    def state(self) -> StreamState:
        return self._state

    def _advance(self, event: StreamEvent) -> None:
        new = TRANSITIONS.get((self._state, event))
        if new is None:
            return
        if new is _CLOSED:
            self._finish(None)
        else:
            self._state = new

    # -- asyncio.BaseTransport -----------------------------------------------------------------

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "peer_identity":
            return self._session.peer_identity
        if name == "stream_id":
            return self.stream_id
        value = self._session.extra.get(name)
        if value is None and self._session.transport is not None:
            value = self._session.transport.get_extra_info(name)
        return default if value is None else value

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._protocol = protocol
        if self._state is _CLOSED:
            if not self._lost_delivered:
                self._lost_delivered = True
                self._loop.call_soon(self._call_connection_lost, self._lost_exc)
        elif self._reading and (self._inbox or self._state.eof_pending):
            self._schedule_delivery()

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._protocol  # type: ignore[return-value]

    def is_closing(self) -> bool:
        return self._state.closing

    def close(self) -> None:
        """Stop reading; send the buffered bytes, then END_STREAM. Done when the peer ends too."""
        if self._state.closing:
            return
        self._reading = False
        self._drop_inbox()
        self._advance(_CLOSE)
        self.write_eof()

    # -- asyncio.ReadTransport -----------------------------------------------------------------

    def is_reading(self) -> bool:
        return self._reading and not self._state.closing

    def pause_reading(self) -> None:
        self._reading = False

    def resume_reading(self) -> None:
        if self._reading or self._state.closing:
            return
        self._reading = True
        if self._inbox or self._state.eof_pending:
            self._schedule_delivery()

    # -- asyncio.WriteTransport ----------------------------------------------------------------

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        if high is None:
            high = 64 * 1024 if low is None else 4 * low
        if low is None:
            low = high // 4
        if not high >= low >= 0:
            raise ValueError(f"high ({high!r}) must be >= low ({low!r}) must be >= 0")
        self._high, self._low = high, low
        self._maybe_pause_writer()

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return (self._low, self._high)

    def get_write_buffer_size(self) -> int:
        return self._outbox_size

    def write(self, data: bytes | bytearray | memoryview) -> None:
        state = self._state
        if state.closing:
            return  # like a closed socket transport: dropped
        if self._eof_requested:
            raise RuntimeError("Cannot call write() after write_eof()")
        if state.local_ended:
            return  # reset: nowhere to send
        if not data:
            return
        if not isinstance(data, bytes):
            data = bytes(data)  # the caller may reuse its buffer; bytes are queued by reference
        session = self._session
        outbox = self._outbox
        if outbox:
            outbox.append(data)
            self._outbox_size += len(data)
        else:
            n = session.send_data(self.stream_id, data)
            if n < len(data):
                rest = memoryview(data)[n:]
                if outbox is None:
                    outbox = self._outbox = deque()
                outbox.append(rest)
                self._outbox_size += len(rest)
                session.want_window(self)
        session.kick()
        if self._outbox_size > self._high:
            self._maybe_pause_writer()

    def writelines(self, list_of_data: Any) -> None:
        self.write(b"".join(list_of_data))

    def write_eof(self) -> None:
        if self._eof_requested or self._state.local_ended:
            return
        self._eof_requested = True
        if not self._outbox:
            self._send_end()

    def can_write_eof(self) -> bool:
        return True

    def abort(self) -> None:
        """Reset the stream (RST_STREAM CANCEL) unless it already ended both ways."""
        self.reset(ErrorCode.CANCEL)

    def reset(self, error_code: int = ErrorCode.CANCEL) -> None:
        """End the stream now with RST_STREAM(`error_code`); the protocol gets connection_lost(None)."""
        state = self._state
        if state is _CLOSED:
            return
        if not (state.local_ended and state.remote_ended):
            self._session.reset(self.stream_id, error_code)
        self._drop_inbox()
        self._drop_outbox()
        self._finish(None)

    # -- server side ---------------------------------------------------------------------------

    def respond(self, status: int, headers: Sequence[tuple[str, str]] = ()) -> None:
        """Send the response HEADERS; any status but 200 ends the stream (see `ConnectRequest`)."""
        if self.responded:
            raise RuntimeError("already responded")
        self.responded = True
        if self._state is _CLOSED:
            return  # reset by the client meanwhile
        end = status != 200
        if not self._session.send_headers(
            self.stream_id, [(":status", str(status)), *headers], end_stream=end, flush=end
        ):
            end = True  # the stream is gone (reset by the client): nothing more to send or read
        elif not end:
            # The 200 leaves with the first delivery callback, after the caller has set its
            # protocol: the bytes that came with the request, and the answer they get at once,
            # share its TLS record and syscall.
            self._schedule_delivery()
        if end:
            if not self._state.remote_ended:
                # RFC 9113 §8.1: a complete response before the request ended; stop the request.
                self._session.reset(self.stream_id, ErrorCode.NO_ERROR)
            self._finish(None)

    # -- client side ---------------------------------------------------------------------------

    async def wait_response(self) -> None:
        assert self._response is not None
        await self._response
        self._response = None  # answered: nothing more to wait for

    def refused(self) -> None:
        """After a non-200 response: end our side too (the server normally ended its side)."""
        if self._state.remote_ended:
            self.close()
        else:
            self.abort()

    def _fail_response(self, exc: Exception) -> None:
        if self._response is not None and not self._response.done():
            self._response.set_exception(exc)
            self._response.exception()  # a cancelled connect() would otherwise leave it unretrieved

    # -- events from the session (`SessionStream`) -----------------------------------------------

    def received_response(self, headers: list[tuple[str, str]]) -> None:
        status = next((v for k, v in headers if k == ":status"), "")
        if status.startswith("1"):
            return  # informational
        try:
            self.status = int(status)
        except ValueError:
            self.status = 0
        self.response_headers = [(k, v) for k, v in headers if not k.startswith(":")]
        if self._response is not None and not self._response.done():
            self._response.set_result(None)

    def received_data(self, data: bytes, flow_len: int) -> None:
        if self._state.closing:
            self._session.ack(self.stream_id, flow_len)
            return
        if self._reading and self._protocol is not None and not self._inbox and not self._deliver_scheduled:
            self._session.ack(self.stream_id, flow_len)
            if data:
                try:
                    self._protocol.data_received(data)  # type: ignore[attr-defined]
                except Exception:
                    self._protocol_failed("data_received")
            return
        if self._inbox is None:
            self._inbox = deque()
        self._inbox.append((data, flow_len))

    def received_end(self) -> None:
        closing = self._state.closing
        self._advance(_RECV_END)
        if not closing and self._reading and self._protocol is not None and not self._deliver_scheduled:
            self._deliver()

    def received_reset(self, error_code: int) -> None:
        if self._state is _CLOSED:
            return
        self._drop_outbox()
        if self._response is not None and not self._response.done():
            self._fail_response(StreamResetError(error_code))
        clean = error_code in _CLEAN_RESETS
        if not self._client_side and not self.responded:
            self._abandon()  # reset before it was answered: nobody will read it
            return
        if clean and not self._state.closing:
            self._advance(_RESET)
            state = self._state
            if (
                state.eof_pending
                and self._reading
                and self._protocol is not None
                and not self._deliver_scheduled
            ):
                self._deliver()
            return
        self._drop_inbox()
        self._finish(None if clean else StreamResetError(error_code))

    def window_available(self) -> None:
        """Send buffered bytes as the window allows (called by the session on WINDOW_UPDATE)."""
        outbox = self._outbox
        session = self._session
        while outbox:
            head = outbox[0]
            n = session.send_data(self.stream_id, head)
            self._outbox_size -= n
            if n == len(head):
                outbox.popleft()
            else:
                if n:
                    outbox[0] = memoryview(head)[n:]
                break
        if not outbox:
            self._outbox = None  # drained: an idle stream keeps no queue
            session.window_satisfied(self)
            if self._eof_requested and not self._state.local_ended:
                self._send_end()
        if self._writer_paused and self._outbox_size <= self._low:
            self._writer_paused = False
            if self._protocol is not None:
                try:
                    self._protocol.resume_writing()
                except Exception:
                    self._protocol_failed("resume_writing")

    def session_lost(self, reason: HboneError) -> None:
        if self._state is _CLOSED:
            return
        self._fail_response(reason)
        self._inbox = None
        self._drop_outbox()
        if not self._client_side and not self.responded:
            self._abandon()
            return
        self._finish(reason)

    def _abandon(self) -> None:
        self._drop_inbox()
        self._finish(None)
        hook, self.on_abandoned = self.on_abandoned, None
        if hook is not None:
            try:
                hook()
            except Exception:
                log.exception("hbone: stream %d: on_abandoned failed", self.stream_id)

    # -- delivery --------------------------------------------------------------------------------

    def _schedule_delivery(self) -> None:
        if not self._deliver_scheduled:
            self._deliver_scheduled = True
            self._loop.call_soon(self._deliver_soon)

    def _deliver_soon(self) -> None:
        self._deliver_scheduled = False
        self._deliver()
        self._session.kick()  # window updates for what was consumed

    def _deliver(self) -> None:
        protocol = self._protocol
        if protocol is None or self._state is _CLOSED:
            return
        inbox = self._inbox
        while inbox and self._reading and not self._state.closing:
            data, n = inbox.popleft()
            self._session.ack(self.stream_id, n)
            if data:
                try:
                    protocol.data_received(data)  # type: ignore[attr-defined]
                except Exception:
                    self._protocol_failed("data_received")
                    return
        if self._state.eof_pending and not inbox and self._reading:
            self._advance(_EOF_DELIVERED)
            try:
                keep_open = protocol.eof_received()  # type: ignore[attr-defined]
            except Exception:
                self._protocol_failed("eof_received")
                return
            if not keep_open:
                self.close()
        if self._inbox is not None and not self._inbox:
            self._inbox = None  # drained: an idle stream keeps no queue

    def _protocol_failed(self, callback: str) -> None:
        log.exception("hbone: stream %d: protocol %s failed; resetting the stream", self.stream_id, callback)
        self.abort()

    # -- sending ---------------------------------------------------------------------------------

    def _maybe_pause_writer(self) -> None:
        if not self._writer_paused and self._outbox_size > self._high and self._protocol is not None:
            self._writer_paused = True
            try:
                self._protocol.pause_writing()
            except Exception:
                self._protocol_failed("pause_writing")

    def _send_end(self) -> None:
        self._session.end_stream(self.stream_id)
        self._advance(_SEND_END)

    def _drop_outbox(self) -> None:
        self._outbox = None
        self._outbox_size = 0
        self._session.window_satisfied(self)

    def _drop_inbox(self) -> None:
        # Unread bytes still occupy the connection window: release it.
        inbox, self._inbox = self._inbox, None
        while inbox:
            _, n = inbox.popleft()
            self._session.ack(self.stream_id, n)

    # -- the end -------------------------------------------------------------------------------

    def _finish(self, exc: Exception | None) -> None:
        if self._state is _CLOSED:
            return
        self._state = _CLOSED
        self._lost_exc = exc
        self._drop_inbox()
        self._session.forget(self)
        if self._protocol is not None and not self._lost_delivered:
            self._lost_delivered = True
            self._loop.call_soon(self._call_connection_lost, exc)

    def _call_connection_lost(self, exc: Exception | None) -> None:
        if self._protocol is None:
            return
        try:
            self._protocol.connection_lost(exc)
        except Exception:
            log.exception("hbone: stream %d: protocol connection_lost failed", self.stream_id)
