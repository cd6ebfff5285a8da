"""Certificate revocation and TLS versions at the HBONE layer, with real TLS handshakes on loopback:
a revoked client chain refused by the server, a revoked server chain refused by the client, open
sessions torn down when new CRLs revoke them, forged CRLs ignored, TLS 1.2 only when enabled."""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import AsyncIterator

import pytest
from cryptography import x509

from hbone.client import HboneConnection
from hbone.errors import CertificateRevoked, ConnectionClosed, H2HandshakeError, TlsHandshakeError
from hbone.identity import Identity
from hbone.server import ConnectRequest, HboneServer
from hbone.settings import H2Settings
from hbone.tls import Revocation, TlsCredentials, TlsPolicy, parse_crls
from tests.certs import CA, issue, leaf, make_ca, make_crl, spiffe
from tests.waiting import eventually_async

pytestmark = pytest.mark.timeout(30)

SERVER_ID = spiffe(namespace="ns1", sa="server")
CLIENT_ID = spiffe(namespace="ns2", sa="client")


@pytest.fixture(scope="module")
def ca() -> CA:
    return make_ca()


class Counts:
    def __init__(self) -> None:
        self.rejections = 0
        self.untracked = 0

    def revocation(self, crls: bytes | None = None, **kw: int) -> Revocation:
        def rejected() -> None:
            self.rejections += 1

        def untracked() -> None:
            self.untracked += 1

        return Revocation(
            parse_crls(crls) if crls else (), on_rejection=rejected, on_untracked=untracked, **kw
        )


class Peer:
    """An HBONE server on 127.0.0.1 that holds every accepted stream open."""

    def __init__(self, creds: TlsCredentials, handshake_timeout: float | None = None) -> None:
        self.errors: list[Exception] = []
        self.requests: list[ConnectRequest] = []
        self.server = HboneServer(
            creds, self._handle, H2Settings(), on_tls_error=self._error, handshake_timeout=handshake_timeout
        )
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.addr: tuple[str, int] = self.listener.getsockname()

    async def _handle(self, req: ConnectRequest) -> None:
        self.requests.append(req)
        req.respond(200)

        class Hold(asyncio.BufferedProtocol):
            def get_buffer(self, sizehint: int) -> bytearray:
                return bytearray(65536)

            def buffer_updated(self, nbytes: int) -> None:
                pass

        req.stream.set_protocol(Hold())

    def _error(self, _peer: tuple[str, int], _local: tuple[str, int], err: Exception) -> None:
        self.errors.append(err)

    async def dial(self) -> socket.socket:
        sock = socket.socket()
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, self.listener.getsockname())
        return sock


@pytest.fixture(name="peers")
async def peers_fixture() -> AsyncIterator[list[Peer]]:
    made: list[Peer] = []
    yield made
    for p in made:
        await p.server.shutdown(graceful=False)


async def start(peers: list[Peer], creds: TlsCredentials, handshake_timeout: float | None = None) -> Peer:
    p = Peer(creds, handshake_timeout)
    await p.server.serve(p.listener)
    peers.append(p)
    return p


EXPECT = [Identity.parse(SERVER_ID)]


async def test_revoked_client_is_refused_at_the_inbound_handshake(ca: CA, peers: list[Peer]) -> None:
    counts = Counts()
    client_cert = issue(ca, CLIENT_ID)
    policy = TlsPolicy(revocation=counts.revocation(make_crl(ca, [client_cert])))
    srv = await start(peers, TlsCredentials.build(issue(ca, SERVER_ID), policy))
    client = TlsCredentials.build(client_cert)
    with pytest.raises((TlsHandshakeError, H2HandshakeError)):
        conn = await HboneConnection.open(await srv.dial(), client, EXPECT, H2Settings())
        await conn.connect("127.0.0.1:80")
    await eventually_async(lambda: srv.errors, "the server's handshake error")
    [err] = srv.errors
    assert isinstance(err, CertificateRevoked)
    assert f"serial {leaf(client_cert).serial_number:#x}" in str(err)
    assert "invalid peer certificate: Revoked" in str(err)
    assert srv.requests == []
    assert counts.rejections == 1
    # Another client of the same CA is not revoked and gets through.
    other = TlsCredentials.build(issue(ca, spiffe(namespace="ns2", sa="other")))
    conn = await HboneConnection.open(await srv.dial(), other, EXPECT, H2Settings())
    await conn.connect("127.0.0.1:80")
    conn.abort()
    assert counts.rejections == 1


