"""Certificate revocation with `ztunnel proxy` processes on loopback (fake CA, SOCKS5 in, echo app behind the
server's proxy): a CRL_PATH change tears down the revoked peer's open connections, inbound and
outbound, leaves the others alone, refuses the revoked peer's new handshakes, and says so in the
metrics (`CERT_REVOKED`, `istio_crl_policy_rejections_total`) and the logs. And `TLS12_ENABLED`:
a proxy serves TLS 1.2 only when it is set."""

from __future__ import annotations

import asyncio
import base64
import random
import ssl
from collections.abc import AsyncIterator
from importlib import resources
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from hbone.identity import Identity
from hbone.tls import TlsCredentials, TlsPolicy
from tests.apps import Echo, socks5_connect, start_echo
from tests.certs import CA, make_crl
from tests.harness import Fleet, Proxy, proxy_env
from tests.waiting import eventually_async
from ztunnel.identity.certificates import FakeCA

pytestmark = pytest.mark.timeout(60)

NET = f"127.{random.randint(16, 250)}.{random.randint(0, 250)}"
SERVER, FRONTEND, OTHER = (f"{NET}.{i}" for i in (3, 2, 4))

CONFIG = "workloads:\n" + "".join(
    f"""  - uid: t//v1/Pod/demo/{name}
    name: {name}
    namespace: demo
    serviceAccount: {name}
    trustDomain: cluster.local
    workloadIps: ["{ip}"]
    protocol: HBONE
"""
    for name, ip in (("server", SERVER), ("frontend", FRONTEND), ("other", OTHER))
)


