"""Double HBONE: an HBONE connection inside one CONNECT stream.

Cross-network traffic goes through a network gateway: the outer CONNECT (pooled, to the gateway)
carries opaque bytes, and inside it the client runs a new TLS handshake and a new HTTP/2 session with
the proxy behind the gateway, then sends the inner CONNECT. `open_inner` sets that up on an outer
`HboneStream` and returns an ordinary `HboneConnection` (not pooled: one per proxied connection).

The inner TLS is a `hbone.tlsio.TlsTransport` over the outer stream: the stream's protocol
(ciphertext in) and the transport the inner `H2Session` writes plaintext to (ciphertext out, to the
stream). Its engine is the `ssl` module's memory-BIO TLS, or pyOpenSSL's when the credentials run
on it (CRLs before Python 3.13).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Sequence

from hbone.client import HboneConnection, settle
from hbone.errors import TlsHandshakeError
from hbone.h2conn import H2Session
from hbone.identity import Identity
from hbone.settings import POOL_MAX_STREAMS, H2Settings
from hbone.stream import HboneStream
from hbone.tls import TlsCredentials
from hbone.tlsio import OpenSslTls, StdlibTls, TlsEngine, TlsTransport


async def open_inner(
    stream: HboneStream,
    credentials: TlsCredentials,
    expected: Sequence[Identity],
    settings: H2Settings,
    *,
    max_streams: int = POOL_MAX_STREAMS,
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
    engine: TlsEngine
    if credentials.openssl is not None:
        engine = OpenSslTls(credentials.openssl.client, server_side=False)
    else:
        engine = StdlibTls(credentials.client, server_side=False)
    tls = TlsTransport(engine, session, chain=credentials.policy.revocation is not None)
    stream.set_protocol(tls)
    tls.connection_made(stream)
    stream.resume_reading()
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