async def test_revoked_server_is_refused_outbound(ca: CA, peers: list[Peer]) -> None:
    counts = Counts()
    server_cert = issue(ca, SERVER_ID)
    srv = await start(peers, TlsCredentials.build(server_cert))
    policy = TlsPolicy(revocation=counts.revocation(make_crl(ca, [server_cert])))
    client = TlsCredentials.build(issue(ca, CLIENT_ID), policy)
    with pytest.raises(CertificateRevoked) as err:
        await HboneConnection.open(await srv.dial(), client, EXPECT, H2Settings())
    assert "invalid peer certificate: Revoked" in str(err.value)
    assert counts.rejections == 1
    await asyncio.sleep(0)
    assert srv.requests == []


async def test_revoked_intermediate_refuses_its_whole_subtree(ca: CA, peers: list[Peer]) -> None:
    # Needs the peer's verified chain (a private API of Python 3.11's ssl): fails loudly if it goes.
    intermediate = make_ca("intermediate", parent=ca)
    counts = Counts()
    policy = TlsPolicy(revocation=counts.revocation(make_crl(ca, [intermediate.cert])))
    srv = await start(peers, TlsCredentials.build(issue(intermediate, SERVER_ID)))
    client = TlsCredentials.build(issue(ca, CLIENT_ID), policy)
    with pytest.raises(CertificateRevoked) as err:
        await HboneConnection.open(await srv.dial(), client, EXPECT, H2Settings())
    assert "certificate 1 of the peer's chain" in str(err.value)


async def test_unknown_status_and_forged_crls_are_accepted(ca: CA, peers: list[Peer]) -> None:
    other_ca = make_ca("unrelated")
    server_cert = issue(ca, SERVER_ID)
    # A CRL of another CA, and one naming our CA as issuer but signed with a foreign key.
    crls = make_crl(other_ca, [issue(other_ca, SERVER_ID)]) + make_crl(ca, [server_cert], signer=other_ca)
    counts = Counts()
    srv = await start(peers, TlsCredentials.build(server_cert))
    client = TlsCredentials.build(issue(ca, CLIENT_ID), TlsPolicy(revocation=counts.revocation(crls)))
    conn = await HboneConnection.open(await srv.dial(), client, EXPECT, H2Settings())
    await conn.connect("127.0.0.1:80")
    conn.abort()
    assert counts.rejections == 0


async def test_reload_tears_down_revoked_inbound_sessions_only(ca: CA, peers: list[Peer]) -> None:
    counts = Counts()
    revocation = counts.revocation()
    srv = await start(peers, TlsCredentials.build(issue(ca, SERVER_ID), TlsPolicy(revocation=revocation)))
    bad_cert, good_cert = issue(ca, CLIENT_ID), issue(ca, spiffe(namespace="ns2", sa="good"))
    bad = await HboneConnection.open(await srv.dial(), TlsCredentials.build(bad_cert), EXPECT, H2Settings())
    good = await HboneConnection.open(await srv.dial(), TlsCredentials.build(good_cert), EXPECT, H2Settings())
    bad_stream = await bad.connect("127.0.0.1:80")
    good_stream = await good.connect("127.0.0.1:80")
    await eventually_async(lambda: revocation.tracked == 2, "both sessions tracked")

    torn = revocation.replace(parse_crls(make_crl(ca, [bad_cert])))

    assert torn == 1 and counts.rejections == 1
    await asyncio.wait_for(bad.wait_closed(), 5)  # the server cut it (GOAWAY, then close)
    assert isinstance(bad.close_reason, ConnectionClosed)
    assert bad_stream.is_closing()
    with pytest.raises(ConnectionClosed):
        await bad.connect("127.0.0.1:81")
    assert good.is_usable() and not good_stream.is_closing()
    await good.connect("127.0.0.1:82")
    assert revocation.tracked == 1
    good.abort()
    await asyncio.wait_for(good.wait_closed(), 5)
    await eventually_async(lambda: revocation.tracked == 0, "the closed session released")


