"""The engine of one HBONE connection: its TCP socket and its TLS, driven without the loop's TLS.

`TlsSocket` owns the connection's non-blocking socket (on the loop's reader and writer callbacks)
and a `TlsEngine` over memory buffers (`hbone.tlsio`: the `ssl` module's, or pyOpenSSL's when CRLs
are enforced before Python 3.13), the record protection: a faster one can take its place without
touching the rest. To the `H2Session` above it is an `asyncio.Transport`; both are typed as the
classes they are, so that the compiled build calls them natively.

* receiving: ciphertext is read with `recv_into` into one buffer of the thread (no allocation per
  read; the engine copies it into its own buffer at once), and the plaintext decrypted straight into
  the session's buffer (`get_buffer`/`buffer_updated`), as many records as fit before the session
  sees them. A read that cannot give plaintext is not tried: the engine says whether it holds any
  input.
* sending: each `write` is encrypted and sent at once; only what the socket does not take is queued
  (by reference), and the writer callback sends it. In one `writelines` small pieces are joined and a
  large one's head fills their record: a frame header never takes a TLS record of its own.
  Over the write-buffer high-water mark the protocol is paused; below the low-water mark it resumes.
* the end: a peer's close_notify or its TCP EOF is `eof_received`, then the transport closes (what
  it queued, close_notify included, is sent first); a socket or TLS error is `connection_lost(exc)`.

The handshake runs first (`start_tls`): the protocol's `connection_made` comes once it completed.
Errors come out as the `ssl` module's, whichever engine ran.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections import deque
from typing import Any

from hbone.h2conn import H2Session
from hbone.tls import TLS_PEER, TlsPeer
from hbone.tlsio import TlsEngine

_RECV_SIZE = 256 * 1024  # ciphertext read from the socket per call
_DEFAULT_HIGH = 64 * 1024
_RECORD = 16384  # the most plaintext a TLS record carries


class _RecvBuffer:
    """The buffer ciphertext is received into: one for the loop's thread. Each read's bytes are
    fed to an engine (which copies them) before anything else runs, so every connection shares it."""

    def __init__(self) -> None:
        self.view: memoryview | None = None

    def get(self) -> memoryview:
        view = self.view
        if view is None:
            view = self.view = memoryview(bytearray(_RECV_SIZE))
        return view


_RECV = _RecvBuffer()


class TlsSocket(asyncio.Transport):
    """One HBONE connection's socket and TLS; the transport of its protocol once the handshake is done."""

    __slots__ = (
        "_app",
        "_chain",
        "_closing",
        "_connected",
        "_dead",
        "_engine",
        "_eof_seen",
        "_fd",
        "_handshake_timer",
        "_high",
        "_loop",
        "_lost_called",
        "_low",
        "_outq",
        "_outq_size",
        "_paused_writer",
        "_peer",
        "_peername",
        "_reader_added",
        "_reading",
        "_sock",
        "_sockname",
        "_writer_added",
        "handshake",
    )

    def __init__(
        self, sock: socket.socket, engine: TlsEngine, app: H2Session, *, chain: bool = False
    ) -> None:
        # No `super().__init__()`: it only stores an `extra` mapping, which `get_extra_info` never reads.
        self._loop = asyncio.get_running_loop()
        self._sock = sock
        self._fd = sock.fileno()
        self._engine = engine
        self._app = app
        self._chain = chain
        self._peer: TlsPeer | None = None
        try:
            self._peername: Any = sock.getpeername()
            self._sockname: Any = sock.getsockname()
        except OSError:
            self._peername = self._sockname = None
        self.handshake: asyncio.Future[None] = self._loop.create_future()
        self._handshake_timer: asyncio.TimerHandle | None = None
        self._connected = False  # the handshake completed and the protocol has this transport
        self._closing = False  # close() or abort() was called, or the connection failed
        self._dead = False  # the socket is closed
        self._eof_seen = False  # the peer's TCP EOF was read
        self._lost_called = False
        self._reading = True
        self._reader_added = False
        self._writer_added = False
        self._outq: deque[bytes | memoryview] = deque()
        self._outq_size = 0
        self._high = _DEFAULT_HIGH
        self._low = _DEFAULT_HIGH // 4
        self._paused_writer = False

    # -- the handshake ---------------------------------------------------------------------------

    def start(self, timeout: float) -> None:
        """Start the handshake (a client sends its hello now); `handshake` says how it ended."""
        sock = self._sock
        sock.setblocking(False)
        self._handshake_timer = self._loop.call_later(max(timeout, 0.001), self._handshake_timed_out)
        self._add_reader()
        self._step_handshake()

    def _handshake_timed_out(self) -> None:
        self._handshake_timer = None
        self._fail_handshake(
            TimeoutError("the TLS handshake did not finish within the handshake timeout"), alert=False
        )

    def _step_handshake(self) -> None:
        try:
            done = self._engine.do_handshake()
        except (ssl.SSLError, OSError) as e:
            self._fail_handshake(e, alert=True)
            return
        if not self._send_outgoing():
            return
        if not done or self.handshake.done():
            return
        try:
            self._peer = self._engine.peer(self._chain)
        except (ssl.SSLError, OSError, ValueError) as e:
            self._fail_handshake(e, alert=False)
            return
        if self._handshake_timer is not None:
            self._handshake_timer.cancel()
            self._handshake_timer = None
        self._connected = True
        self.handshake.set_result(None)
        self._app.connection_made(self)
        if not self._closing:
            self._read_plaintext()  # what came with the peer's last handshake flight

    def _fail_handshake(self, exc: BaseException, *, alert: bool) -> None:
        if self._handshake_timer is not None:
            self._handshake_timer.cancel()
            self._handshake_timer = None
        if alert and not self._dead:
            try:  # the alert, if the socket takes it at once
                out = self._engine.outgoing()
                if out and not self._outq:
                    self._sock.send(out)
            except OSError:
                pass
        self._closing = True
        self._close_socket()
        if not self.handshake.done():
            self.handshake.set_exception(exc)

    def cancel_handshake(self) -> None:
        """The waiter gave up (cancelled): close the socket."""
        if not self.handshake.done():
            self._fail_handshake(ConnectionError("handshake cancelled"), alert=False)
            self.handshake.exception()  # retrieved

    # -- the socket ------------------------------------------------------------------------------

    def _add_reader(self) -> None:
        if not self._reader_added and not self._dead:
            self._reader_added = True
            self._loop.add_reader(self._fd, self._readable)

    def _remove_reader(self) -> None:
        if self._reader_added:
            self._reader_added = False
            self._loop.remove_reader(self._fd)

    def _close_socket(self) -> None:
        if self._dead:
            return
        self._dead = True
        self._remove_reader()
        if self._writer_added:
            self._writer_added = False
            self._loop.remove_writer(self._fd)
        self._outq.clear()
        self._outq_size = 0
        self._sock.close()

    def _readable(self) -> None:
        buf = _RECV.get()
        try:
            n = self._sock.recv_into(buf)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._lost(e)
            return
        if not self._connected:
            if self.handshake.done():
                return
            if n == 0:
                self._fail_handshake(
                    ConnectionResetError("connection closed during the handshake"), alert=False
                )
                return
            self._engine.feed(buf[:n])
            self._step_handshake()
            return
        if n == 0:
            self._eof()
            return
        self._engine.feed(buf[:n])
        self._read_plaintext()

    def _eof(self) -> None:
        """The peer's TCP EOF: whatever plaintext is left, then the protocol's end."""
        self._remove_reader()
        self._eof_seen = True
        self._engine.feed_eof()
        self._read_plaintext()

    def _read_plaintext(self) -> None:
        engine = self._engine
        app = self._app
        final = self._eof_seen
        while self._reading and self._connected and not self._closing:
            got = 0
            try:
                # A read gives at most one record: the buffer is filled with as many as there are
                # before the session sees it, so a batch of records is one batch above.
                buf = app.get_buffer(-1)
                size = len(buf)
                n = engine.read_into(buf)
                while n > 0:
                    got += n
                    if got >= size or not (final or engine.has_input()):
                        break
                    n = engine.read_into(buf[got:])
            except ssl.SSLEOFError:
                n = 0  # the peer closed without close_notify: an end as any other
            except (ssl.SSLError, OSError) as e:
                self._lost(e)
                return
            if got:
                app.buffer_updated(got)
                if n > 0:  # more may follow
                    if final or engine.has_input():
                        continue
                    break
                if self._closing or not self._connected:
                    return
            if n < 0 and not final:
                break
            # The peer's close_notify, or its EOF (no more ciphertext will come).
            self._send_outgoing()
            self._remove_reader()
            if not app.eof_received():
                self.close()
            return
        if not self._closing:
            self._send_outgoing()  # TLS 1.3 post-handshake messages

    def _send_outgoing(self) -> bool:
        """Send what the engine encrypted; False if the connection was lost on the way."""
        out = self._engine.outgoing()
        if not out or self._dead:
            return True
        if self._outq:
            self._outq.append(out)
            self._outq_size += len(out)
        else:
            try:
                n = self._sock.send(out)
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError as e:
                self._lost(e)
                return False
            if n == len(out):
                return True
            rest = memoryview(out)[n:]
            self._outq.append(rest)
            self._outq_size += len(rest)
            self._writer_added = True
            self._loop.add_writer(self._fd, self._writable)
        if self._outq_size > self._high and not self._paused_writer and self._connected:
            self._paused_writer = True
            try:
                self._app.pause_writing()
            except Exception as e:  # pragma: no cover - the protocol's own failure
                self._lost(e)
                return False
        return True

    def _writable(self) -> None:
        outq = self._outq
        sock = self._sock
        while outq:
            head = outq[0]
            try:
                n = sock.send(head)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self._lost(e)
                return
            self._outq_size -= n
            if n < len(head):
                outq[0] = memoryview(head)[n:]
                return
            outq.popleft()
        if self._writer_added:
            self._writer_added = False
            self._loop.remove_writer(self._fd)
        if self._closing:
            self._finish(None)
            return
        if self._paused_writer and self._outq_size <= self._low:
            self._paused_writer = False
            self._app.resume_writing()

    def _lost(self, exc: Exception | None) -> None:
        """The connection failed (a socket or TLS error): close it now, the protocol learns why."""
        if not self._connected:
            if not self.handshake.done():
                self._fail_handshake(exc or ConnectionResetError("connection lost"), alert=False)
            return
        self._closing = True
        self._finish(exc)

    def _finish(self, exc: Exception | None) -> None:
        self._close_socket()
        if self._connected and not self._lost_called:
            self._lost_called = True
            self._loop.call_soon(self._app.connection_lost, exc)

    # -- asyncio.Transport -----------------------------------------------------------------------

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == TLS_PEER:
            return self._peer
        if name == "peername":
            value = self._peername
        elif name == "sockname":
            value = self._sockname
        elif name == "socket":
            value = self._sock
        else:
            value = self._engine.extra(name)
        return default if value is None else value

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._closing or not self._connected:
            return
        try:
            self._engine.write(data)
        except (ssl.SSLError, OSError) as e:
            self._lost(e)
            return
        self._send_outgoing()

    def writelines(self, list_of_data: Any) -> None:
        """Small pieces (frame headers, small frames) are joined, and a large piece's head fills
        their record, so a frame header never takes a record of its own; a large piece's rest is
        encrypted from where it is, not copied."""
        if self._closing or not self._connected:
            return
        engine = self._engine
        pending: bytearray | None = None
        try:
            for data in list_of_data:
                size = len(data)
                if size < _RECORD:
                    if pending is None:
                        pending = bytearray(data)
                    else:
                        pending += data
                    if len(pending) >= _RECORD:
                        engine.write(pending)
                        pending = None
                elif pending is not None:
                    view = memoryview(data)
                    take = _RECORD - len(pending)
                    pending += view[:take]
                    engine.write(pending)
                    pending = None
                    engine.write(view[take:])
                else:
                    engine.write(data)
            if pending is not None:
                engine.write(pending)
        except (ssl.SSLError, OSError) as e:
            self._lost(e)
            return
        self._send_outgoing()

    def can_write_eof(self) -> bool:
        return False

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        """close_notify, then the socket closes once what is queued is sent."""
        if self._closing:
            return
        if not self._connected:
            self.cancel_handshake()
            return
        self._closing = True
        self._remove_reader()
        if self._connected:
            self._engine.close_notify()
            self._send_outgoing()
        if not self._outq:
            self._finish(None)

    def abort(self) -> None:
        if not self._connected:
            self.cancel_handshake()
            return
        self._closing = True
        self._finish(None)

    def is_reading(self) -> bool:
        return self._reading and not self._closing

    def pause_reading(self) -> None:
        if self._reading:
            self._reading = False
            self._remove_reader()

    def resume_reading(self) -> None:
        if self._reading or self._closing:
            return
        self._reading = True
        if not self._eof_seen:
            self._add_reader()
        if self._connected and (self._eof_seen or self._engine.has_input()):
            self._loop.call_soon(self._resume_plaintext)

    def _resume_plaintext(self) -> None:
        if self._reading and not self._closing:
            self._read_plaintext()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        if high is None:
            high = _DEFAULT_HIGH if low is None else 4 * low
        if low is None:
            low = high // 4
        if not high >= low >= 0:
            raise ValueError(f"high ({high!r}) must be >= low ({low!r}) must be >= 0")
        self._high, self._low = high, low

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return (self._low, self._high)

    def get_write_buffer_size(self) -> int:
        return self._outq_size


async def start_tls(
    sock: socket.socket, engine: TlsEngine, app: H2Session, timeout: float, *, chain: bool = False
) -> TlsSocket:
    """Take over a connected TCP socket and run TLS on it (a client sends its hello at once, a
    server waits for one); return the transport once the handshake is done, `app` connected to it.

    Raises `ssl.SSLError`, `OSError` or `TimeoutError`; the socket is closed on failure."""
    tls = TlsSocket(sock, engine, app, chain=chain)
    try:
        tls.start(timeout)
        await tls.handshake
    except BaseException:
        tls.cancel_handshake()
        raise
    return tls
