"""Double HBONE: an HBONE connection inside one CONNECT stream.

Cross-network traffic goes through a network gateway: the outer CONNECT (pooled, to the gateway)
carries opaque bytes, and inside it the client runs a new TLS handshake and a new HTTP/2 session with
the proxy behind the gateway, then sends the inner CONNECT. `open_inner` sets that up on an outer
`HboneStream` and returns an ordinary `HboneConnection` (not pooled: one per proxied connection).

TLS over a transport that is not a socket is asyncio's `sslproto.SSLProtocol`; uvloop's `start_tls`
accepts only uvloop transports, so the protocol is wired onto the stream by hand: `_Feed` hands the
stream's bytes to it (it is a buffered protocol, the stream calls `data_received`), and `_Carrier`
is the transport it writes to (asyncio's TLS protocol also calls a private `_force_close` on it).
"""

from __future__ import annotations

import asyncio
import ssl
from asyncio import sslproto
from collections.abc import Sequence
from typing import Any, cast

from hbone.client import HboneConnection, settle
from hbone.errors import TlsHandshakeError
from hbone.h2conn import H2Session
from hbone.identity import Identity
from hbone.settings import H2Settings
from hbone.stream import HboneStream
from hbone.tls import TlsCredentials

# How long the inner TLS waits for the peer's close_notify once the proxied connection is over.
SHUTDOWN_TIMEOUT = 5.0


class _Carrier(asyncio.Transport):
    """The transport under the inner TLS: the outer stream."""

    def __init__(self, stream: HboneStream) -> None:
        super().__init__()
        self._stream = stream

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._stream.get_extra_info(name, default)

    def is_closing(self) -> bool:
        return self._stream.is_closing()

    def close(self) -> None:
        self._stream.close()

    def abort(self) -> None:
        self._stream.abort()

    def _force_close(self, exc: BaseException | None) -> None:
        # asyncio's TLS protocol calls this on fatal errors and on the shutdown timeout.
        self._stream.abort()

    def is_reading(self) -> bool:
        return self._stream.is_reading()

    def pause_reading(self) -> None:
        self._stream.pause_reading()

    def resume_reading(self) -> None:
        self._stream.resume_reading()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._stream.write(data)

    def writelines(self, list_of_data: Any) -> None:
        self._stream.writelines(list_of_data)

    def write_eof(self) -> None:
        self._stream.write_eof()

    def can_write_eof(self) -> bool:
        return True

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._stream.set_write_buffer_limits(high, low)

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._stream.get_write_buffer_limits()

    def get_write_buffer_size(self) -> int:
        return self._stream.get_write_buffer_size()


class _Feed(asyncio.Protocol):
    """The outer stream's protocol: passes its events to the inner TLS protocol."""

    def __init__(self, tls: sslproto.SSLProtocol) -> None:
        self._tls = tls

    def data_received(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            buf = self._tls.get_buffer(len(view))
            n = min(len(buf), len(view))
            buf[:n] = view[:n]
            self._tls.buffer_updated(n)
            view = view[n:]

    def eof_received(self) -> bool | None:
        # True while the app side is paused (typeshed says it returns nothing): keep the stream.
        keep_open: bool | None = cast(Any, self._tls).eof_received()
        return keep_open

    def connection_lost(self, exc: Exception | None) -> None:
        self._tls.connection_lost(exc)

    def pause_writing(self) -> None:
        self._tls.pause_writing()

    def resume_writing(self) -> None:
        self._tls.resume_writing()


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
    waiter: asyncio.Future[None] = loop.create_future()
    tls = sslproto.SSLProtocol(
        loop,
        session,
        credentials.client,
        waiter,
        server_side=False,
        server_hostname=None,  # no SNI, as on the outer connection
        ssl_handshake_timeout=handshake_timeout,  # type: ignore[arg-type]  # any positive number
        ssl_shutdown_timeout=SHUTDOWN_TIMEOUT,
    )
    stream.set_protocol(_Feed(tls))
    tls.connection_made(_Carrier(stream))
    stream.resume_reading()
    try:
        await waiter
    except asyncio.CancelledError:
        stream.abort()
        raise
    except (ssl.SSLError, OSError) as e:
        stream.abort()
        raise TlsHandshakeError(f"tls handshake error (inner): {e}") from e
    transport = session.transport
    if transport is None:
        # The outer stream ended (or the handshake timed out) before the handshake completed.
        stream.abort()
        raise TlsHandshakeError("tls handshake error (inner): connection closed during the handshake")
    return await settle(
        session, transport, credentials, expected, deadline, handshake_timeout, max_streams, inner=True
    )