async def test_reload_drops_outbound_connection_to_a_revoked_server(ca: CA, peers: list[Peer]) -> None:
    counts = Counts()
    revocation = counts.revocation()
    server_cert = issue(ca, SERVER_ID)
    srv = await start(peers, TlsCredentials.build(server_cert))
    client = TlsCredentials.build(issue(ca, CLIENT_ID), TlsPolicy(revocation=revocation))
    conn = await HboneConnection.open(await srv.dial(), client, EXPECT, H2Settings())
    await conn.connect("127.0.0.1:80")
    assert revocation.tracked == 1
    assert revocation.replace(parse_crls(make_crl(ca, [server_cert]))) == 1
    await asyncio.wait_for(conn.wait_closed(), 5)
    assert isinstance(conn.close_reason, CertificateRevoked)
    assert not conn.is_usable()
    # The server saw its connection go away.
    await eventually_async(lambda: not srv.server.sessions, "the server's session closed")


async def test_sessions_over_the_tracking_cap_are_counted_untracked(ca: CA, peers: list[Peer]) -> None:
    counts = Counts()
    revocation = counts.revocation(max_tracked=1)
    srv = await start(peers, TlsCredentials.build(issue(ca, SERVER_ID)))
    client = TlsCredentials.build(issue(ca, CLIENT_ID), TlsPolicy(revocation=revocation))
    a = await HboneConnection.open(await srv.dial(), client, EXPECT, H2Settings())
    b = await HboneConnection.open(await srv.dial(), client, EXPECT, H2Settings())
    assert (revocation.tracked, counts.untracked) == (1, 1)
    a.abort()
    b.abort()


def test_parse_crls_names_what_is_wrong(ca: CA) -> None:
    assert len(parse_crls(make_crl(ca) + b"\n" + make_crl(make_ca("b")))) == 2
    with pytest.raises(ValueError, match="no PEM CRL"):
        parse_crls(b"not a crl")
    with pytest.raises(ValueError, match="CRL 1 does not parse"):
        parse_crls(b"-----BEGIN X509 CRL-----\nAAAA\n-----END X509 CRL-----\n")
    with pytest.raises(ValueError, match="CRL 2 has no END line"):
        parse_crls(make_crl(ca) + b"-----BEGIN X509 CRL-----\nAAAA\n")
    assert isinstance(parse_crls(make_crl(ca))[0], x509.CertificateRevocationList)


def _tls12_client(ca: CA) -> ssl.SSLContext:
    ctx = TlsCredentials.build(issue(ca, CLIENT_ID), TlsPolicy(tls12=True)).client
    ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    return ctx


async def test_tls12_is_refused_by_default_and_served_when_enabled(ca: CA, peers: list[Peer]) -> None:
    strict = await start(peers, TlsCredentials.build(issue(ca, SERVER_ID)))
    with pytest.raises((ssl.SSLError, ConnectionError)):
        await asyncio.open_connection(sock=await strict.dial(), ssl=_tls12_client(ca), server_hostname="")
    await eventually_async(lambda: strict.errors, "the TLS 1.3-only server's refusal")
    assert "unsupported protocol" in str(strict.errors[0]).lower()

    lenient = await start(peers, TlsCredentials.build(issue(ca, SERVER_ID), TlsPolicy(tls12=True)))
    _reader, writer = await asyncio.open_connection(
        sock=await lenient.dial(), ssl=_tls12_client(ca), server_hostname=""
    )
    ssl_object = writer.get_extra_info("ssl_object")
    assert ssl_object.version() == "TLSv1.2"
    assert ssl_object.cipher()[0] in ("ECDHE-ECDSA-AES256-GCM-SHA384", "ECDHE-ECDSA-AES128-GCM-SHA256")
    assert ssl_object.selected_alpn_protocol() == "h2"
    writer.close()
    # A default (TLS 1.3) client still gets TLS 1.3 from the lenient server.
    conn = await HboneConnection.open(
        await lenient.dial(), TlsCredentials.build(issue(ca, CLIENT_ID)), EXPECT, H2Settings()
    )
    assert conn.get_extra_info("ssl_object").version() == "TLSv1.3"  # type: ignore[union-attr]
    conn.abort()
