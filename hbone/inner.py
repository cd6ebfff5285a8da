"""Double HBONE: an HBONE connection inside one CONNECT stream.

Cross-network traffic goes through a network gateway: the outer CONNECT (pooled, to the gateway)
carries opaque bytes, and inside it the client runs a new TLS handshake and a new HTTP/2 session with
the proxy behind the gateway, then sends the inner CONNECT. `open_inner` sets that up on an outer
`HboneStream` and returns an ordinary `HboneConnection` (not pooled: one per proxied connection).

The inner TLS is the `ssl` module's public memory-BIO API (`SSLContext.wrap_bio`), driven here:
uvloop's `start_tls` accepts only its own transports, and asyncio's TLS protocol is not public API.
`_InnerTls` is both the outer stream's protocol (ciphertext in) and the transport the inner
`H2Session` writes plaintext to (ciphertext out, to the stream).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Sequence
from typing import Any

from hbone.client import HboneConnection, settle
from hbone.errors import TlsHandshakeError
from hbone.h2conn import H2Session
from hbone.identity import Identity
from hbone.settings import H2Settings
from hbone.stream import HboneStream
from hbone.tls import TlsCredentials

_READ_SIZE = 256 * 1024  # plaintext taken out of the TLS object per call


class _InnerTls(asyncio.Protocol, asyncio.Transport):
    """TLS client over an outer stream: its protocol on one side, the inner session's transport on
    the other. The handshake's outcome is `handshake` (a future)."""

    def __init__(self, stream: HboneStream, context: ssl.SSLContext, app: H2Session) -> None:
        asyncio.Transport.__init__(self)
        self._stream = stream
        self._app = app
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._ssl = context.wrap_bio(self._incoming, self._outgoing, server_side=False, server_hostname=None)
        self.handshake: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._connected = False  # the handshake completed and the app has its transport
        self._closed = False

    def start(self) -> None:
        self._stream.set_protocol(self)
        self._stream.resume_reading()
        self._step_handshake()

    # -- the outer stream's protocol -----------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        self._incoming.write(data)
        if not self._connected:
            self._step_handshake()
        if self._connected:
            self._read_plaintext()

    def eof_received(self) -> bool:
        self._incoming.write_eof()
        if self._connected:
            self._read_plaintext()
        elif not self.handshake.done():
            self._fail_handshake(ConnectionError("connection closed during the handshake"))
        return False  # the stream closes; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        if not self.handshake.done():
            self._fail_handshake(exc or ConnectionError("connection closed during the handshake"))
        elif self._connected:
            self._connected = False
            self._app.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._connected:
            self._app.pause_writing()

    def resume_writing(self) -> None:
        if self._connected:
            self._app.resume_writing()

    # -- TLS -------------------------------------------------------------------------------------

    def _flush(self) -> None:
        out = self._outgoing.read()
        if out and not self._closed:
            self._stream.write(out)

    def _step_handshake(self) -> None:
        try:
            self._ssl.do_handshake()
        except ssl.SSLWantReadError:
            self._flush()
            return
        except (ssl.SSLError, OSError) as e:
            self._flush()  # the alert
            self._fail_handshake(e)
            return
        self._flush()
        self._connected = True
        if not self.handshake.done():
            self.handshake.set_result(None)
        self._app.connection_made(self)

    def _fail_handshake(self, exc: BaseException) -> None:
        if not self.handshake.done():
            self.handshake.set_exception(exc)
        self._stream.abort()

    def _read_plaintext(self) -> None:
        app = self._app
        while self._connected:
            try:
                chunk = self._ssl.read(_READ_SIZE)
            except ssl.SSLWantReadError:
                break
            except ssl.SSLZeroReturnError:  # the peer's close_notify
                self._flush()
                if not app.eof_received():
                    self.close()
                return
            except (ssl.SSLError, OSError) as e:
                self._connected = False
                self._stream.abort()
                app.connection_lost(e)
                return
            if not chunk:
                break
            app.data_received(chunk)
        self._flush()  # TLS 1.3 post-handshake messages

    # -- the inner session's transport -------------------------------------------------------------

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "ssl_object":
            return self._ssl
        if name == "peercert":
            return self._ssl.getpeercert()
        if name == "cipher":
            return self._ssl.cipher()
        return self._stream.get_extra_info(name, default)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._closed or not self._connected:
            return
        try:
            self._ssl.write(data)
        except (ssl.SSLError, OSError):
            self.abort()
            return
        self._flush()

    def writelines(self, list_of_data: Any) -> None:
        if self._closed or not self._connected:
            return
        try:
            for data in list_of_data:
                self._ssl.write(data)
        except (ssl.SSLError, OSError):
            self.abort()
            return
        self._flush()

    def can_write_eof(self) -> bool:
        return False

    def is_closing(self) -> bool:
        return self._closed or self._stream.is_closing()

    def close(self) -> None:
        """close_notify, then the outer stream ends (END_STREAM once what is buffered is sent)."""
        if self._closed:
            return
        try:
            self._ssl.unwrap()
        except (ssl.SSLWantReadError, ssl.SSLError, OSError):
            pass  # the peer's close_notify is not waited for
        self._flush()
        self._closed = True
        self._stream.close()

    def abort(self) -> None:
        self._closed = True
        self._stream.abort()

    def is_reading(self) -> bool:
        return self._stream.is_reading()

    def pause_reading(self) -> None:
        self._stream.pause_reading()

    def resume_reading(self) -> None:
        self._stream.resume_reading()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._stream.set_write_buffer_limits(high, low)

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._stream.get_write_buffer_limits()

    def get_write_buffer_size(self) -> int:
        return self._stream.get_write_buffer_size()


async def open_inner(
    stream: HboneStream,
    credentials: TlsCredentials,
    expected: Sequence[Identity],
    settings: H2Settings,
    *,
    max_streams: int = 100,
    handshake_timeout: float = 10.0,
) -> HboneConnection:
    """Run TLS (presenting `credentials`, expecting one of `expected`) and HTTP/2 inside an established
    outer CONNECT stream; the stream then belongs to the returned connection.

    Raises `TlsHandshakeError` (including `IdentityMismatch`) or `H2HandshakeError`; the outer stream
    is reset on failure. Close the connection when the proxied connection ends (`close()` right after
    the one `connect` closes it once that stream is done).
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + handshake_timeout
    session = H2Session(client_side=True, settings=settings)
    tls = _InnerTls(stream, credentials.client, session)
    tls.start()
    try:
        await asyncio.wait_for(asyncio.shield(tls.handshake), handshake_timeout)
    except asyncio.CancelledError:
        stream.abort()
        raise
    except TimeoutError:
        tls.handshake.cancel()
        stream.abort()
        raise TlsHandshakeError(
            f"tls handshake error (inner): no handshake within {handshake_timeout}s"
        ) from None
    except (ssl.SSLError, OSError) as e:
        stream.abort()
        raise TlsHandshakeError(f"tls handshake error (inner): {e}") from e
    transport = session.transport
    if transport is None:
        stream.abort()
        raise TlsHandshakeError("tls handshake error (inner): connection closed during the handshake")
    return await settle(
        session, transport, credentials, expected, deadline, handshake_timeout, max_streams, inner=True
    )
