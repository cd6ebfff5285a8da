"""`ztunnel proxy` processes fed by the development control plane over real gRPC: state over Delta
ADS, certificates from its CA, live policy pushes, and a control-plane restart under traffic."""

from __future__ import annotations

import asyncio
import os
import random
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.apps import echo_roundtrip, free_port, openssl_s_client, sha, socks5_connect, start_echo
from tests.certs import make_ca
from tests.harness import ControlPlane, Fleet, Proxy, proxy_env
from tests.waiting import eventually_async

NET = f"127.{random.randint(16, 250)}.{random.randint(0, 250)}"
SERVER, CLIENT, CP_HOST = f"{NET}.3", f"{NET}.2", f"{NET}.10"

MESH = f"""
workloads:
  - uid: x//v1/Pod/demo/server
    name: server
    namespace: demo
    serviceAccount: server
    trustDomain: cluster.local
    workloadIps: ["{SERVER}"]
    protocol: HBONE
  - uid: x//v1/Pod/demo/client
    name: client
    namespace: demo
    serviceAccount: client
    trustDomain: cluster.local
    workloadIps: ["{CLIENT}"]
    protocol: HBONE
policies:
  - name: allow-client
    namespace: demo
    scope: Namespace
    action: Allow
    dryRun: false
    rules:
      - - - principals: [!Exact "cluster.local/ns/demo/sa/client"]
"""

DENY_CLIENT = """
  - name: deny-client
    namespace: demo
    scope: Namespace
    action: Deny
    dryRun: false
    rules:
      - - - principals: [!Exact "cluster.local/ns/demo/sa/client"]
"""


