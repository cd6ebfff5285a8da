"""The HBONE client: one mTLS HTTP/2 connection to a peer's :15008, CONNECT streams over it.

The caller dials the TCP socket (in-pod mode creates it inside the pod's network namespace) and
hands it over; `HboneConnection.open` runs the TLS handshake (no SNI), checks the server's SPIFFE
identity against the expected ones before any HTTP/2 byte is sent, and waits for the server's
SETTINGS. `connect` opens one CONNECT stream per proxied connection.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Sequence

from hbone.engine import start_tls
from hbone.errors import (
    CertificateRevoked,
    ConnectionClosed,
    H2HandshakeError,
    HboneError,
    HttpStatusError,
    TlsHandshakeError,
)
from hbone.h2conn import H2Session
from hbone.identity import Identity
from hbone.settings import POOL_MAX_STREAMS, H2Settings
from hbone.stream import HboneStream
from hbone.tls import REVOKED, TLS_PEER, TlsCredentials
from hbone.tlsio import OpenSslTls, StdlibTls, TlsEngine


class HboneConnection:
    """A client HBONE connection. Use `open` to create one."""

    def __init__(self, session: H2Session, max_streams: int) -> None:
        self._session = session
        self._max_streams = max_streams

    @classmethod
    async def open(
        cls,
        sock: socket.socket,
        tls: TlsCredentials,
        expected: Sequence[Identity],
        settings: H2Settings,
        *,
        max_streams: int = POOL_MAX_STREAMS,
        handshake_timeout: float = 10.0,
    ) -> HboneConnection:
        """Take over a connected non-blocking TCP socket and set up HBONE on it, presenting `tls`.

        Raises `TlsHandshakeError` (including `IdentityMismatch`) or `H2HandshakeError`; the socket
        is closed on failure.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + handshake_timeout
        session = H2Session(client_side=True, settings=settings)
        engine: TlsEngine
        if tls.openssl is not None:  # CRLs before Python 3.13: TLS on pyOpenSSL
            engine = OpenSslTls(tls.openssl.client, server_side=False)
        else:
            engine = StdlibTls(tls.client, server_side=False)  # no SNI, no host name check
        try:
            transport = await start_tls(
                sock, engine, session, handshake_timeout, chain=tls.policy.revocation is not None
            )
        except (ssl.SSLError, OSError, TimeoutError) as e:
            raise TlsHandshakeError(f"tls handshake error: {e}") from e
        return await settle(session, transport, tls, expected, deadline, handshake_timeout, max_streams)

    async def connect(
        self, authority: str, headers: Sequence[tuple[str, str]] = (), early_data: bytes = b""
    ) -> HboneStream:
        """Open a CONNECT stream to `authority` (`ip:port`, `[ip6]:port` or `host:port`).

        `early_data` (what the app sent before the tunnel was up) goes out with the HEADERS, in the
        same TLS record; the server holds it until it answers 200, and drops it otherwise.
        Returns the stream once the peer answered 200 (`stream.response_headers` holds its headers);
        raises `HttpStatusError` for any other status, `StreamResetError` or `ConnectionClosed`.
        """
        stream = self._session.open_stream(
            [(":method", "CONNECT"), (":authority", authority), *headers], flush=not early_data
        )
        if early_data:
            stream.write(early_data)
        try:
            await stream.wait_response()
        except BaseException:
            stream.abort()  # cancelled: RST_STREAM(CANCEL); reset or connection lost: forget it
            raise
        if stream.status != 200:
            stream.refused()
            raise HttpStatusError(stream.status or 0, stream.response_headers)
        return stream

    @property
    def peer_identity(self) -> Identity | None:
        return self._session.peer_identity

    @property
    def max_streams(self) -> int:
        return self._max_streams

    @property
    def active_streams(self) -> int:
        return len(self._session.streams)

    @property
    def close_reason(self) -> HboneError | None:
        return self._session.close_reason

    def get_extra_info(self, name: str, default: object = None) -> object:
        value = self._session.extra.get(name)
        return default if value is None else value

    def is_usable(self) -> bool:
        """False once the connection is closing, got a GOAWAY, or failed."""
        return self._session.is_usable()

    def close(self) -> None:
        """No new streams; the connection closes (GOAWAY, TLS close) once its streams finish."""
        self._session.drain()

    def abort(self) -> None:
        """Close now; open streams end with `ConnectionClosed`."""
        self._session.abort(ConnectionClosed("connection closed locally"))

    async def wait_closed(self) -> None:
        await asyncio.shield(self._session.closed)

    def __repr__(self) -> str:
        return (
            f"<HboneConnection peer={self.get_extra_info('peername')} identity={self.peer_identity} "
            f"streams={self.active_streams}/{self.max_streams} usable={self.is_usable()}>"
        )


async def settle(
    session: H2Session,
    transport: asyncio.Transport,
    tls: TlsCredentials,
    expected: Sequence[Identity],
    deadline: float,
    handshake_timeout: float,
    max_streams: int,
    *,
    inner: bool = False,
) -> HboneConnection:
    """After the TLS handshake (outer, or `inner` for double HBONE): check ALPN, the server's
    identity and its chain's revocation before any HTTP/2 byte is sent, start HTTP/2 and wait for
    the server's SETTINGS. While the connection lives, a new CRL revoking the server drops it."""
    where = " (inner)" if inner else ""
    try:
        peer = tls.peer(transport)
        session.peer_identity = tls.verify_server(peer, expected)
    except BaseException:
        transport.abort()
        raise

    def revoked(err: CertificateRevoked) -> None:
        session.extra[REVOKED] = err  # read by whoever relays over the connection's streams
        session.abort(err)

    session.extra[TLS_PEER] = peer
    release = tls.watch(peer, revoked)
    session.closed.add_done_callback(lambda _: release())
    session.start()
    loop = asyncio.get_running_loop()
    try:
        await asyncio.wait_for(asyncio.shield(session.remote_settings), max(deadline - loop.time(), 0.001))
    except TimeoutError:
        session.abort(ConnectionClosed("no SETTINGS from peer"))
        raise H2HandshakeError(
            f"http2 handshake error{where}: no SETTINGS from peer within {handshake_timeout}s"
        ) from None
    except ConnectionClosed as e:
        if inner:
            raise H2HandshakeError(f"http2 handshake error (inner): {e} before its SETTINGS") from e
        cause = e.__cause__
        if isinstance(cause, ssl.SSLError):
            # TLS 1.3: a server refusing our certificate says so after our side finished.
            raise TlsHandshakeError(f"tls handshake error: {cause}") from cause
        raise H2HandshakeError(
            f"http2 handshake error: {e} before its SETTINGS (did it refuse our certificate?)"
        ) from e
    except BaseException:
        session.abort()
        raise
    return HboneConnection(session, min(max_streams, session.remote_max_concurrent_streams))
