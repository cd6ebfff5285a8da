"""HBONE's TLS on pyOpenSSL: the engine CRL enforcement runs on before Python 3.13.

The `ssl` module gives a peer's verified chain publicly only from 3.13, and the CRL checks need it
(an intermediate can be revoked), so with CRLs HBONE's TLS runs on pyOpenSSL in memory-BIO mode
(`hbone.tlsio`). What a user sees must not change: the same TLS 1.3 and ALPN, the same identities,
bytes carried both ways with flow control, refusals that say why, handshake timeouts, and peers on
the other engine (a proxy without CRLs) or from other code (`openssl s_client`) served alike. The
revocation behaviour itself is tested in test_hbone_revocation.py, which runs on this engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import ssl
import sys
from pathlib import Path

import pytest

from hbone.client import HboneConnection
from hbone.errors import TlsHandshakeError
from hbone.identity import Identity
from hbone.settings import H2Settings
from hbone.tls import TLS_PEER, Revocation, TlsCredentials, TlsPeer, TlsPolicy
from tests.certs import CA, issue, make_ca, spiffe
from tests.h2loopback import loopback_fixture, transfer_8mib  # noqa: F401  (the fixture)
from tests.test_hbone_revocation import Peer, peers_fixture, start  # noqa: F401  (the fixture)
from tests.waiting import eventually_async

pytestmark = pytest.mark.timeout(60)

SERVER_ID = spiffe(namespace="ns1", sa="server")
CLIENT_ID = spiffe(namespace="ns2", sa="client")
ON_PYOPENSSL = sys.version_info < (3, 13)


def crl_policy() -> TlsPolicy:
    return TlsPolicy(revocation=Revocation(()))


@pytest.fixture(scope="module")
def ca() -> CA:
    return make_ca()


def test_crls_before_python_313_build_pyopenssl_contexts(ca: CA) -> None:
    plain = TlsCredentials.build(issue(ca, SERVER_ID))
    with_crls = TlsCredentials.build(issue(ca, SERVER_ID), crl_policy())
    assert plain.openssl is None  # without CRLs: the event loop's TLS, as always
    assert (with_crls.openssl is not None) == ON_PYOPENSSL


@pytest.mark.skipif(not ON_PYOPENSSL, reason="Python 3.13 has the verified chain in ssl")
async def test_on_pyopenssl_the_handshake_is_tls13_h2_with_both_identities(ca: CA, peers: list[Peer]) -> None:
    mid = make_ca("hbone test intermediate", parent=ca)
    srv = await start(peers, TlsCredentials.build(issue(mid, SERVER_ID), crl_policy()))
    conn = await HboneConnection.open(
        await srv.dial(),
        TlsCredentials.build(issue(ca, CLIENT_ID), crl_policy()),
        [Identity.parse(SERVER_ID)],
        H2Settings(),
    )
    assert conn.get_extra_info("ssl_object") is None  # not the ssl module's
    cipher = conn.get_extra_info("cipher")
    assert isinstance(cipher, tuple)
    assert cipher[0] in ("TLS_AES_256_GCM_SHA384", "TLS_AES_128_GCM_SHA256") and cipher[1] == "TLSv1.3"
    peer = conn.get_extra_info(TLS_PEER)
    assert isinstance(peer, TlsPeer) and peer.alpn == "h2" and SERVER_ID in peer.uri_sans
    assert len(peer.chain) == 3  # the verified chain: leaf, intermediate, root
    assert str(conn.peer_identity) == SERVER_ID
    await conn.connect("127.0.0.1:80")
    assert str(srv.requests[0].peer_identity) == CLIENT_ID
    conn.abort()


@pytest.mark.parametrize(
    ("server_crls", "client_crls"),
    [(True, True), (True, False), (False, True)],
    ids=["both-pyopenssl", "pyopenssl-server", "pyopenssl-client"],
)
async def test_8mib_each_way_across_either_engine(loopback, server_crls: bool, client_crls: bool) -> None:
    lb = await loopback(
        server_policy=crl_policy() if server_crls else None,
        client_policy=crl_policy() if client_crls else None,
    )
    await transfer_8mib(lb)
    assert lb.tls_errors == []


async def test_a_server_from_an_untrusted_ca_is_refused_with_openssls_reason(
    ca: CA, peers: list[Peer]
) -> None:
    srv = await start(peers, TlsCredentials.build(issue(make_ca("stranger"), SERVER_ID)))
    with pytest.raises(TlsHandshakeError) as err:
        await HboneConnection.open(
            await srv.dial(),
            TlsCredentials.build(issue(ca, CLIENT_ID), crl_policy()),
            [Identity.parse(SERVER_ID)],
            H2Settings(),
        )
    assert "certificate verify failed" in str(err.value)


async def test_a_client_from_an_untrusted_ca_is_refused_and_the_server_says_why(
    ca: CA, peers: list[Peer]
) -> None:
    srv = await start(peers, TlsCredentials.build(issue(ca, SERVER_ID), crl_policy()))
    with pytest.raises(TlsHandshakeError):
        await HboneConnection.open(
            await srv.dial(),
            # a stranger's certificate, though it trusts our CA
            TlsCredentials.build(
                dataclasses.replace(
                    issue(make_ca("stranger"), CLIENT_ID), roots_pem=issue(ca, CLIENT_ID).roots_pem
                )
            ),
            [Identity.parse(SERVER_ID)],
            H2Settings(),
        )
    await eventually_async(lambda: len(srv.errors) == 1, "the server's TLS error")
    assert "certificate verify failed" in str(srv.errors[0])
    # The listener keeps serving the trusted.
    conn = await HboneConnection.open(
        await srv.dial(),
        TlsCredentials.build(issue(ca, CLIENT_ID)),
        [Identity.parse(SERVER_ID)],
        H2Settings(),
    )
    conn.abort()


async def test_a_client_without_alpn_h2_is_refused(ca: CA, peers: list[Peer], tmp_path: Path) -> None:
    srv = await start(peers, TlsCredentials.build(issue(ca, SERVER_ID), crl_policy()))
    cert = issue(ca, CLIENT_ID)
    pair = tmp_path / "pair.pem"
    pair.write_bytes(cert.key_pem + b"".join(cert.chain_pem))
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.load_verify_locations(cadata=b"".join(cert.roots_pem).decode())
    ctx.load_cert_chain(pair)
    ctx.set_alpn_protocols(["http/1.1"])
    reader, writer = await asyncio.open_connection(*srv.addr, ssl=ctx, server_hostname="")
    assert writer.get_extra_info("ssl_object").selected_alpn_protocol() is None
    assert await asyncio.wait_for(reader.read(), 10) == b""  # closed, no HTTP/2 spoken
    writer.close()
    await eventually_async(lambda: len(srv.errors) == 1, "the server's TLS error")
    assert "ALPN negotiated None, expected 'h2'" in str(srv.errors[0])


def _client_hello(ca: CA) -> tuple[ssl.SSLObject, ssl.MemoryBIO, ssl.MemoryBIO, bytes]:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.load_verify_locations(cadata=b"".join(issue(ca, CLIENT_ID).roots_pem).decode())
    ctx.set_alpn_protocols(["h2"])
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing)
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    return obj, incoming, outgoing, outgoing.read()


async def test_a_handshake_that_stalls_times_out_and_one_cut_short_is_reported(
    ca: CA, peers: list[Peer]
) -> None:
    srv = await start(peers, TlsCredentials.build(issue(ca, SERVER_ID), crl_policy()), handshake_timeout=0.5)
    loop = asyncio.get_running_loop()
    stalled = await srv.dial()
    await loop.sock_sendall(stalled, _client_hello(ca)[3])  # then never answers the ServerHello
    cut = await srv.dial()
    await loop.sock_sendall(cut, _client_hello(ca)[3])
    assert await asyncio.wait_for(loop.sock_recv(cut, 65536), 5)  # the server's flight, then a FIN
    cut.close()
    await eventually_async(lambda: len(srv.errors) == 2, "both TLS errors", timeout=5)
    reasons = sorted(str(e) for e in srv.errors)
    assert any("connection closed during the handshake" in r for r in reasons), reasons
    assert any("did not finish within the handshake timeout" in r for r in reasons), reasons
    stalled.close()
    assert not srv.server.sessions


async def test_a_silent_server_times_the_client_out(ca: CA) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    sock = socket.socket()
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, listener.getsockname())
    try:
        with pytest.raises(TlsHandshakeError, match="did not finish within the handshake timeout"):
            await HboneConnection.open(
                sock,
                TlsCredentials.build(issue(ca, CLIENT_ID), crl_policy()),
                [Identity.parse(SERVER_ID)],
                H2Settings(),
                handshake_timeout=0.3,
            )
        await eventually_async(lambda: sock.fileno() == -1, "the socket closed", timeout=2)
    finally:
        listener.close()


async def _s_client(args: list[str], wait_for: str = "Verify return code") -> str:
    proc = await asyncio.create_subprocess_exec(
        "openssl", "s_client", *args,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdin is not None
    lines: list[str] = []
    async with asyncio.timeout(20):
        while not any(line.startswith(wait_for) for line in lines):
            line = (await proc.stdout.readline()).decode(errors="replace")
            if not line:
                break
            lines.append(line)
        # TLS 1.3 tickets come after the handshake: time for one to show (a negative check: correct
        # code passes however long this is).
        await asyncio.sleep(0.3)
        proc.stdin.close()
        rest = await proc.stdout.read()
        await proc.wait()
    return "".join(lines) + rest.decode(errors="replace")


@pytest.mark.skipif(not ON_PYOPENSSL, reason="Python 3.13 has the verified chain in ssl")
async def test_openssl_s_client_sees_tls13_aes_gcm_h2_and_no_resumption(
    ca: CA, peers: list[Peer], tmp_path: Path
) -> None:
    srv = await start(peers, TlsCredentials.build(issue(ca, SERVER_ID), crl_policy()))
    cert = issue(ca, CLIENT_ID)
    (tmp_path / "cert.pem").write_bytes(b"".join(cert.chain_pem))
    (tmp_path / "key.pem").write_bytes(cert.key_pem)
    (tmp_path / "ca.pem").write_bytes(b"".join(cert.roots_pem))
    base = [
        "-connect", f"127.0.0.1:{srv.addr[1]}", "-alpn", "h2", "-cert", str(tmp_path / "cert.pem"),
        "-key", str(tmp_path / "key.pem"), "-CAfile", str(tmp_path / "ca.pem"), "-verify_return_error",
    ]  # fmt: skip
    first = await _s_client([*base, "-sess_out", str(tmp_path / "sess.pem")])
    assert "New, TLSv1.3" in first, first
    assert "ALPN protocol: h2" in first, first
    assert "Verify return code: 0 (ok)" in first, first
    assert "TLS_AES_256_GCM_SHA384" in first, first
    if (tmp_path / "sess.pem").exists():  # a ticket came; it must not resume
        second = await _s_client([*base, "-sess_in", str(tmp_path / "sess.pem")])
        assert "Reused," not in second and "New, TLSv1.3" in second, second
    # TLS 1.3 is AES-GCM only: a client offering ChaCha20 alone is refused.
    chacha = await _s_client([*base, "-ciphersuites", "TLS_CHACHA20_POLY1305_SHA256"], wait_for="Verify")
    assert "New, TLSv1.3" not in chacha, chacha
    await eventually_async(lambda: len(srv.errors) >= 1, "the server's TLS error")
    assert any("no shared cipher" in str(e) or "handshake failure" in str(e) for e in srv.errors), srv.errors
