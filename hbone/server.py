"""The HBONE server (inbound :15008): TLS accept, client trust-domain check, HTTP/2, one task per CONNECT.

The server does not judge requests: every request stream becomes a `ConnectRequest` handed to the
handler, which answers with `respond` (400/401/503, or 200 and then the stream carries
the bytes). A handler that fails or returns without answering gets a 503 sent for it; a handler
whose stream the client resets, or whose connection dies, before it answered is cancelled. One
stream's failure never affects the other streams of its connection.

An accepted socket costs a file descriptor and a timer until its first TLS record (the ClientHello)
is complete: no TLS object and no task exist before that, so connections that hold half a
ClientHello (slowloris) are cheap, and closed at the handshake timeout. A first byte that does not
begin a TLS handshake record closes the connection at once.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence

from hbone.address import Address, canonical_addr
from hbone.engine import start_tls
from hbone.errors import CertificateRevoked, ConnectionClosed, HboneError, TlsHandshakeError
from hbone.h2conn import H2Session, Headers
from hbone.identity import Identity
from hbone.settings import H2Settings
from hbone.stream import HboneStream
from hbone.tls import REVOKED, TLS_PEER, TlsCredentials
from hbone.tlsio import OpenSslTls, StdlibTls, TlsEngine

log = logging.getLogger("hbone")

_TLS_HANDSHAKE_RECORD = 0x16
_TLS_MAJOR_VERSION = 0x03
_MAX_RECORD = 5 + 16384 + 256  # a TLS record header and the largest record body
# While a ClientHello is incomplete the socket is looked at again after these delays (doubling):
# peeking leaves the bytes in the socket, so waiting for readability would spin.
_HELLO_RECHECK_FIRST = 0.005
_HELLO_RECHECK_MAX = 0.5


class ConnectRequest:
    """One request stream received by the server, handed to the handler."""

    __slots__ = ("authority", "headers", "local_addr", "method", "peer_addr", "peer_identity", "stream")

    def __init__(
        self,
        method: str,
        authority: str,
        headers: dict[str, str],
        peer_identity: Identity | None,
        peer_addr: Address,
        local_addr: Address,
        stream: HboneStream,
    ) -> None:
        self.method = method
        self.authority = authority
        self.headers = headers
        self.peer_identity = peer_identity
        self.peer_addr = peer_addr
        self.local_addr = local_addr
        self.stream = stream

    @property
    def responded(self) -> bool:
        return self.stream.responded

    def respond(self, status: int, headers: Sequence[tuple[str, str]] = ()) -> None:
        """Answer the request. 200 keeps the stream open for data; anything else ends it.

        Responding to a stream the client already reset does nothing.
        """
        self.stream.respond(status, headers)

    def __repr__(self) -> str:
        return f"<ConnectRequest {self.method} {self.authority} from {self.peer_addr} ({self.peer_identity})>"


Handler = Callable[[ConnectRequest], Awaitable[None]]
# The credentials to serve a handshake with: fixed, or asked for on every handshake (waiting for an
# in-flight certificate fetch), so a rotated certificate is served from the next handshake on.
CredentialsSource = TlsCredentials | Callable[[], Awaitable[TlsCredentials]]
TlsErrorHook = Callable[[Address, Address, Exception], None]


def _revoked(session: H2Session, err: CertificateRevoked) -> None:
    # A new CRL revoked the client: GOAWAY at once, then the connection is cut with its streams.
    log.warning("hbone: closing connection from %s: %s", session.peer_identity, err)
    session.extra[REVOKED] = err  # read by whoever relays over the connection's streams
    session.goaway()
    session.abort(err)


class _Listener:
    """The accept loop on one listening socket; `close()` stops it and closes the socket."""

    def __init__(self, task: asyncio.Task[None], sock: socket.socket) -> None:
        self._task = task
        self.sockets = (sock,)

    def close(self) -> None:
        self._task.cancel()
        self.sockets[0].close()


class _HelloWait:
    """An accepted socket until its first TLS record has fully arrived (peeked, not read)."""

    __slots__ = ("deadline", "delay", "handle", "local", "peer", "server", "sock")

    def __init__(self, server: HboneServer, sock: socket.socket, peer: Address, local: Address) -> None:
        loop = asyncio.get_running_loop()
        self.server = server
        self.sock = sock
        self.peer = peer
        self.local = local
        self.deadline = loop.time() + server.handshake_timeout
        self.delay = _HELLO_RECHECK_FIRST
        self.handle: asyncio.TimerHandle | None = None
        loop.add_reader(sock.fileno(), self._readable)

    def _readable(self) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(self.sock.fileno())
        try:
            head = self.sock.recv(_MAX_RECORD, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            head = None
        except OSError:
            self.close()
            return
        if head is not None:
            if not head:
                self.close()  # gone before saying anything
                return
            if head[0] != _TLS_HANDSHAKE_RECORD or (len(head) > 1 and head[1] != _TLS_MAJOR_VERSION):
                self.close(TlsHandshakeError("tls handshake error: not a TLS handshake record"))
                return
            if len(head) >= 5 and len(head) >= 5 + int.from_bytes(head[3:5], "big"):
                self.server._hello_waits.discard(self)
                self.server._start_tls(self.sock, self.peer, self.local, self.deadline - loop.time())
                return
        remaining = self.deadline - loop.time()
        if remaining <= 0:
            self.close(
                TlsHandshakeError("tls handshake error: no complete ClientHello within the handshake timeout")
            )
            return
        self.handle = loop.call_later(min(self.delay, remaining), self._recheck)
        self.delay = min(self.delay * 2, _HELLO_RECHECK_MAX)

    def _recheck(self) -> None:
        self.handle = None
        asyncio.get_running_loop().add_reader(self.sock.fileno(), self._readable)

    def close(self, err: Exception | None = None) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None
        if self.sock.fileno() >= 0:
            asyncio.get_running_loop().remove_reader(self.sock.fileno())
            self.sock.close()
        self.server._hello_waits.discard(self)
        if err is not None:
            self.server._tls_error(self.peer, self.local, err)


class HboneServer:
    def __init__(
        self,
        credentials: CredentialsSource,
        handler: Handler,
        settings: H2Settings,
        own_trust_domain: Callable[[], str] | str | None = None,
        on_tls_error: TlsErrorHook | None = None,
        *,
        handshake_timeout: float | None = None,
        on_session: Callable[[H2Session], None] | None = None,  # each connection past its handshake
    ) -> None:
        """`own_trust_domain`: the trust domain client identities must be in; by default the one of
        the certificate served."""
        self._credentials = credentials
        self._handler = handler
        self.settings = settings
        self._trust_domain = own_trust_domain
        self._on_tls_error = on_tls_error
        self.handshake_timeout = (
            settings.handshake_timeout if handshake_timeout is None else handshake_timeout
        )
        self._on_session = on_session
        self._servers: list[_Listener] = []
        self._hello_waits: set[_HelloWait] = set()
        self._handshakes: set[asyncio.Task[None]] = set()
        self._handlers: set[asyncio.Task[None]] = set()
        self.sessions: set[H2Session] = set()
        self._shutting_down = False

    async def serve(self, listen_sock: socket.socket) -> _Listener:
        """Accept HBONE connections on a bound, listening socket.

        Accepted sockets go straight into a TLS server handshake (`connect_accepted_socket` with
        `ssl=`): under uvloop a transport reads once after `connection_made` even when paused
        there, so accepting with a plain transport and calling `start_tls` later can lose the
        ClientHello of a fast client.
        """
        listen_sock.setblocking(False)
        task = asyncio.get_running_loop().create_task(self._accept_loop(listen_sock))
        listener = _Listener(task, listen_sock)
        self._servers.append(listener)
        return listener

    async def _accept_loop(self, listen_sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(listen_sock)
            except asyncio.CancelledError:
                raise
            except OSError as e:
                if listen_sock.fileno() < 0:
                    return
                # Out of descriptors or a connection that died in the backlog: keep serving.
                log.warning("hbone: accept failed: %s", e)
                await asyncio.sleep(0.05)
                continue
            self._accepted(sock)

    def _accepted(self, sock: socket.socket) -> None:
        if self._shutting_down:
            sock.close()
            return
        try:
            peer = canonical_addr(sock.getpeername())
            local = canonical_addr(sock.getsockname())
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            sock.close()  # the peer is already gone
            return
        self._hello_waits.add(_HelloWait(self, sock, peer, local))

    def _start_tls(self, sock: socket.socket, peer: Address, local: Address, timeout: float) -> None:
        task = asyncio.get_running_loop().create_task(self._handshake(sock, peer, local, max(timeout, 0.001)))
        self._handshakes.add(task)
        task.add_done_callback(self._handshakes.discard)

    def _tls_error(self, peer: Address, local: Address, err: Exception) -> None:
        if self._on_tls_error is not None:
            try:
                self._on_tls_error(peer, local, err)
            except Exception:
                log.exception("hbone: on_tls_error hook failed")
        else:
            log.warning("hbone: connection failed src=%s dst=%s: %s", peer, local, err)

    async def _handshake(self, sock: socket.socket, peer: Address, local: Address, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout  # what is left of the handshake timeout after the ClientHello
        session = H2Session(
            client_side=False,
            settings=self.settings,
            on_request=lambda stream, headers: self._on_request(session, stream, headers, peer, local),
        )
        try:
            creds = self._credentials
            if not isinstance(creds, TlsCredentials):
                async with asyncio.timeout(timeout):  # no task per handshake
                    creds = await creds()
        except asyncio.CancelledError:
            sock.close()
            raise
        except Exception as e:
            sock.close()
            self._tls_error(
                peer, local, TlsHandshakeError(f"tls handshake error: no certificate to serve: {e}")
            )
            return
        try:
            remaining = max(deadline - loop.time(), 0.001)
            engine: TlsEngine
            if creds.openssl is not None:  # CRLs before Python 3.13: TLS on pyOpenSSL
                engine = OpenSslTls(creds.openssl.server, server_side=True)
            else:
                engine = StdlibTls(creds.server, server_side=True)
            # On failure or cancellation the socket is closed.
            tls = await start_tls(sock, engine, session, remaining, chain=creds.policy.revocation is not None)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._tls_error(peer, local, TlsHandshakeError(f"tls handshake error: {e}"))
            return
        try:
            tls_peer = creds.peer(tls)
            td = self._trust_domain() if callable(self._trust_domain) else self._trust_domain
            session.peer_identity = creds.verify_client(tls_peer, td)
        except Exception as e:
            tls.abort()
            err = e if isinstance(e, HboneError) else TlsHandshakeError(f"tls handshake error: {e}")
            self._tls_error(peer, local, err)
            return
        session.extra[TLS_PEER] = tls_peer
        if self._shutting_down:
            tls.abort()
            return
        self.sessions.add(session)
        release = creds.watch(tls_peer, lambda err: _revoked(session, err))

        def closed(_: object) -> None:
            self.sessions.discard(session)
            release()

        session.closed.add_done_callback(closed)
        if self._on_session is not None:
            self._on_session(session)
        session.start()

    def _on_request(
        self, session: H2Session, stream: HboneStream, headers: Headers, peer: Address, local: Address
    ) -> None:
        method = authority = ""
        fields: dict[str, str] = {}
        for name, value in headers:
            if name == ":method":
                method = value
            elif name == ":authority":
                authority = value
            elif not name.startswith(":"):
                fields[name] = value
        req = ConnectRequest(method, authority, fields, session.peer_identity, peer, local, stream)
        # The handler's task alone (no wrapping coroutine: a held connection keeps one frame less);
        # what its ending means for the stream is decided in `_handler_done`.
        task = asyncio.ensure_future(self._handler(req))
        self._handlers.add(task)
        task.add_done_callback(functools.partial(self._handler_done, req))
        stream.on_abandoned = task.cancel  # reset (or its connection lost) before it was answered

    def _handler_done(self, req: ConnectRequest, task: asyncio.Future[None]) -> None:
        self._handlers.discard(task)
        req.stream.on_abandoned = None  # nothing left to cancel (and the task is not kept alive)
        if task.cancelled():
            if not req.responded:
                req.stream.abort()
            return
        error = task.exception()
        if error is not None:
            log.error("hbone: handler failed for %r", req, exc_info=error)
        if not req.responded:
            req.respond(503)
        elif req.stream.get_protocol() is None:
            # Answered 200 but nobody will ever read the stream: end it rather than leak it.
            req.stream.abort()

    async def shutdown(self, graceful: bool) -> None:
        """Stop accepting. Graceful: GOAWAY(NO_ERROR) on every connection, wait for their streams to
        finish (bound it with a timeout and call `shutdown(False)` after); else close everything."""
        self._shutting_down = True
        for server in self._servers:
            server.close()
        self._servers.clear()
        for wait in list(self._hello_waits):
            wait.close()
        for task in list(self._handshakes):
            task.cancel()
        sessions = list(self.sessions)
        if graceful:
            for session in sessions:
                session.goaway()
        else:
            for session in sessions:
                session.abort(ConnectionClosed("server shut down"))
            for task in list(self._handlers):
                task.cancel()
        if sessions:
            await asyncio.wait([asyncio.ensure_future(asyncio.shield(s.closed)) for s in sessions])
        if not graceful and self._handlers:
            await asyncio.wait(list(self._handlers), timeout=1.0)
