"""gRPC calls over one HTTP/2 connection: the sans-IO cores (`hbone.h2core`, `xds.grpc.wire`) on an
asyncio transport, TCP or TLS.

`connect()` opens the connection (TCP keepalive set, TLS with ALPN `h2` when a context is given),
sends the HTTP/2 preface and returns once the server's SETTINGS arrived. `GrpcConnection.call()`
opens a stream; a `Call` writes messages (within the flow-control windows: a writer waits for
WINDOW_UPDATE) and reads them, then the status. Received bytes are given back to the server's
windows as they are read, so a server can never send more than a window ahead of a slow reader.
A keepalive PING goes out every `ping_interval`; without its ACK within `ping_timeout` the
connection is closed. What ends the connection (the server's close, a GOAWAY with an error, a
protocol error, the keepalive) ends every call on it with UNAVAILABLE (or INTERNAL for a protocol
error), naming why; a graceful GOAWAY lets the calls the server took finish.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
import ssl
from typing import cast

from hbone.h2core import ErrorCode, H2Core, H2UsageError, error_name
from hbone.h2core import events as ev
from hbone.hpack import HeaderFieldError
from hbone.settings import H2Settings
from xds.grpc.wire import (
    CallState,
    RpcError,
    Status,
    StatusCode,
    frame_message,
    request_headers,
)

# TCP keepalive of the reference's control-plane channel: 300 s idle, 75 s between probes, 9 probes.
TCP_KEEPALIVE = (300, 75, 9)


def unavailable(details: str) -> Status:
    return Status(StatusCode.UNAVAILABLE, details)


class Call:
    """One call (stream). `write` and `done_writing` send; `read` returns the next message, None
    once the call ended with OK, or raises `RpcError` with its status."""

    def __init__(self, connection: GrpcConnection, stream_id: int, max_message: int) -> None:
        self._connection = connection
        self.stream_id = stream_id
        self.state = CallState(max_message)
        self._messages: collections.deque[bytes] = collections.deque()
        self._held = 0  # received flow-controlled bytes not given back while messages wait unread
        self._changed = asyncio.Event()  # a message, the end, or send window
        self._deadline: asyncio.TimerHandle | None = None

    @property
    def done(self) -> bool:
        return self.state.status is not None

    def set_deadline(self, timeout: float) -> None:
        loop = self._connection.loop
        self._deadline = loop.call_later(
            timeout, self.cancel, Status(StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
        )

    async def write(self, message: bytes) -> None:
        """Send one message, waiting for the windows as needed; raises RpcError once the call ended."""
        view = memoryview(frame_message(message))
        while True:
            status = self.state.status
            if status is not None:
                raise RpcError(status if status.code is not StatusCode.OK else _ended_before_write())
            sent = self._connection.send_data(self.stream_id, view)
            view = view[sent:]
            if not view:
                return
            if not sent and not self._connection.can_send(self.stream_id):
                raise RpcError(Status(StatusCode.INTERNAL, "the call's stream is closed for sending"))
            self._changed.clear()
            await self._changed.wait()

    def done_writing(self) -> None:
        """END_STREAM: the client sends no more messages."""
        if not self.done:
            self._connection.end_stream(self.stream_id)

    async def read(self) -> bytes | None:
        while True:
            if self._messages:
                message = self._messages.popleft()
                if not self._messages and self._held:
                    self._connection.ack(self.stream_id, self._held)
                    self._held = 0
                return message
            status = self.state.status
            if status is not None:
                if status.code is StatusCode.OK:
                    return None
                raise RpcError(status)
            self._changed.clear()
            await self._changed.wait()

    def cancel(self, status: Status | None = None) -> None:
        """End the call here (RST_STREAM CANCEL): its readers and writers get `status`."""
        if self.done:
            return
        self.finish(status or Status(StatusCode.CANCELLED, "cancelled by the client"))
        self._connection.reset(self.stream_id)

    # -- from the connection ---------------------------------------------------------------------

    def responded(self, headers: list[tuple[str, str]], end_stream: bool) -> None:
        """The response's HEADERS. One that ends the call without ending the stream (an HTTP status
        other than 200, not gRPC's content type) ends it here: the server is told to stop, and the
        readers learn it now rather than whenever the stream ends, if ever."""
        self.state.response(headers, end_stream)
        status = self.state.status
        if status is not None and not end_stream:
            self._connection.reset(self.stream_id)
            self.finish(status)

    def received(self, data: bytes, flow_length: int) -> None:
        messages = self.state.data(data)
        self._messages.extend(messages)
        self._held += flow_length
        if not self._messages:
            self._connection.ack(self.stream_id, self._held)
            self._held = 0
        if self.state.status is not None:  # a message over the limit: the server is told to stop
            self._connection.reset(self.stream_id)
            self.finish(self.state.status)
        elif messages:
            self._changed.set()

    def finish(self, status: Status | None = None) -> None:
        """The call is over (`status` when nothing said so yet); wake everyone."""
        if status is not None:
            self.state.lost(status)
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._connection.forget(self)
        self._changed.set()

    def window(self) -> None:
        self._changed.set()


def _ended_before_write() -> Status:
    return Status(StatusCode.INTERNAL, "the server ended the call before the client finished writing")


class GrpcConnection(asyncio.Protocol):
    """One HTTP/2 connection to a gRPC server, carrying any number of calls."""

    def __init__(self, *, authority: str, tls: bool, settings: H2Settings, max_message: int) -> None:
        self.loop = asyncio.get_running_loop()
        self.authority = authority
        self.tls = tls
        self.settings = settings
        self.max_message = max_message
        self._core = H2Core(client_side=True, settings=settings, now=self.loop.time())
        self.transport: asyncio.Transport | None = None
        self.calls: dict[int, Call] = {}
        self.ready: asyncio.Future[None] = self.loop.create_future()
        self.closed_status: Status | None = None
        self._writable = True
        self._goaway = False
        self._ping_handle: asyncio.TimerHandle | None = None
        self._pong_handle: asyncio.TimerHandle | None = None
        self._core_timer: asyncio.TimerHandle | None = None
        self._pings = 0
        self._in_batch = False

    @property
    def usable(self) -> bool:
        return self.closed_status is None and not self._goaway

    # -- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError, AttributeError):
                idle, interval, count = TCP_KEEPALIVE
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, count)
        now = self.loop.time()
        self._core.initiate(self.settings.local_settings(client_side=True), now)
        self._flush()
        self._arm_core_timer()
        self._schedule_ping()

    def data_received(self, data: bytes) -> None:
        if self.closed_status is not None:
            return
        self._in_batch = True
        try:
            for event in self._core.receive(data, self.loop.time()):
                self._on_event(event)
                if self.closed_status is not None:
                    return
        finally:
            self._in_batch = False
        self._flush()

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is None:
            why = "the server closed the connection"
            if self._goaway:
                why = "received prior goaway: the server closed the connection"
        else:
            why = f"connection lost: {exc}"
        self._lose(unavailable(why), close=False)

    def pause_writing(self) -> None:
        self._writable = False
        self._core.set_write_blocked(True)

    def resume_writing(self) -> None:
        self._writable = True
        self._core.set_write_blocked(False)
        for call in list(self.calls.values()):
            call.window()

    # -- events --------------------------------------------------------------------------------

    def _on_event(self, event: ev.Event) -> None:
        if isinstance(event, ev.DataReceived):
            call = self.calls.get(event.stream_id)
            if call is None:
                self._core.ack(event.stream_id, event.flow_length)
            else:
                call.received(event.data, event.flow_length)
        elif isinstance(event, ev.ResponseReceived):
            call = self.calls.get(event.stream_id)
            if call is not None:
                call.responded(event.headers, event.end_stream)
        elif isinstance(event, ev.TrailersReceived):
            call = self.calls.get(event.stream_id)
            if call is not None:
                call.state.trailers(event.headers)
        elif isinstance(event, ev.StreamEnded):
            call = self.calls.get(event.stream_id)
            if call is not None:
                call.state.ended()
                call.finish()
        elif isinstance(event, ev.StreamReset):
            call = self.calls.get(event.stream_id)
            if call is not None:
                call.state.reset(event.error_code)
                call.finish()
        elif isinstance(event, ev.WindowUpdated):
            targets = self.calls.values() if event.stream_id == 0 else [self.calls.get(event.stream_id)]
            for call in list(targets):
                if call is not None:
                    call.window()
        else:
            self._on_connection_event(event)

    def _on_connection_event(self, event: ev.Event) -> None:
        if isinstance(event, ev.SettingsReceived):
            if not self.ready.done():
                self.ready.set_result(None)
        elif isinstance(event, ev.PingAcked):
            if self._pong_handle is not None:
                self._pong_handle.cancel()
                self._pong_handle = None
                self._schedule_ping()
        elif isinstance(event, ev.GoAwayReceived):
            self._goaway = True
            debug = event.debug.decode("utf-8", "replace")
            why = f"received prior goaway: {error_name(event.error_code)}" + (f" ({debug})" if debug else "")
            if event.error_code != ErrorCode.NO_ERROR:
                self._lose(unavailable(why))
                return
            for sid in event.refused:  # not processed by the server: safe to try again
                call = self.calls.get(sid)
                if call is not None:
                    call.finish(unavailable(why))
            self._close_if_idle()
        elif isinstance(event, ev.ConnectionTerminated):
            self._flush()  # the core queued a GOAWAY naming the error
            self._lose(Status(StatusCode.INTERNAL, f"HTTP/2 protocol error: {event.message}"))

    # -- commands of the calls ----------------------------------------------------------------

    def call(self, path: str, metadata: list[tuple[str, str]], timeout: float | None = None) -> Call:
        """Open a call's stream (its HEADERS leave at once); raises RpcError when it cannot."""
        if self.closed_status is not None:
            raise RpcError(self.closed_status)
        try:
            headers = request_headers(self.authority, path, tls=self.tls, timeout=timeout, metadata=metadata)
            sid = self._core.open_stream(headers)
        except (H2UsageError, HeaderFieldError, ValueError) as e:
            kind = StatusCode.UNAVAILABLE if isinstance(e, H2UsageError) else StatusCode.INTERNAL
            raise RpcError(Status(kind, f"cannot start the call: {e}")) from None
        call = Call(self, sid, self.max_message)
        self.calls[sid] = call
        if timeout is not None:
            call.set_deadline(timeout)
        self._flush()
        return call

    def send_data(self, stream_id: int, data: memoryview) -> int:
        if not self._writable or self.closed_status is not None:
            return 0
        n = self._core.send_data(stream_id, data)
        self._flush()
        return n

    def can_send(self, stream_id: int) -> bool:
        """The stream is open our way (it may still be waiting for window or the transport)."""
        stream = self._core.streams.get(stream_id)
        return self.closed_status is None and stream is not None and not stream.local_ended

    def end_stream(self, stream_id: int) -> None:
        if self.closed_status is None and self._core.end_stream(stream_id):
            self._flush()

    def reset(self, stream_id: int) -> None:
        if self.closed_status is None and self._core.reset_stream(stream_id, ErrorCode.CANCEL):
            self._flush()

    def ack(self, stream_id: int, n: int) -> None:
        if n and self.closed_status is None:
            self._core.ack(stream_id, n)
            self._flush()

    def forget(self, call: Call) -> None:
        self.calls.pop(call.stream_id, None)
        self._close_if_idle()

    # -- life ------------------------------------------------------------------------------------

    def close(self) -> None:
        """Cancel every call and close the connection (GOAWAY first)."""
        if self.closed_status is not None:
            return
        self._core.goaway(ErrorCode.NO_ERROR)
        self._flush()
        self._lose(Status(StatusCode.CANCELLED, "the channel was closed"))

    def _close_if_idle(self) -> None:
        if self._goaway and not self.calls and self.closed_status is None:
            self._lose(unavailable("received prior goaway: the connection is closing"))

    def _lose(self, status: Status, *, close: bool = True) -> None:
        if self.closed_status is not None:
            return
        self.closed_status = status
        for handle in (self._ping_handle, self._pong_handle, self._core_timer):
            if handle is not None:
                handle.cancel()
        if not self.ready.done():
            self.ready.set_exception(RpcError(status))
            self.ready.exception()  # retrieved: `connect` reports it
        for call in list(self.calls.values()):
            call.finish(status)
        self.calls.clear()
        if close and self.transport is not None:
            self.transport.close()

    def _flush(self) -> None:
        if self._in_batch:
            return
        chunks = self._core.take_output()
        transport = self.transport
        if chunks and transport is not None and not transport.is_closing():
            transport.writelines(chunks)

    def _arm_core_timer(self) -> None:
        deadline = self._core.deadline()
        if deadline is not None and self.closed_status is None:
            self._core_timer = self.loop.call_at(deadline, self._core_timer_fired)

    def _core_timer_fired(self) -> None:
        self._core_timer = None
        for event in self._core.timer(self.loop.time()):
            self._on_event(event)
        self._arm_core_timer()

    def _schedule_ping(self) -> None:
        if self.settings.ping_interval > 0 and self.closed_status is None:
            self._ping_handle = self.loop.call_later(self.settings.ping_interval, self._send_ping)

    def _send_ping(self) -> None:
        self._ping_handle = None
        if self.closed_status is not None:
            return
        self._pings += 1
        self._core.ping(self._pings.to_bytes(8, "big"))
        self._flush()
        self._pong_handle = self.loop.call_later(self.settings.ping_timeout, self._ping_timed_out)

    def _ping_timed_out(self) -> None:
        self._pong_handle = None
        self._lose(unavailable(f"keepalive timeout: no PING ACK within {self.settings.ping_timeout:g}s"))