def ready(ip: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{ip}:15021/healthz/ready", timeout=2) as r:
            return bool(r.status == 200)
    except OSError:  # HTTPError (500: not ready yet) included
        return False


@dataclass
class Mesh:
    cp: ControlPlane
    server: Proxy
    client: Proxy


def xds_env(cp: ControlPlane, name: str, ip: str) -> dict[str, str]:
    return cp.wire(proxy_env(ip, f"demo/{name}/{name}"))


@pytest.fixture
async def mesh(tmp_path: Path, fleet: Fleet) -> AsyncIterator[Mesh]:
    cp = await asyncio.to_thread(fleet.control_plane, tmp_path, CP_HOST, MESH)
    echo = await start_echo(SERVER, 8080)
    try:
        # Ready only once synced: the accept loops start then, and readiness turns 200 once they have.
        server, client = await fleet.start(xds_env(cp, "server", SERVER), xds_env(cp, "client", CLIENT))
        yield Mesh(cp, server, client)
    finally:
        echo.server.close()
        cp.stop()


def has_policy(proxy: Proxy, namespace: str, name: str) -> bool:
    return any((p["namespace"], p["name"]) == (namespace, name) for p in proxy.config_dump()["policies"])


async def test_traffic_with_certificates_from_the_control_plane(mesh: Mesh) -> None:
    payload = os.urandom(100_000)
    ex = await echo_roundtrip((CLIENT, 15080), SERVER, 8080, payload)
    assert (ex.code, ex.digest) == (0, sha(payload))
    dump = mesh.server.config_dump()
    [cert] = dump["certificates"]
    assert cert["identity"] == "spiffe://cluster.local/ns/demo/sa/server"
    assert cert["state"] == "Available"


async def test_openssl_sees_the_workload_san_chained_to_the_control_plane_root(
    mesh: Mesh, tmp_path: Path
) -> None:
    # A client certificate from the same CA, as another workload would have.
    from hbone.identity import Identity
    from ztunnel.identity.caclient import GrpcCaClient

    ca = GrpcCaClient(f"http://{mesh.cp.address}")
    cert = await ca.fetch(Identity("cluster.local", "demo", "client"))
    await ca.close()
    (tmp_path / "c.crt").write_bytes(b"".join(cert.chain_pem))
    (tmp_path / "c.key").write_bytes(cert.key_pem)
    assert mesh.cp.root is not None
    view = await openssl_s_client(
        f"{SERVER}:15008", str(tmp_path / "c.crt"), str(tmp_path / "c.key"), str(mesh.cp.root)
    )
    text = view.text
    assert "Verify return code: 0 (ok)" in text, text
    assert view.leaf_sans == ["spiffe://cluster.local/ns/demo/sa/server"]


async def test_policy_pushed_through_the_control_plane_closes_a_live_connection(mesh: Mesh) -> None:
    code, reader, writer = await socks5_connect((CLIENT, 15080), SERVER, 8080)
    assert code == 0
    writer.write(b"ping")
    assert await asyncio.wait_for(reader.readexactly(4), 5) == b"ping"
    mesh.cp.config.write_text(MESH + DENY_CLIENT)
    assert await asyncio.wait_for(reader.read(), 10) == b""
    writer.close()
    await eventually_async(
        lambda: "connection closed due to policy change" in mesh.server.log(), "the closure's log line"
    )
    assert "connection closed due to policy change" in mesh.server.log()
    code, _, writer = await socks5_connect((CLIENT, 15080), SERVER, 8080)
    writer.close()
    assert code == 2


async def test_control_plane_restart_while_proxies_serve(mesh: Mesh) -> None:
    # A connection held across the outage keeps every byte.
    code, reader, writer = await socks5_connect((CLIENT, 15080), SERVER, 8080)
    assert code == 0

    async def held_echoes(payload: bytes) -> None:
        writer.write(payload)
        await writer.drain()
        assert await asyncio.wait_for(reader.readexactly(len(payload)), 10) == payload

    await held_echoes(b"before the outage")
    mesh.cp.stop()
    # It ended the proxies' streams as it stopped (not gRPC cancelling them after its grace).
    for proxy in (mesh.client, mesh.server):
        await eventually_async(lambda p=proxy: '"XDS client complete"' in p.log(), "the stream ended", 10.0)  # type: ignore[misc]
        assert "Cancelling all calls" not in proxy.log()
    assert "Traceback" not in mesh.cp.log(), mesh.cp.tail()
    # Meanwhile: state and certificates are kept, traffic keeps flowing (new connections included).
    for _ in range(3):
        ex = await echo_roundtrip((CLIENT, 15080), SERVER, 8080, b"while the control plane is down")
        assert ex.code == 0 and ex.received == len(b"while the control plane is down")
    await held_echoes(b"during the outage")
    await mesh.cp.astart()
    await held_echoes(b"after the restart")
    # The proxies reconnect: a change made now reaches them.
    mesh.cp.config.write_text(MESH + DENY_CLIENT)
    await eventually_async(
        lambda: has_policy(mesh.server, "demo", "deny-client"), "the pushed policy", 10.0, 0.1, blocking=True
    )
    assert has_policy(mesh.server, "demo", "deny-client")
    assert "istio_xds_connection_terminations_total" in mesh.server.metrics_text()
    # ... and the policy that came over the resumed stream now cuts it (live re-authorization).
    try:
        tail = await asyncio.wait_for(reader.read(), 10)
    except ConnectionError:
        tail = b""
    assert tail == b""
    writer.close()


async def test_proxy_over_tls_to_the_control_plane(tmp_path: Path, fleet: Fleet) -> None:
    """`https://` addresses: the proxy verifies the control plane with XDS_ROOT_CA / CA_ROOT_CA."""
    cp = await asyncio.to_thread(fleet.control_plane, tmp_path, CP_HOST, MESH, "--tls")
    try:
        env = proxy_env(
            CLIENT,
            "demo/client/client",
            "",
            XDS_ADDRESS=f"https://{cp.address}",
            XDS_ROOT_CA=str(cp.root),
            CA_ADDRESS=f"https://{cp.address}",
            CA_ROOT_CA=str(cp.root),
        )
        del env["FAKE_CA"], env["LOCAL_XDS"]
        [proxy] = await fleet.start(env)  # ready: synced over the verified stream
        dump = proxy.config_dump()
        assert "x//v1/Pod/demo/server" in {w["uid"] for w in dump["workloads"]}

        def certificates() -> list[tuple[str, str]]:
            return [(c["identity"], c["state"]) for c in proxy.config_dump()["certificates"]]

        # Its own certificate, from the CA over TLS.
        await eventually_async(
            lambda: certificates() == [("spiffe://cluster.local/ns/demo/sa/client", "Available")],
            lambda: f"the client's certificate: {certificates()}",
            10.0,
            blocking=True,
        )
    finally:
        cp.stop()


async def test_a_token_file_found_is_never_sent_in_clear_one_set_explicitly_is_with_a_warning(
    tmp_path: Path, fleet: Fleet
) -> None:
    """Over plaintext `http://`, the token file found at its default path (the pod's own credential)
    stays home: the control plane, which wants it, refuses the proxy. Named in AUTH_TOKEN, it is
    sent, and the proxy says once that it goes in clear."""
    pod = tmp_path / "pod"  # the proxy's working directory: ./var/run/secrets/tokens/istio-token
    token = pod / "var/run/secrets/tokens/istio-token"
    token.parent.mkdir(parents=True)
    token.write_text("the pod's own token")
    cp = await asyncio.to_thread(
        fleet.control_plane, tmp_path / "cp", CP_HOST, MESH, "--auth-token", str(token)
    )
    try:
        found = fleet.proxy(xds_env(cp, "client", CLIENT), wrap=["env", "-C", str(pod)])
        found.spawn()
        await eventually_async(
            lambda: "no authorization header" in found.log() and cp.log().count("refused") >= 2,
            lambda: f"the calls refused for want of a token: {found.log()[-2000:]}\n{cp.tail()}",
            30.0,
        )
        assert "the token file ./var/run/secrets/tokens/istio-token is not sent over plaintext" in found.log()
        assert "the pod's own token" not in found.log() and not ready(found.ip)
        explicit = fleet.proxy(
            {**xds_env(cp, "server", SERVER), "AUTH_TOKEN": "var/run/secrets/tokens/istio-token"},
            wrap=["env", "-C", str(pod)],
        )
        await asyncio.to_thread(explicit.start)  # ready: synced with the token
        await eventually_async(
            lambda: [c["state"] for c in explicit.config_dump()["certificates"]] == ["Available"],
            lambda: f"the server's certificate: {explicit.config_dump()['certificates']}",
            10.0,
            blocking=True,
        )
        assert explicit.log().count("AUTH_TOKEN is sent over plaintext to") == 1
    finally:
        cp.stop()


async def test_resources_that_could_never_route_are_nacked_by_name_and_the_rest_applies(
    tmp_path: Path, fleet: Fleet
) -> None:
    """A workload whose waypoint is on port 0 and a service without a namespace: the proxy NACKs
    each, naming it and why (the control plane logs the NACK), and serves the valid ones beside."""
    broken = MESH.replace(
        "policies:",
        f"""  - uid: x//v1/Pod/demo/lost
    name: lost
    namespace: demo
    workloadIps: ["{NET}.7"]
    protocol: HBONE
    waypoint: {{destination: "demo/wp.demo.svc.cluster.local", hboneMtlsPort: 0}}
services:
  - name: nowhere
    namespace: ""
    hostname: nowhere.svc.cluster.local
    vips: ["/10.96.7.7"]
    ports: {{80: 8080}}
  - name: web
    namespace: demo
    hostname: web.demo.svc.cluster.local
    vips: ["/10.96.7.8"]
    ports: {{80: 8080}}
policies:""",
    )
    cp = await asyncio.to_thread(fleet.control_plane, tmp_path, CP_HOST, broken)
    try:
        [proxy] = await fleet.start(xds_env(cp, "client", CLIENT))  # ready: a NACK answers too
        dump = proxy.config_dump()
        assert {w["uid"] for w in dump["workloads"]} == {"x//v1/Pod/demo/server", "x//v1/Pod/demo/client"}
        assert [s["hostname"] for s in dump["services"]] == ["web.demo.svc.cluster.local"]
        await eventually_async(
            lambda: "NACKed" in cp.log(), lambda: f"the NACK in the control plane's log: {cp.tail()}", 10.0
        )
        [nack] = [line for line in cp.log().splitlines() if "NACKed" in line]
        assert "x//v1/Pod/demo/lost: gateway hbone_mtls_port is 0: the gateway can never be reached" in nack
        assert "/nowhere.svc.cluster.local: service namespace is empty" in nack
    finally:
        cp.stop()


async def test_a_root_file_without_a_certificate_is_refused_not_the_system_store(
    tmp_path: Path, fleet: Fleet
) -> None:
    """An empty XDS_ROOT_CA / CA_ROOT_CA file is refused with a line naming it: the proxy never
    falls back to the default trust store (here SSL_CERT_FILE, which holds the control plane's own
    root), so it never connects, never sends its token, takes neither xDS nor a certificate."""
    cp = await asyncio.to_thread(fleet.control_plane, tmp_path, CP_HOST, MESH, "--tls")
    try:
        empty = tmp_path / "empty-root.pem"
        empty.write_bytes(b"")
        token = tmp_path / "token"
        token.write_text("a secret of the proxy's")
        env = proxy_env(
            CLIENT,
            "demo/client/client",
            XDS_ADDRESS=f"https://{cp.address}",
            XDS_ROOT_CA=str(empty),
            CA_ADDRESS=f"https://{cp.address}",
            CA_ROOT_CA=str(empty),
            AUTH_TOKEN=str(token),
            SSL_CERT_FILE=str(cp.root),
        )
        del env["FAKE_CA"], env["LOCAL_XDS"]
        proxy = fleet.proxy(env)
        proxy.spawn()
        why = f"root certificate {empty} holds no certificate"
        xds_refused = f"XDS client connection error: {why}"
        ca_refused = f"failed to fetch certificate for spiffe://cluster.local/ns/demo/sa/client: CA {cp.address}: {why}"
        await eventually_async(
            lambda: proxy.log().count(xds_refused) >= 2 and ca_refused in proxy.log(),
            lambda: f"the refusals, for xDS and the CA: {proxy.log()[-2000:]}",
            30.0,
        )
        assert "Traceback" not in proxy.log()
        assert not ready(proxy.ip)
        assert cp.streams_opened() == 0, cp.tail()
        assert cp.certificates_issued("spiffe://cluster.local/ns/demo/sa/client") == 0, cp.tail()
    finally:
        cp.stop()


async def test_a_wrong_root_or_address_is_one_clear_line_and_readiness_held(
    tmp_path: Path, fleet: Fleet
) -> None:
    """The control plane over TLS with a root that did not sign it, and an address nobody listens
    on: each proxy says why in a line per attempt, stays not ready, and never logs a traceback."""
    cp = await asyncio.to_thread(fleet.control_plane, tmp_path, CP_HOST, MESH, "--tls")
    try:
        other_root = tmp_path / "other-root.pem"
        other_root.write_bytes(make_ca("not the control plane's").root_pem)
        wrong_root = proxy_env(
            CLIENT, "demo/client/client", XDS_ADDRESS=f"https://{cp.address}", XDS_ROOT_CA=str(other_root)
        )
        nobody = proxy_env(SERVER, "demo/server/server", XDS_ADDRESS=f"http://{CP_HOST}:{free_port(CP_HOST)}")
        cases = {
            "TLS: unable to get local issuer certificate": fleet.proxy(wrong_root),
            "Connection refused": fleet.proxy(nobody),
        }
        for proxy in cases.values():
            del proxy.env["LOCAL_XDS"]
            proxy.spawn()
        for why, proxy in cases.items():
            await eventually_async(
                lambda p=proxy: p.log().count("XDS client connection error") >= 2,  # type: ignore[misc]
                lambda p=proxy: f"two connection errors in {p.log()[-2000:]}",  # type: ignore[misc]
                15.0,
            )
            lines = [line for line in proxy.log().splitlines() if "XDS client connection error" in line]
            assert all(why in line for line in lines), lines
            assert "Traceback" not in proxy.log()
            assert not ready(proxy.ip)
        # A dedicated proxy's own certificate is fetched beside xDS, not once it has synced.
        for proxy in cases.values():
            sa = proxy.env["PROXY_WORKLOAD_INFO"].rsplit("/", 1)[-1]
            mine = [(f"spiffe://cluster.local/ns/demo/sa/{sa}", "Available")]

            def certificates(p: Proxy = proxy) -> list[tuple[str, str]]:
                return [(c["identity"], c["state"]) for c in p.config_dump()["certificates"]]

            await eventually_async(
                lambda c=certificates, m=mine: c() == m,  # type: ignore[misc]
                lambda c=certificates: f"the proxy's own certificate before xDS synced: {c()}",  # type: ignore[misc]
                10.0,
                blocking=True,
            )
            assert not ready(proxy.ip)
    finally:
        cp.stop()
