"""HBONE TLS: TLS 1.3 + ALPN h2, mutual authentication, SPIFFE identity checks."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from cryptography.x509.oid import ExtendedKeyUsageOID

from hbone.client import HboneConnection
from hbone.errors import H2HandshakeError, HboneError, IdentityMismatch, TlsHandshakeError
from hbone.identity import Identity
from hbone.server import ConnectRequest, HboneServer
from hbone.settings import H2Settings
from hbone.tls import TLS_PEER, TlsCredentials, WorkloadCertificate, peer_identities
from tests.certs import CA, issue, make_ca, spiffe

pytestmark = pytest.mark.timeout(30)

SERVER_ID = spiffe(namespace="ns1", sa="server")
CLIENT_ID = spiffe(namespace="ns2", sa="client")


@pytest.fixture(scope="module")
def ca() -> CA:
    return make_ca()


class Server:
    def __init__(self, cert: WorkloadCertificate, trust_domain: str = "cluster.local") -> None:
        self.cert = cert
        self.creds = TlsCredentials.build(cert)
        self.ctx = self.creds.server
        self.sni: list[str | None] = []
        self.ctx.sni_callback = lambda obj, name, ctx: self.sni.append(name)  # type: ignore[assignment,misc,func-returns-value]
        self.errors: list[tuple[tuple[str, int], tuple[str, int], Exception]] = []
        self.failed = asyncio.Event()
        self.requests: list[ConnectRequest] = []
        self.server = HboneServer(self.creds, self._handle, H2Settings(), trust_domain, self._tls_error)
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(8)
        self.listener.setblocking(False)
        self.addr = self.listener.getsockname()

    async def _handle(self, req: ConnectRequest) -> None:
        self.requests.append(req)
        req.respond(200)

    def _tls_error(self, peer: tuple[str, int], local: tuple[str, int], err: Exception) -> None:
        self.errors.append((peer, local, err))
        self.failed.set()

    async def dial(self) -> socket.socket:
        sock = socket.socket()
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, self.addr)
        return sock


@pytest.fixture
async def serve(ca: CA) -> AsyncIterator[Callable[..., Awaitable[Server]]]:
    made: list[Server] = []

    async def start(cert: WorkloadCertificate | None = None, trust_domain: str = "cluster.local") -> Server:
        s = Server(cert or issue(ca, SERVER_ID), trust_domain)
        await s.server.serve(s.listener)
        made.append(s)
        return s

    yield start
    for s in made:
        await s.server.shutdown(graceful=False)


async def test_handshake_is_tls13_with_alpn_h2_and_mutual_identities(ca: CA, serve) -> None:
    srv = await serve()
    cert = issue(ca, CLIENT_ID)
    conn = await HboneConnection.open(
        await srv.dial(), TlsCredentials.build(cert), [Identity.parse(SERVER_ID)], H2Settings()
    )
    ssl_object = conn.get_extra_info("ssl_object")
    assert isinstance(ssl_object, ssl.SSLObject)
    assert ssl_object.version() == "TLSv1.3"
    assert ssl_object.selected_alpn_protocol() == "h2"
    cipher = ssl_object.cipher()
    assert cipher is not None
    assert cipher[0] in ("TLS_AES_256_GCM_SHA384", "TLS_AES_128_GCM_SHA256")
    assert str(conn.peer_identity) == SERVER_ID
    assert srv.sni == [None]  # no SNI sent
    await conn.connect("127.0.0.1:80")
    assert str(srv.requests[0].peer_identity) == CLIENT_ID
    conn.abort()


async def test_any_expected_identity_matches_any_san(ca: CA, serve) -> None:
    other = spiffe(namespace="ns1", sa="waypoint")
    srv = await serve(issue(ca, SERVER_ID, extra_uris=[other, "https://not-spiffe.example"]))
    expected = [Identity.parse(spiffe(sa="unrelated")), Identity.parse(other)]
    conn = await HboneConnection.open(
        await srv.dial(), TlsCredentials.build(issue(ca, CLIENT_ID)), expected, H2Settings()
    )
    assert str(conn.peer_identity) == SERVER_ID  # "the" identity is the first SAN
    conn.abort()


async def test_wrong_expected_identity_is_refused_before_http2(ca: CA, serve) -> None:
    srv = await serve()
    wanted = Identity.parse(spiffe(namespace="ns1", sa="someone-else"))
    with pytest.raises(IdentityMismatch) as err:
        await HboneConnection.open(
            await srv.dial(), TlsCredentials.build(issue(ca, CLIENT_ID)), [wanted], H2Settings()
        )
    assert err.value.expected == (wanted,)
    assert [str(i) for i in err.value.got] == [SERVER_ID]
    assert "someone-else" in str(err.value) and SERVER_ID in str(err.value)
    await asyncio.sleep(0.05)  # a negative check: how long a wrongly sent request has to show
    assert srv.requests == []


async def test_empty_expected_list_is_a_mismatch(ca: CA, serve) -> None:
    srv = await serve()
    with pytest.raises(IdentityMismatch):
        await HboneConnection.open(
            await srv.dial(), TlsCredentials.build(issue(ca, CLIENT_ID)), [], H2Settings()
        )


async def test_client_from_another_trust_domain_is_rejected(ca: CA, serve) -> None:
    srv = await serve()
    foreign = issue(ca, spiffe(trust_domain="other.domain", namespace="ns2", sa="client"))
    with pytest.raises(HboneError):
        conn = await HboneConnection.open(
            await srv.dial(), TlsCredentials.build(foreign), [Identity.parse(SERVER_ID)], H2Settings()
        )
        await conn.connect("127.0.0.1:80")
    await asyncio.wait_for(srv.failed.wait(), 5)
    [(_peer, local, err)] = srv.errors
    assert isinstance(err, TlsHandshakeError)
    assert "trust domain" in str(err)
    assert local == srv.addr
    assert srv.requests == []


async def test_client_without_san_in_our_trust_domain_when_it_has_none(ca: CA, serve) -> None:
    srv = await serve()
    no_spiffe = issue(ca, "https://example.com/not-an-identity")
    with pytest.raises(HboneError):
        conn = await HboneConnection.open(
            await srv.dial(), TlsCredentials.build(no_spiffe), [Identity.parse(SERVER_ID)], H2Settings()
        )
        await conn.connect("127.0.0.1:80")
    await asyncio.wait_for(srv.failed.wait(), 5)
    assert srv.requests == []


async def test_client_without_certificate_is_rejected(ca: CA, serve) -> None:
    srv = await serve()
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.set_alpn_protocols(["h2"])
    ctx.load_verify_locations(cadata=ca.root_pem.decode())
    reader, writer = await asyncio.open_connection(sock=await srv.dial(), ssl=ctx, server_hostname="")
    writer.write(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
    with pytest.raises((ssl.SSLError, ConnectionError)) as err:
        data = await asyncio.wait_for(reader.read(1024), 5)
        if not data:  # EOF is a rejection too, but OpenSSL reports the alert first
            raise ConnectionError("closed")
    writer.close()
    await asyncio.wait_for(srv.failed.wait(), 5)
    [(_, _, server_err)] = srv.errors
    assert "peer did not return a certificate" in str(server_err), server_err
    # TLS 1.3: the client sees the refusal as the server's alert, or (alert not flushed) as a close.
    assert (
        "certificate" in str(err.value).lower()
        if isinstance(err.value, ssl.SSLError)
        else str(err.value) == "closed" or isinstance(err.value, ConnectionResetError)
    ), repr(err.value)


async def test_server_with_untrusted_ca_is_rejected(ca: CA, serve) -> None:
    rogue = make_ca("rogue")
    srv = await serve(issue(rogue, SERVER_ID, roots=[ca.root_pem]))
    with pytest.raises(TlsHandshakeError) as err:
        await HboneConnection.open(
            await srv.dial(),
            TlsCredentials.build(issue(ca, CLIENT_ID)),
            [Identity.parse(SERVER_ID)],
            H2Settings(),
        )
    assert "certificate verify failed: unable to get local issuer certificate" in str(err.value)


async def test_client_with_untrusted_ca_is_rejected(ca: CA, serve) -> None:
    srv = await serve()
    rogue = make_ca("rogue")
    client = issue(rogue, CLIENT_ID, roots=[ca.root_pem])
    # TLS 1.3: the client's handshake is complete before the server judges its certificate, so
    # the client learns of the refusal as a close (asyncio's server does not flush its alert).
    with pytest.raises((TlsHandshakeError, H2HandshakeError)):
        await HboneConnection.open(
            await srv.dial(), TlsCredentials.build(client), [Identity.parse(SERVER_ID)], H2Settings()
        )
    await asyncio.wait_for(srv.failed.wait(), 5)
    assert "certificate verify failed: unable to get local issuer certificate" in str(srv.errors[0][2])


async def test_client_cert_without_client_auth_eku_is_rejected(ca: CA, serve) -> None:
    srv = await serve()
    server_only = issue(ca, CLIENT_ID, eku=[ExtendedKeyUsageOID.SERVER_AUTH])
    with pytest.raises((TlsHandshakeError, H2HandshakeError)):
        await HboneConnection.open(
            await srv.dial(), TlsCredentials.build(server_only), [Identity.parse(SERVER_ID)], H2Settings()
        )
    await asyncio.wait_for(srv.failed.wait(), 5)
    assert "certificate verify failed: unsuitable certificate purpose" in str(srv.errors[0][2])


async def test_intermediate_chain_is_presented(ca: CA, serve) -> None:
    intermediate = make_ca("intermediate", parent=ca)
    srv = await serve(issue(intermediate, SERVER_ID))
    client = issue(intermediate, CLIENT_ID)
    assert len(client.chain_pem) == 2
    conn = await HboneConnection.open(
        await srv.dial(), TlsCredentials.build(client), [Identity.parse(SERVER_ID)], H2Settings()
    )
    await conn.connect("127.0.0.1:80")
    conn.abort()


async def test_peer_without_alpn_h2_is_rejected(ca: CA, serve) -> None:
    srv = await serve()
    cert = issue(ca, CLIENT_ID)
    ctx = TlsCredentials.build(cert).client
    ctx.set_alpn_protocols(["http/1.1"])
    _reader, writer = await asyncio.open_connection(sock=await srv.dial(), ssl=ctx, server_hostname="")
    assert writer.get_extra_info("ssl_object").selected_alpn_protocol() is None
    await asyncio.wait_for(srv.failed.wait(), 5)
    assert "ALPN" in str(srv.errors[0][2])
    writer.close()


async def test_rotated_server_certificate_is_picked_up_per_handshake(ca: CA) -> None:
    creds = [
        TlsCredentials.build(issue(ca, SERVER_ID)),
        TlsCredentials.build(issue(ca, spiffe(namespace="ns1", sa="rotated"))),
    ]
    current = {"creds": creds[0]}

    async def credentials() -> TlsCredentials:
        return current["creds"]

    async def handler(req: ConnectRequest) -> None:
        req.respond(200)

    server = HboneServer(credentials, handler, H2Settings())
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    await server.serve(listener)
    expected = [Identity.parse(SERVER_ID), Identity.parse(spiffe(namespace="ns1", sa="rotated"))]
    client = TlsCredentials.build(issue(ca, CLIENT_ID))
    seen = []
    for c in creds:
        current["creds"] = c
        sock = socket.socket()
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, listener.getsockname())
        conn = await HboneConnection.open(sock, client, expected, H2Settings())
        seen.append(str(conn.peer_identity))
        conn.abort()
    await server.shutdown(graceful=False)
    assert seen == [SERVER_ID, spiffe(namespace="ns1", sa="rotated")]


async def test_server_without_credentials_refuses_the_handshake_and_keeps_serving(ca: CA) -> None:
    creds = TlsCredentials.build(issue(ca, SERVER_ID))
    available: dict[str, TlsCredentials | None] = {"creds": None}
    errors: list[Exception] = []

    async def credentials() -> TlsCredentials:
        if available["creds"] is None:
            raise LookupError("no certificate yet")
        return available["creds"]

    async def handler(req: ConnectRequest) -> None:
        req.respond(200)

    server = HboneServer(
        credentials, handler, H2Settings(), on_tls_error=lambda _peer, _local, e: errors.append(e)
    )
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    await server.serve(listener)
    client = TlsCredentials.build(issue(ca, CLIENT_ID))

    async def dial() -> socket.socket:
        sock = socket.socket()
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, listener.getsockname())
        return sock

    with pytest.raises(TlsHandshakeError):
        await HboneConnection.open(await dial(), client, [Identity.parse(SERVER_ID)], H2Settings())
    assert "no certificate to serve: no certificate yet" in str(errors[0])
    available["creds"] = creds
    conn = await HboneConnection.open(await dial(), client, [Identity.parse(SERVER_ID)], H2Settings())
    assert str(conn.peer_identity) == SERVER_ID
    conn.abort()
    await server.shutdown(graceful=False)


def test_credentials_from_pem_round_trip(ca: CA) -> None:
    intermediate = make_ca("intermediate", parent=ca)
    original = TlsCredentials.build(issue(intermediate, SERVER_ID))
    chain, key, roots = original.pem()
    copy = TlsCredentials.from_pem(chain, key, roots)
    assert copy.identity == original.identity == Identity.parse(SERVER_ID)
    assert copy.pem() == original.pem()
    assert (copy.cert.not_before, copy.cert.not_after) == (original.cert.not_before, original.cert.not_after)
    assert copy.server is not original.server  # contexts of its own
    with pytest.raises(ValueError, match="no SPIFFE identity"):
        TlsCredentials.from_pem(*TlsCredentials.build(issue(ca, "https://example.com/x")).pem())


def _open_key_files() -> list[str]:
    """The anonymous in-memory files of key pairs this process has open."""
    links = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):  # the listing's own fd, closed since
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
    return [link for link in links if link.startswith("/memfd:hbone-pair")]


@pytest.mark.parametrize("memfd", [True, False], ids=["memfd", "no-memfd"])
def test_contexts_pin_tls13_h2_and_leave_no_key_file(
    ca: CA, monkeypatch: pytest.MonkeyPatch, memfd: bool
) -> None:
    loaded: list[tuple[str, str, int, int]] = []
    real_load = ssl.SSLContext.load_cert_chain

    def spy(self: ssl.SSLContext, certfile: str, *args: object, **kwargs: object) -> None:
        target = os.readlink(certfile) if certfile.startswith("/proc/self/fd/") else certfile
        modes = os.stat(certfile).st_mode & 0o777, os.stat(os.path.dirname(certfile)).st_mode & 0o777
        loaded.append((certfile, target, *modes))
        real_load(self, certfile, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ssl.SSLContext, "load_cert_chain", spy)
    if not memfd:
        monkeypatch.delattr(os, "memfd_create")  # a platform without it
    cert = issue(ca, SERVER_ID)
    for ctx in (TlsCredentials.build(cert).server, TlsCredentials.build(cert).client):
        assert ctx.minimum_version == ssl.TLSVersion.TLSv1_3
        assert ctx.maximum_version == ssl.TLSVersion.TLSv1_3
        assert ctx.verify_mode == ssl.CERT_REQUIRED
        assert ctx.options & ssl.OP_NO_TICKET
    assert TlsCredentials.build(cert).server.num_tickets == 0
    assert not TlsCredentials.build(cert).client.check_hostname
    assert loaded
    for path, target, file_mode, dir_mode in loaded:
        if memfd:
            # An anonymous file in memory, in no directory, closed right after.
            assert path.startswith("/proc/self/fd/") and target.startswith("/memfd:hbone-pair")
        else:
            # A private file (0600 in a 0700 directory), deleted right after.
            assert (file_mode, dir_mode) == (0o600, 0o700)
            assert not os.path.exists(path) and not os.path.exists(os.path.dirname(path))
    assert _open_key_files() == []


async def test_peer_identities_ignore_non_spiffe_uris(ca: CA, serve) -> None:
    srv = await serve(
        issue(
            ca,
            "spiffe://cluster.local/ns/a/sa/b/extra",  # six parts: not an identity
            extra_uris=["https://example.com", spiffe(namespace="a", sa="ok"), "spiffe://td/nsx/a/sa/b"],
        )
    )
    ok = Identity.parse(spiffe(namespace="a", sa="ok"))
    conn = await HboneConnection.open(
        await srv.dial(), TlsCredentials.build(issue(ca, CLIENT_ID)), [ok], H2Settings()
    )
    # The verified leaf as the handshake saw it: only the SAN that is a SPIFFE identity counts.
    assert peer_identities(conn.get_extra_info(TLS_PEER)) == [ok]
    assert conn.peer_identity == ok
    conn.abort()
