"""The errors the HBONE tunnel raises: one class per way establishing or carrying a tunnel fails."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from hbone.identity import Identity

if TYPE_CHECKING:
    from cryptography import x509


class HboneError(Exception):
    """Base of every error raised by the `hbone` package."""


class TlsHandshakeError(HboneError):
    """The TLS handshake failed (or the peer's certificate was refused after it)."""


class IdentityMismatch(TlsHandshakeError):
    """The server's certificate carries none of the identities the client expected."""

    def __init__(self, expected: Sequence[Identity], got: Sequence[Identity]) -> None:
        self.expected = tuple(expected)
        self.got = tuple(got)
        super().__init__(
            "identity verification error: peer did not present the expected SAN "
            f"({[str(i) for i in self.expected]}), got {[str(i) for i in self.got]}"
        )


class CertificateRevoked(TlsHandshakeError):
    """A certificate of the peer's chain is listed by a CRL in force: refused at the handshake, or
    the reason an open session was torn down when a new CRL revoked it (response flag CERT_REVOKED)."""

    def __init__(self, cert: x509.Certificate, position: int = 0) -> None:
        self.serial = cert.serial_number
        self.issuer = cert.issuer.rfc4514_string()
        which = "peer certificate" if position == 0 else f"certificate {position} of the peer's chain"
        super().__init__(
            f"tls handshake error: invalid peer certificate: Revoked ({which}, serial {self.serial:#x}, "
            f"issuer {self.issuer})"
        )


class H2HandshakeError(HboneError):
    """TLS succeeded but the HTTP/2 connection could not be set up (no SETTINGS from the peer)."""


class HttpStatusError(HboneError):
    """The CONNECT was answered with a status other than 200."""

    def __init__(self, status: int, headers: Sequence[tuple[str, str]] = ()) -> None:
        self.status = status
        self.headers = list(headers)  # response headers, e.g. `baggage` for destination telemetry
        super().__init__(f"http status: {status}")


class StreamResetError(HboneError, ConnectionResetError):
    """The peer reset the stream (RST_STREAM) with an error code that is not a clean end.

    It is also a `ConnectionResetError`, so code written for TCP transports treats it as a reset.
    """

    def __init__(self, error_code: int) -> None:
        self.error_code = error_code
        super().__init__(f"stream reset by peer: error code {error_code}")


class ConnectionClosed(HboneError, ConnectionError):
    """The HTTP/2 connection is gone (closed, GOAWAY, keepalive timeout, protocol error)."""
