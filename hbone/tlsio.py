"""TLS driven over memory buffers: the record protection of every HBONE connection.

The engines (`TlsEngine`) run under an HBONE connection's own socket (`hbone.engine.TlsSocket`)
and, for double HBONE, inside an outer CONNECT stream (`TlsTransport`): the event loop's TLS does
neither (uvloop's `start_tls` accepts only its own transports, asyncio's TLS protocol is not public
API, and neither runs on pyOpenSSL, which CRLs need before Python 3.13).

`TlsTransport` is the lower transport's protocol on one side (ciphertext in) and the transport of an
application protocol (an `H2Session`) on the other (plaintext in, ciphertext out to the lower
transport). It drives one of two engines with the same small interface: `StdlibTls` (`ssl`'s
`SSLContext.wrap_bio`) and `OpenSslTls` (a pyOpenSSL `Connection` in memory-BIO mode). Once the
handshake is done, what the checks read of the peer is its `TlsPeer` (extra info `TLS_PEER`).

Errors come out as `ssl.SSLError` with OpenSSL's reason, as from the event loop's TLS, whichever
engine ran.
"""

from __future__ import annotations

import asyncio
import ssl
from typing import TYPE_CHECKING, Any, Protocol

from hbone.tls import STDLIB_VERIFIED_CHAIN, TLS_PEER, TlsPeer, uri_sans

if TYPE_CHECKING:
    from OpenSSL import SSL

_READ_SIZE = 256 * 1024  # plaintext taken out of the engine per call
_BIO_READ = 256 * 1024  # ciphertext taken out of pyOpenSSL's outgoing buffer per call


def preload_revocation() -> None:
    """Import what TLS with CRLs loads at its first use: cryptography's certificate parsing and,
    before Python 3.13, pyOpenSSL. A parent calls it before forking its workers, so that they share
    these modules instead of each loading its own."""
    import cryptography.hazmat.primitives.asymmetric.ec
    import cryptography.hazmat.primitives.asymmetric.ed25519
    import cryptography.hazmat.primitives.asymmetric.rsa
    import cryptography.hazmat.primitives.serialization
    import cryptography.x509  # noqa: F401

    if not STDLIB_VERIFIED_CHAIN:
        import OpenSSL.crypto
        import OpenSSL.SSL  # noqa: F401