def fake_ca() -> CA:
    """The fake CA's embedded root, as a test CA that can sign CRLs."""
    data = resources.files("ztunnel") / "testdata"
    key = serialization.load_pem_private_key(data.joinpath("ca-key.pem").read_bytes(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    root_pem = data.joinpath("root-cert.pem").read_bytes()
    return CA(key, x509.load_pem_x509_certificate(root_pem), (), root_pem)


def crl_rejections(proxy: Proxy) -> float:
    """`istio_crl_policy_rejections_total` as the stats endpoint renders it (0 when absent)."""
    return proxy.metric("istio_crl_policy_rejections_total")


async def leaf_of(proxy: Proxy, name: str) -> x509.Certificate:
    """The workload's leaf certificate as `/config_dump` shows it."""
    dump = await asyncio.to_thread(proxy.config_dump)
    [cert] = [c for c in dump["certificates"] if c["identity"] == f"spiffe://cluster.local/ns/demo/sa/{name}"]
    return x509.load_pem_x509_certificate(base64.b64decode(cert["certChain"][0]["pem"]))


def replace(path: Path, data: bytes) -> None:
    """A new file in one step, as an operator's tooling (or a mounted Secret) swaps it: no process
    reads it half written."""
    tmp = path.with_suffix(".new")
    tmp.write_bytes(data)
    tmp.replace(path)


async def reloaded_everywhere(proxy: Proxy) -> None:
    """Until each process that loaded the CRL at start (every worker watches the file for its own
    TLS contexts) has logged reloading it: before that, a worker may still take a revoked peer."""

    def count(what: str) -> int:
        return sum(1 for line in proxy.log().splitlines() if f'"{what} ' in line and "CRL(s) from" in line)

    await eventually_async(
        lambda: count("loaded") > 0 and count("reloaded") >= count("loaded"),
        lambda: (
            f"the CRL reloaded by every worker of {proxy.name} ({count('reloaded')} of {count('loaded')})"
        ),
    )


class Held:
    """A connection through a proxy's SOCKS5 listener to the echo app, kept open."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, proxy_ip: str) -> Held:
        code, reader, writer = await socks5_connect((proxy_ip, 15080), SERVER, 8080)
        assert code == 0
        held = cls(reader, writer)
        assert await held.echo(b"hello")
        return held

    async def echo(self, data: bytes) -> bool:
        """True when `data` comes back; False when the connection is gone."""
        try:
            self.writer.write(data)
            await self.writer.drain()
            return await asyncio.wait_for(self.reader.readexactly(len(data)), 5) == data
        except (ConnectionError, asyncio.IncompleteReadError):
            return False

    async def closed(self) -> bool:
        try:
            return await asyncio.wait_for(self.reader.read(1), 10) == b""
        except ConnectionError:
            return True


@pytest.fixture
async def echo() -> AsyncIterator[Echo]:
    e = await start_echo(SERVER, 8080)
    yield e
    e.server.close()


def env(name: str, ip: str, crl: Path | None = None) -> dict[str, str]:
    extra = {"CRL_PATH": str(crl)} if crl is not None else {}
    return proxy_env(ip, f"demo/{name}/{name}", CONFIG, **extra)


async def test_inbound_reload_tears_down_the_revoked_client_only(
    tmp_path: Path,
    echo: Echo,
    fleet: Fleet,
) -> None:
    ca = fake_ca()
    crl = tmp_path / "crl.pem"
    crl.write_bytes(make_crl(ca))
    server, frontend, other = await fleet.start(
        env("server", SERVER, crl), env("frontend", FRONTEND), env("other", OTHER)
    )
    revoked_conn = await Held.open(FRONTEND)
    kept_conn = await Held.open(OTHER)
    assert crl_rejections(server) == 0

    replace(crl, make_crl(ca, [await leaf_of(frontend, "frontend")]))
    await reloaded_everywhere(server)

    assert await revoked_conn.closed()
    assert await kept_conn.echo(b"still here")
    await eventually_async(
        lambda: (
            server.metric(
                "istio_tcp_connections_closed_total",
                reporter="destination",
                response_flags="CERT_REVOKED",
            )
            == 1
        ),
        "the torn-down connection recorded with CERT_REVOKED",
        blocking=True,
    )
    assert crl_rejections(server) == 1
    assert "open connection(s) closed as revoked" in server.log()
    # A new connection from the revoked client is refused at the handshake; the other still works.
    code, _reader, writer = await socks5_connect((FRONTEND, 15080), SERVER, 8080)
    writer.close()
    assert code != 0
    assert crl_rejections(server) == 2
    assert await (await Held.open(OTHER)).echo(b"new one")
    assert crl_rejections(other) == 0  # no CRL_PATH: no families
    assert "istio_crl" not in other.metrics_text()


async def test_outbound_reload_drops_the_tunnel_to_a_revoked_server(
    tmp_path: Path, echo: Echo, fleet: Fleet
) -> None:
    ca = fake_ca()
    crl = tmp_path / "crl.pem"
    crl.write_bytes(make_crl(ca))
    server, frontend = await fleet.start(env("server", SERVER), env("frontend", FRONTEND, crl))
    held = await Held.open(FRONTEND)

    replace(crl, make_crl(ca, [await leaf_of(server, "server")]))
    await reloaded_everywhere(frontend)

    assert await held.closed()
    await eventually_async(
        lambda: (
            frontend.metric(
                "istio_tcp_connections_closed_total",
                reporter="source",
                response_flags="CERT_REVOKED",
            )
            == 1
        ),
        "the dropped tunnel recorded with CERT_REVOKED",
        blocking=True,
    )
    # A new connection is refused: the server's chain is revoked at the handshake.
    code, _reader, writer = await socks5_connect((FRONTEND, 15080), SERVER, 8080)
    writer.close()
    assert code != 0
    await eventually_async(
        lambda: (
            frontend.metric(
                "istio_tcp_connections_closed_total",
                reporter="source",
                response_flags="CERT_REVOKED",
            )
            + frontend.metric(
                "istio_tcp_connections_failed_total",
                reporter="source",
                response_flags="CERT_REVOKED",
            )
            >= 2
        ),
        "the refused connection recorded with CERT_REVOKED",
        blocking=True,
    )
    assert crl_rejections(frontend) == 2


async def _tls12_handshake(ip: str) -> str:
    """A TLS 1.2-only client with a fake-CA workload certificate against a proxy's 15008; returns
    the negotiated version or the error."""
    client = TlsCredentials.build(
        FakeCA().issue(Identity("cluster.local", "demo", "frontend")), TlsPolicy(tls12=True)
    ).client
    client.maximum_version = ssl.TLSVersion.TLSv1_2
    try:
        _reader, writer = await asyncio.wait_for(
            asyncio.open_connection(ip, 15008, ssl=client, server_hostname=""), 10
        )
    except (ssl.SSLError, ConnectionError) as e:
        return f"refused: {e}"
    version = writer.get_extra_info("ssl_object").version()
    writer.close()
    return str(version)


async def test_tls12_enabled_serves_tls12_and_the_default_refuses_it(fleet: Fleet) -> None:
    default, _lenient = await fleet.start(
        env("server", SERVER), proxy_env(OTHER, "demo/other/other", CONFIG, TLS12_ENABLED="true")
    )
    refused = await _tls12_handshake(SERVER)
    assert refused.startswith("refused:"), refused
    await eventually_async(
        lambda: "tls handshake error: [SSL: UNSUPPORTED_PROTOCOL]" in default.log(),
        "the proxy's log of the refused TLS 1.2 handshake",
    )
    assert await _tls12_handshake(OTHER) == "TLSv1.2"