async def connect(
    host: str,
    port: int,
    *,
    authority: str,
    ssl_context: ssl.SSLContext | None,
    server_hostname: str | None,
    settings: H2Settings,
    max_message: int,
    timeout: float,
) -> GrpcConnection:
    """A connection whose HTTP/2 preface is done; RpcError(UNAVAILABLE) naming why it is not."""
    loop = asyncio.get_running_loop()
    connection = GrpcConnection(
        authority=authority,
        tls=ssl_context is not None,
        settings=settings,
        max_message=max_message,
    )
    try:
        async with asyncio.timeout(timeout):
            if ssl_context is None:
                await loop.create_connection(lambda: connection, host, port)
            else:
                await loop.create_connection(
                    lambda: connection, host, port, ssl=ssl_context, server_hostname=server_hostname
                )
            await connection.ready
    except TimeoutError:
        connection.close()
        raise RpcError(unavailable(f"timed out connecting to {authority} after {timeout:g}s")) from None
    except RpcError as e:
        raise RpcError(unavailable(f"connecting to {authority}: {e.details}")) from None
    except (OSError, ssl.SSLError) as e:
        connection.close()
        raise RpcError(unavailable(f"failed to connect to {authority}: {_reason(e)}")) from None
    if connection.transport is not None:
        ssl_object = connection.transport.get_extra_info("ssl_object")
        if ssl_object is not None and ssl_object.selected_alpn_protocol() not in (None, "h2"):
            connection.close()
            raise RpcError(unavailable(f"{authority} does not speak HTTP/2 (ALPN)"))
    return connection


def _reason(e: BaseException) -> str:
    if isinstance(e, ssl.SSLCertVerificationError):
        return f"TLS: {e.verify_message or e.reason}"
    if isinstance(e, ssl.SSLError):
        return f"TLS: {e.reason or e}"
    return getattr(e, "strerror", None) or str(e)