class TlsApp(Protocol):
    """What `TlsTransport` drives above it: a stream protocol (an `H2Session`)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None: ...
    def data_received(self, data: bytes) -> None: ...
    def eof_received(self) -> bool | None: ...
    def connection_lost(self, exc: Exception | None) -> None: ...
    def pause_writing(self) -> None: ...
    def resume_writing(self) -> None: ...


class TlsEngine:
    """One TLS session over memory buffers: ciphertext is fed in and taken out, plaintext read and
    written. Every method raises `ssl.SSLError` on a TLS failure. A base class rather than a protocol:
    compiled, the connection's engine calls it through its native methods."""

    def do_handshake(self) -> bool:
        """Advance the handshake with what was fed; True once it is complete."""
        raise NotImplementedError

    def feed(self, data: bytes | memoryview) -> None:
        """Ciphertext received from the peer."""
        raise NotImplementedError

    def feed_eof(self) -> None:
        """The peer sent no more ciphertext."""
        raise NotImplementedError

    def read(self, n: int) -> bytes | None:
        """Up to `n` bytes of plaintext; None when more ciphertext is needed, b"" at the peer's
        close_notify."""
        raise NotImplementedError

    def read_into(self, buffer: memoryview) -> int:
        """Plaintext into `buffer`: how many bytes; -1 when more ciphertext is needed, 0 at the
        peer's close_notify."""
        raise NotImplementedError

    def has_input(self) -> bool:
        """Whether a read may give plaintext without more ciphertext (False: it certainly would not)."""
        raise NotImplementedError

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Plaintext to send (all of it is encrypted into the outgoing buffer)."""
        raise NotImplementedError

    def outgoing(self) -> bytes:
        """The ciphertext to send to the peer (empties the outgoing buffer)."""
        raise NotImplementedError

    def close_notify(self) -> None:
        """Queue our close_notify (the peer's is not waited for)."""
        raise NotImplementedError

    def peer(self, chain: bool) -> TlsPeer:
        """The peer, after the handshake; its verified chain only when `chain`."""
        raise NotImplementedError

    def extra(self, name: str) -> Any:
        """`ssl_object`, `peercert` or `cipher` as the event loop's TLS transports give them, or None."""
        raise NotImplementedError


class StdlibTls(TlsEngine):
    """The `ssl` module's memory-BIO TLS (`SSLContext.wrap_bio`), with no server name."""

    def __init__(self, context: ssl.SSLContext, *, server_side: bool) -> None:
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._ssl = context.wrap_bio(
            self._incoming, self._outgoing, server_side=server_side, server_hostname=None
        )

    def do_handshake(self) -> bool:
        try:
            self._ssl.do_handshake()
        except ssl.SSLWantReadError:
            return False
        return True

    def feed(self, data: bytes | memoryview) -> None:
        self._incoming.write(data)

    def feed_eof(self) -> None:
        self._incoming.write_eof()

    def read(self, n: int) -> bytes | None:
        try:
            return self._ssl.read(n)
        except ssl.SSLWantReadError:
            return None
        except ssl.SSLZeroReturnError:
            return b""

    def read_into(self, buffer: memoryview) -> int:
        try:
            # With a buffer `read` returns a count (typeshed says bytes: so called untyped, unchecked).
            read: Any = self._ssl.read
            return int(read(len(buffer), buffer))
        except ssl.SSLWantReadError:
            return -1
        except ssl.SSLZeroReturnError:
            return 0

    def has_input(self) -> bool:
        return self._incoming.pending > 0 or self._ssl.pending() > 0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._ssl.write(data)

    def outgoing(self) -> bytes:
        return self._outgoing.read()

    def close_notify(self) -> None:
        try:
            self._ssl.unwrap()
        except ssl.SSLError:  # including SSLWantReadError: the peer's close_notify is not awaited
            pass

    def peer(self, chain: bool) -> TlsPeer:
        return TlsPeer.of_ssl(self._ssl, chain=chain)

    def extra(self, name: str) -> Any:
        if name == "ssl_object":
            return self._ssl
        if name == "peercert":
            return self._ssl.getpeercert()
        if name == "cipher":
            return self._ssl.cipher()
        return None


class OpenSslTls(TlsEngine):
    """pyOpenSSL's TLS in memory-BIO mode (a `Connection` with no socket). Its peer's verified
    chain is public API (`get_verified_chain`), which the `ssl` module has only from Python 3.13."""

    def __init__(self, context: SSL.Context, *, server_side: bool) -> None:
        self._SSL: Any = _pyopenssl()
        self._conn: SSL.Connection = self._SSL.Connection(context, None)
        if server_side:
            self._conn.set_accept_state()
        else:
            self._conn.set_connect_state()

    def do_handshake(self) -> bool:
        SSL = self._SSL
        try:
            self._conn.do_handshake()
        except SSL.WantReadError:
            return False
        except SSL.Error as e:
            raise _ssl_error(e) from None
        return True

    def feed(self, data: bytes | memoryview) -> None:
        self._conn.bio_write(data)

    def feed_eof(self) -> None:
        self._conn.bio_shutdown()

    def read(self, n: int) -> bytes | None:
        SSL = self._SSL
        try:
            return self._conn.recv(n)
        except SSL.WantReadError:
            return None
        except SSL.ZeroReturnError:
            return b""
        except SSL.Error as e:
            raise _ssl_error(e) from None

    def read_into(self, buffer: memoryview) -> int:
        SSL = self._SSL
        try:
            return self._conn.recv_into(buffer)
        except SSL.WantReadError:
            return -1
        except SSL.ZeroReturnError:
            return 0
        except SSL.Error as e:
            raise _ssl_error(e) from None

    def has_input(self) -> bool:
        return True  # what its incoming buffer holds is not public: a read tells

    def write(self, data: bytes | bytearray | memoryview) -> None:
        SSL = self._SSL
        view = memoryview(data)
        total = len(view)
        try:
            sent = self._conn.send(view)
            while sent < total:  # pyOpenSSL enables partial writes
                sent += self._conn.send(view[sent:])
        except SSL.Error as e:
            raise _ssl_error(e) from None

    def outgoing(self) -> bytes:
        chunks = []
        while True:
            try:
                chunk = self._conn.bio_read(_BIO_READ)
            except self._SSL.WantReadError:  # empty
                break
            chunks.append(chunk)
            if len(chunk) < _BIO_READ:  # a memory BIO gives all it holds: it is empty now
                break
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def close_notify(self) -> None:
        try:
            self._conn.shutdown()
        except self._SSL.Error:
            pass

    def peer(self, chain: bool) -> TlsPeer:
        from cryptography.hazmat.primitives.serialization import Encoding

        verified = self._conn.get_verified_chain(as_cryptography=True) or []
        leaf = verified[0] if verified else self._conn.get_peer_certificate(as_cryptography=True)
        alpn = self._conn.get_alpn_proto_negotiated()
        return TlsPeer(
            alpn.decode("ascii", "replace") if alpn else None,
            tuple(uri_sans(leaf)) if leaf is not None else (),
            tuple(c.public_bytes(Encoding.DER) for c in verified) if chain else (),
        )

    def extra(self, name: str) -> Any:
        if name == "cipher":
            name_ = self._conn.get_cipher_name()
            return (
                None
                if name_ is None
                else (name_, self._conn.get_cipher_version(), self._conn.get_cipher_bits())
            )
        return None


def _pyopenssl() -> Any:
    """pyOpenSSL's `SSL` module, imported on first use (a function-level `from OpenSSL import SSL`
    would bind the module's global of that name, which the compiled build leaves None)."""
    import importlib

    return importlib.import_module("OpenSSL.SSL")


def _ssl_error(err: Exception) -> ssl.SSLError:
    """pyOpenSSL's error as the `ssl` module words it: `[SSL: REASON_CODE] reason`."""
    SSL = _pyopenssl()

    if isinstance(err, SSL.SysCallError):
        # (-1, 'Unexpected EOF'): the peer closed without a close_notify
        return ssl.SSLEOFError(f"EOF occurred in violation of protocol ({err.args[-1] if err.args else ''})")
    reasons = [
        r[2] for r in (err.args[0] if err.args and isinstance(err.args[0], list) else ()) if len(r) == 3
    ]
    if not reasons:
        return ssl.SSLError(str(err) or "TLS error")
    code = reasons[0].upper().replace(" ", "_")
    out = ssl.SSLError(1, f"[SSL: {code}] {'; '.join(reasons)}")
    out.reason = code
    out.library = "SSL"
    return out


class TlsTransport(asyncio.Protocol, asyncio.Transport):
    """TLS over a lower transport: its protocol on one side, `app`'s transport on the other.

    `handshake` (a future) says how the handshake ended; once it succeeded, `app.connection_made`
    was called with this transport. `chain`: keep the peer's verified chain in its `TlsPeer` (for
    revocation checks)."""

    def __init__(self, engine: TlsEngine, app: TlsApp, *, chain: bool = False) -> None:
        asyncio.Transport.__init__(self)
        self._engine = engine
        self._app = app
        self._chain = chain
        self._lower: asyncio.Transport | None = None
        self._peer: TlsPeer | None = None
        self.handshake: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._connected = False  # the handshake completed and the app has its transport
        self._closed = False

    # -- the lower transport's protocol ----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """The lower transport is ready: start the handshake (a client sends its hello now)."""
        self._lower = transport  # type: ignore[assignment]  # uvloop's do not subclass asyncio's
        self._step_handshake()

    def data_received(self, data: bytes) -> None:
        if self._closed and not self._connected:
            return
        self._engine.feed(data)
        if not self._connected:
            self._step_handshake()
        if self._connected:
            self._read_plaintext()

    def eof_received(self) -> bool:
        self._engine.feed_eof()
        if self._connected:
            self._read_plaintext()
        elif not self.handshake.done():
            self._fail_handshake(ConnectionError("connection closed during the handshake"))
        return False  # the lower transport closes; connection_lost follows

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
        out = self._engine.outgoing()
        if out and self._lower is not None and not self._lower.is_closing():
            self._lower.write(out)

    def _step_handshake(self) -> None:
        try:
            done = self._engine.do_handshake()
        except (ssl.SSLError, OSError) as e:
            self._flush()  # the alert
            self._fail_handshake(e)
            return
        self._flush()
        if not done or self.handshake.done():
            return
        self._peer = self._engine.peer(self._chain)
        self._connected = True
        self.handshake.set_result(None)
        self._app.connection_made(self)

    def _fail_handshake(self, exc: BaseException) -> None:
        self._closed = True
        if not self.handshake.done():
            self.handshake.set_exception(exc)
        if self._lower is not None:
            self._lower.close()  # what is buffered (the alert) still goes out

    def _read_plaintext(self) -> None:
        app = self._app
        while self._connected:
            try:
                chunk = self._engine.read(_READ_SIZE)
            except (ssl.SSLError, OSError) as e:
                self._connected = False
                self._closed = True
                if self._lower is not None:
                    self._lower.abort()
                app.connection_lost(e)
                return
            if chunk is None:
                break
            if not chunk:  # the peer's close_notify
                self._flush()
                if not app.eof_received():
                    self.close()
                return
            app.data_received(chunk)
        self._flush()  # TLS 1.3 post-handshake messages

    # -- the application's transport -------------------------------------------------------------

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == TLS_PEER:
            return self._peer
        value = self._engine.extra(name)
        if value is None and self._lower is not None:
            value = self._lower.get_extra_info(name)
        return default if value is None else value

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._closed or not self._connected:
            return
        try:
            self._engine.write(data)
        except (ssl.SSLError, OSError):
            self.abort()
            return
        self._flush()

    def writelines(self, list_of_data: Any) -> None:
        if self._closed or not self._connected:
            return
        try:
            for data in list_of_data:
                self._engine.write(data)
        except (ssl.SSLError, OSError):
            self.abort()
            return
        self._flush()

    def can_write_eof(self) -> bool:
        return False

    def is_closing(self) -> bool:
        return self._closed or self._lower is None or self._lower.is_closing()

    def close(self) -> None:
        """close_notify, then the lower transport closes once what it buffered is sent."""
        if self._closed:
            return
        self._engine.close_notify()
        self._flush()
        self._closed = True
        if self._lower is not None:
            self._lower.close()

    def abort(self) -> None:
        self._closed = True
        if self._lower is not None:
            self._lower.abort()

    def is_reading(self) -> bool:
        return self._lower is not None and self._lower.is_reading()

    def pause_reading(self) -> None:
        if self._lower is not None:
            self._lower.pause_reading()

    def resume_reading(self) -> None:
        if self._lower is not None:
            self._lower.resume_reading()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        if self._lower is not None:
            self._lower.set_write_buffer_limits(high, low)

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._lower.get_write_buffer_limits() if self._lower is not None else (0, 0)

    def get_write_buffer_size(self) -> int:
        return self._lower.get_write_buffer_size() if self._lower is not None else 0
