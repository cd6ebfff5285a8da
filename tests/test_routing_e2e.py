"""Routing end to end on loopback: load balancing over a service's endpoints, waypoints (a test relay,
and a proxy that is the waypoint), application tunnels with PROXY v2, double HBONE through a network
gateway, and a workload known by hostname only. Proxies are `ztunnel proxy` processes on 127.x.y.z;
clients enter through SOCKS5 like a user's would."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
from collections import Counter
from collections.abc import AsyncIterator

import pytest

from hbone.client import HboneConnection
from hbone.errors import HttpStatusError, IdentityMismatch
from hbone.identity import Identity
from hbone.inner import open_inner
from hbone.settings import H2Settings
from hbone.tls import TlsCredentials
from tests.apps import Echo, echo_roundtrip, sha, socks5_connect, start_echo
from tests.harness import Fleet, Proxy, proxy_env
from tests.relays import Onward, Relay, certificate, dial, start_gateway, start_waypoint
from tests.waiting import eventually_async
from ztunnel.proxy.proxyprotocol import ProxyHeader, decode

NET = f"127.{random.randint(16, 250)}.{random.randint(0, 250)}"

CLIENT, SERVER, GUARDED, EAST_CLIENT = (f"{NET}.{i}" for i in (2, 3, 4, 5))
B1, B2, B3, B4 = (f"{NET}.{i}" for i in (11, 12, 13, 14))
WAYPOINT, INLINE_WP = f"{NET}.20", f"{NET}.21"
TUNNELLED, TUNNELLED_POD, SANDWICH_WP = (f"{NET}.{i}" for i in (30, 31, 32))
REMOTE, GATEWAY = f"{NET}.40", f"{NET}.50"
VIP_WEB, VIP_ECHO, VIP_INLINE, VIP_SANDWICH, VIP_REMOTE, VIP_WRONG_SANS, VIP_BY_NAME = (
    f"{NET}.{i}" for i in (100, 101, 102, 103, 104, 105, 106)
)
POD_TUNNEL_PORT = 15088

CLIENT_ID = "spiffe://cluster.local/ns/demo/sa/client"
EAST_CLIENT_ID = "spiffe://cluster.local/ns/demo/sa/east-client"
WAYPOINT_IDENTITY = Identity("cluster.local", "demo", "waypoint")
REMOTE_HOST = "remote.demo.svc.cluster.local"
WRONG_SANS_HOST = "wrong-sans.demo.svc.cluster.local"
EASTWEST_IDENTITY = Identity("cluster.local", "istio-system", "eastwest")
# What the east/west gateway knows of its network: the proxy in front of each service's endpoints.
GATEWAY_TABLE = {REMOTE_HOST: (REMOTE, 15008), WRONG_SANS_HOST: (REMOTE, 15008)}


def config(localhost_tunnel_port: int = 1, sandwich_port: int = 1, by_name_port: int = 1) -> str:
    """One mesh for every test here; each test starts the proxies it needs."""
    return f"""
workloads:
  - {{uid: t//Pod/demo/client, name: client, namespace: demo, serviceAccount: client,
     trustDomain: cluster.local, workloadIps: ["{CLIENT}"], protocol: HBONE, workloadName: client}}
  # three backends of one service, each on its own target port (a named port), one unhealthy
  - {{uid: t//Pod/demo/b1, name: b1, namespace: demo, serviceAccount: web, trustDomain: cluster.local,
     workloadIps: ["{B1}"], protocol: HBONE, services: {{"demo/web.demo.svc.cluster.local": {{9080: 8081}}}}}}
  - {{uid: t//Pod/demo/b2, name: b2, namespace: demo, serviceAccount: web, trustDomain: cluster.local,
     workloadIps: ["{B2}"], protocol: HBONE, services: {{"demo/web.demo.svc.cluster.local": {{9080: 8082}}}}}}
  - {{uid: t//Pod/demo/b3, name: b3, namespace: demo, serviceAccount: web, trustDomain: cluster.local,
     workloadIps: ["{B3}"], protocol: HBONE, services: {{"demo/web.demo.svc.cluster.local": {{9080: 8083}}}}}}
  - {{uid: t//Pod/demo/b4, name: b4, namespace: demo, serviceAccount: web, trustDomain: cluster.local,
     workloadIps: ["{B4}"], protocol: HBONE, status: Unhealthy,
     services: {{"demo/web.demo.svc.cluster.local": {{9080: 8084}}}}}}
  # waypoints
  - {{uid: t//Pod/demo/waypoint, name: waypoint, namespace: demo, serviceAccount: waypoint,
     trustDomain: cluster.local, workloadIps: ["{WAYPOINT}"], protocol: HBONE}}
  - {{uid: t//Pod/demo/server, name: server, namespace: demo, serviceAccount: server,
     trustDomain: cluster.local, workloadIps: ["{SERVER}"], protocol: HBONE,
     authorizationPolicies: ["demo/only-waypoint"],
     services: {{"demo/echo.demo.svc.cluster.local": {{9080: 8080}}}}}}
  - {{uid: t//Pod/demo/guarded, name: guarded, namespace: demo, serviceAccount: guarded,
     trustDomain: cluster.local, workloadIps: ["{GUARDED}"], protocol: HBONE,
     waypoint: {{destination: "/{WAYPOINT}"}}, authorizationPolicies: ["demo/only-waypoint"]}}
  - {{uid: t//Pod/demo/inline-wp, name: inline-wp, namespace: demo, serviceAccount: inline-wp,
     trustDomain: cluster.local, workloadIps: ["{INLINE_WP}"], protocol: HBONE}}
  # application tunnels
  - {{uid: t//Pod/demo/tunnelled, name: tunnelled, namespace: demo, serviceAccount: tunnelled,
     trustDomain: cluster.local, workloadIps: ["{TUNNELLED}"], protocol: HBONE,
     applicationTunnel: {{protocol: PROXY, port: {localhost_tunnel_port}}}}}
  - {{uid: t//Pod/demo/tunnelled-pod, name: tunnelled-pod, namespace: demo, serviceAccount: tunnelled,
     trustDomain: cluster.local, workloadIps: ["{TUNNELLED_POD}"], protocol: HBONE,
     applicationTunnel: {{protocol: PROXY, port: {POD_TUNNEL_PORT}}}}}
  - {{uid: t//Pod/demo/sandwich-wp, name: sandwich-wp, namespace: demo, serviceAccount: sandwich-wp,
     trustDomain: cluster.local, workloadIps: ["{SANDWICH_WP}"], protocol: HBONE,
     applicationTunnel: {{protocol: PROXY, port: {sandwich_port}}}}}
  # two networks
  - {{uid: t//Pod/demo/east-client, name: east-client, namespace: demo, serviceAccount: east-client,
     trustDomain: cluster.local, workloadIps: ["{EAST_CLIENT}"], network: net1, protocol: HBONE}}
  - {{uid: t//Pod/istio-system/eastwest, name: eastwest, namespace: istio-system, serviceAccount: eastwest,
     trustDomain: cluster.local, workloadIps: ["{GATEWAY}"], network: net2, protocol: HBONE}}
  - {{uid: t//Pod/demo/remote, name: remote, namespace: demo, serviceAccount: remote,
     trustDomain: cluster.local, workloadIps: ["{REMOTE}"], network: net2, protocol: HBONE,
     networkGateway: {{destination: "net2/{GATEWAY}"}},
     services: {{"demo/{REMOTE_HOST}": {{9080: 8080}}, "demo/{WRONG_SANS_HOST}": {{9080: 8080}}}}}}
  # known by hostname only
  - {{uid: t//v1/WorkloadEntry/demo/by-name, name: by-name, namespace: demo, serviceAccount: ext,
     hostname: localhost, trustDomain: cluster.local, workloadIps: [], protocol: TCP,
     services: {{"demo/by-name.demo.svc.cluster.local": {{9080: {by_name_port}}}}}}}
services:
  - {{name: web, namespace: demo, hostname: web.demo.svc.cluster.local, vips: ["/{VIP_WEB}"],
     ports: {{9080: 0}}}}
  - {{name: echo, namespace: demo, hostname: echo.demo.svc.cluster.local, vips: ["/{VIP_ECHO}"],
     ports: {{9080: 8080}}, waypoint: {{destination: "/{WAYPOINT}"}}}}
  - {{name: inline, namespace: demo, hostname: inline.demo.svc.cluster.local, vips: ["/{VIP_INLINE}"],
     ports: {{9080: 9080}}, waypoint: {{destination: "/{INLINE_WP}"}}}}
  - {{name: sandwich, namespace: demo, hostname: sandwich.demo.svc.cluster.local, vips: ["/{VIP_SANDWICH}"],
     ports: {{9080: 9080}}, waypoint: {{destination: "/{SANDWICH_WP}"}}}}
  - {{name: remote, namespace: demo, hostname: {REMOTE_HOST}, vips: ["net1/{VIP_REMOTE}"],
     ports: {{9080: 8080}}, subjectAltNames: ["spiffe://cluster.local/ns/demo/sa/remote"]}}
  - {{name: wrong-sans, namespace: demo, hostname: {WRONG_SANS_HOST},
     vips: ["net1/{VIP_WRONG_SANS}"], ports: {{9080: 8080}},
     subjectAltNames: ["spiffe://cluster.local/ns/demo/sa/someone-else"]}}
  - {{name: by-name, namespace: demo, hostname: by-name.demo.svc.cluster.local, vips: ["/{VIP_BY_NAME}"],
     ports: {{9080: {by_name_port}}}}}
policies:
  - name: only-waypoint
    namespace: demo
    scope: WorkloadSelector
    action: Allow
    dryRun: false
    rules:
      - - - principals: [!Exact "cluster.local/ns/demo/sa/waypoint"]
"""


# --- apps ----------------------------------------------------------------------------------------


async def start_named(host: str, port: int, name: str) -> asyncio.Server:
    """An app that says who it is (`name@<its port>`), then echoes."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            writer.write(f"{name}@{writer.get_extra_info('sockname')[1]}\n".encode())
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
            writer.write_eof()
        except ConnectionError:
            pass
        finally:
            writer.close()

    return await asyncio.start_server(handle, host, port)


class ProxyApp:
    """An app behind a PROXY v2 application tunnel: reads the header, reports it, then echoes."""

    def __init__(self) -> None:
        self.headers: list[ProxyHeader] = []
        self.server: asyncio.Server | None = None

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    async def start(self, host: str, port: int = 0) -> ProxyApp:
        self.server = await asyncio.start_server(self._handle, host, port)
        return self

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            buffer = b""
            while (parsed := decode(buffer)) is None:
                chunk = await reader.read(4096)
                if not chunk:
                    return
                buffer += chunk
            header, used = parsed
            self.headers.append(header)
            src, dst = header.source, header.destination
            assert src is not None and dst is not None
            writer.write(f"{src[0]} {dst[0]}:{dst[1]} {header.peer_identity}\n".encode())
            writer.write(buffer[used:])
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
            writer.write_eof()
        except ConnectionError:
            pass
        finally:
            writer.close()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


async def exchange(proxy: str, host: str, port: int, payload: bytes) -> tuple[int, bytes, bytes]:
    """SOCKS5 through `proxy`; returns (reply code, the app's first line, the rest it sent back)."""
    code, reader, writer = await socks5_connect((proxy, 15080), host, port)
    try:
        if code != 0:
            return code, b"", b""
        line = await reader.readline()
        writer.write(payload)
        writer.write_eof()
        rest = await reader.read()
        return code, line.strip(), rest
    finally:
        writer.close()


# --- fixtures ------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def proxies(
    fleet: Fleet, cfg: str, *specs: tuple[str, str, str], **extra: dict[str, str]
) -> AsyncIterator[dict[str, Proxy]]:
    """Start one dedicated proxy per (name, service account, ip), in parallel; `extra[name]` adds
    env. The fleet fixture stops them when the test ends."""
    started = await fleet.start(
        *(proxy_env(ip, f"demo/{name}/{sa}", cfg, **extra.get(name, {})) for name, sa, ip in specs)
    )
    yield {name: proxy for (name, _, _), proxy in zip(specs, started, strict=True)}


def logs(fleet: Fleet) -> str:
    """What every proxy of the test logged."""
    return "".join(proxy.log() for proxy in fleet.proxies)


async def logged(fleet: Fleet, text: str) -> None:
    """Until a proxy has logged `text` (its access log comes a moment after the client's answer)."""
    await eventually_async(lambda: text in logs(fleet), f"{text!r} in a proxy's log")


Servers = list[asyncio.AbstractServer | Echo | ProxyApp | Relay]


@pytest.fixture
async def servers() -> AsyncIterator[Servers]:
    """Apps and relays started by a test, closed after it."""
    started: list[asyncio.AbstractServer | Echo | ProxyApp | Relay] = []
    yield started
    for s in started:
        if isinstance(s, Relay):
            await s.close()
        elif isinstance(s, Echo):
            s.server.close()
        else:
            s.close()


# --- tests ---------------------------------------------------------------------------------------


async def test_service_vip_spreads_over_three_backends_on_their_target_ports(
    fleet: Fleet, servers: Servers
) -> None:
    for name, ip, port in (("b1", B1, 8081), ("b2", B2, 8082), ("b3", B3, 8083)):
        servers.append(await start_named(ip, port, name))
    cfg = config()
    backends = [("b1", "web", B1), ("b2", "web", B2), ("b3", "web", B3)]
    async with proxies(fleet, cfg, ("client", "client", CLIENT), *backends):
        reached: Counter[bytes] = Counter()
        for i in range(60):
            payload = f"hello {i}".encode()
            code, who, back = await exchange(CLIENT, VIP_WEB, 9080, payload)
            assert (code, back) == (0, payload)  # b4 is unhealthy (and has no proxy): never chosen
            reached[who] += 1
    assert set(reached) == {b"b1@8081", b"b2@8082", b"b3@8083"}


async def test_service_waypoint_carries_traffic_and_a_direct_attempt_is_denied(
    fleet: Fleet, servers: Servers
) -> None:
    servers.append(await start_echo(SERVER, 8080))
    table = {
        f"{VIP_ECHO}:9080": Onward(
            (SERVER, 15008), f"{SERVER}:8080", Identity.parse("spiffe://cluster.local/ns/demo/sa/server")
        )
    }
    waypoint = await start_waypoint(WAYPOINT, WAYPOINT_IDENTITY, table)
    servers.append(waypoint)
    async with proxies(fleet, config(), ("client", "client", CLIENT), ("server", "server", SERVER)):
        payload = os.urandom(100_000)
        through = await echo_roundtrip((CLIENT, 15080), VIP_ECHO, 9080, payload)
        assert (through.code, through.digest) == (0, sha(payload))
        # The client's proxy went to the waypoint, naming the service address as dialled.
        assert [(s.authority, s.peer_identity, s.status) for s in waypoint.seen] == [
            (f"{VIP_ECHO}:9080", CLIENT_ID, 200)
        ]
        assert waypoint.seen[0].headers["forwarded"].endswith(";host=echo.demo.svc.cluster.local")

        direct = await echo_roundtrip((CLIENT, 15080), SERVER, 8080, b"around the waypoint")
        assert direct.code == 2  # the server's proxy answered 401: only the waypoint is allowed
    await logged(fleet, "allow policies exist, but none allowed")


async def test_workload_waypoint(fleet: Fleet, servers: Servers) -> None:
    servers.append(await start_echo(GUARDED, 8080))
    guarded_id = Identity.parse("spiffe://cluster.local/ns/demo/sa/guarded")
    table = {f"{GUARDED}:8080": Onward((GUARDED, 15008), f"{GUARDED}:8080", guarded_id)}
    waypoint = await start_waypoint(WAYPOINT, WAYPOINT_IDENTITY, table)
    servers.append(waypoint)
    async with proxies(fleet, config(), ("client", "client", CLIENT), ("guarded", "guarded", GUARDED)):
        ex = await echo_roundtrip((CLIENT, 15080), GUARDED, 8080, b"via my waypoint")
        assert (ex.code, ex.digest) == (0, sha(b"via my waypoint"))
    assert [(s.authority, s.status) for s in waypoint.seen] == [(f"{GUARDED}:8080", 200)]


async def test_a_proxy_accepts_connections_for_what_it_is_the_waypoint_of(
    fleet: Fleet, servers: Servers
) -> None:
    servers.append(await start_named(INLINE_WP, 9080, "inline-waypoint"))
    async with proxies(fleet, config(), ("client", "client", CLIENT), ("inline-wp", "inline-wp", INLINE_WP)):
        code, who, back = await exchange(CLIENT, VIP_INLINE, 9080, b"for the service")
        assert (code, who, back) == (0, b"inline-waypoint@9080", b"for the service")

        # It is not the waypoint of the client's address: that authority is refused.
        cert = certificate(Identity.parse(CLIENT_ID))
        sock = await dial(CLIENT, (INLINE_WP, 15008))
        conn = await HboneConnection.open(
            sock,
            TlsCredentials.build(cert),
            [Identity.parse("spiffe://cluster.local/ns/demo/sa/inline-wp")],
            H2Settings(),
        )
        try:
            with pytest.raises(HttpStatusError) as refused:
                await conn.connect(f"{CLIENT}:9080")
            assert refused.value.status == 400
        finally:
            conn.abort()
    await logged(fleet, f"ip mismatch: {INLINE_WP} != {CLIENT}")


async def test_application_tunnel_tells_the_app_who_connected(fleet: Fleet, servers: Servers) -> None:
    local_app = await ProxyApp().start("127.0.0.1")
    pod_app = await ProxyApp().start(TUNNELLED_POD, POD_TUNNEL_PORT)
    servers.extend([local_app, pod_app])
    cfg = config(localhost_tunnel_port=local_app.port)
    specs = [
        ("client", "client", CLIENT),
        ("tunnelled", "tunnelled", TUNNELLED),
        ("tunnelled-pod", "tunnelled", TUNNELLED_POD),
    ]
    async with proxies(fleet, cfg, *specs, **{"tunnelled-pod": {"LOCALHOST_APP_TUNNEL": "false"}}):
        # Default: delivered to 127.0.0.1:<tunnel port>.
        code, line, back = await exchange(CLIENT, TUNNELLED, 8080, b"after the header")
        assert (code, back) == (0, b"after the header")
        assert line.decode() == f"{CLIENT} {TUNNELLED}:8080 {CLIENT_ID}"
        # LOCALHOST_APP_TUNNEL=false: delivered to <pod ip>:<tunnel port>.
        code, line, back = await exchange(CLIENT, TUNNELLED_POD, 8080, b"to the pod")
        assert (code, back) == (0, b"to the pod")
        assert line.decode() == f"{CLIENT} {TUNNELLED_POD}:8080 {CLIENT_ID}"
    assert len(local_app.headers) == len(pod_app.headers) == 1


async def test_sandwiched_waypoint_gets_the_original_destination(fleet: Fleet, servers: Servers) -> None:
    app = await ProxyApp().start("127.0.0.1")
    servers.append(app)
    cfg = config(sandwich_port=app.port)
    async with proxies(fleet, cfg, ("client", "client", CLIENT), ("sandwich-wp", "sandwich-wp", SANDWICH_WP)):
        code, line, back = await exchange(CLIENT, VIP_SANDWICH, 9080, b"sandwich")
        assert (code, back) == (0, b"sandwich")
        assert line.decode() == f"{CLIENT} {VIP_SANDWICH}:9080 {CLIENT_ID}"


async def test_double_hbone_through_a_network_gateway(fleet: Fleet, servers: Servers) -> None:
    servers.append(await start_echo(REMOTE, 8080))
    gateway = await start_gateway(GATEWAY, EASTWEST_IDENTITY, GATEWAY_TABLE)
    servers.append(gateway)
    specs = [("east-client", "east-client", EAST_CLIENT), ("remote", "remote", REMOTE)]
    extra = {"east-client": {"NETWORK": "net1"}, "remote": {"NETWORK": "net2"}}
    async with proxies(fleet, config(), *specs, **extra) as apps:
        payload = os.urandom(200_000)
        ex = await echo_roundtrip((EAST_CLIENT, 15080), VIP_REMOTE, 9080, payload)
        assert (ex.code, ex.digest) == (0, sha(payload))
        # The gateway saw only the outer CONNECT: the client's identity and the service hostname.
        assert [(s.authority, s.peer_identity, s.status) for s in gateway.seen] == [
            (f"{REMOTE_HOST}:9080", EAST_CLIENT_ID, 200)
        ]
        # The remote proxy terminated the inner tunnel: mTLS with the client itself, through the gateway.
        opened = [
            (labels, value)
            for name, labels, value in apps["remote"].samples()
            if name == "istio_tcp_connections_opened_total" and labels["reporter"] == "destination"
        ]
        assert len(opened) == 1 and opened[0][0]["source_principal"] == EAST_CLIENT_ID, opened

        # A service whose SANs the remote proxy does not have: the inner handshake fails.
        wrong = await echo_roundtrip((EAST_CLIENT, 15080), VIP_WRONG_SANS, 9080, b"x")
        assert wrong.code == 1
    await logged(fleet, "identity verification error")


async def test_inner_tls_checks_the_final_identity(fleet: Fleet, servers: Servers) -> None:
    """`open_inner` on its own: through the gateway relay to a proxy, expecting another identity."""
    gateway = await start_gateway(GATEWAY, EASTWEST_IDENTITY, GATEWAY_TABLE)
    servers.append(gateway)
    async with proxies(fleet, config(), ("remote", "remote", REMOTE), remote={"NETWORK": "net2"}):
        cert = certificate(Identity.parse(EAST_CLIENT_ID))
        sock = await dial(EAST_CLIENT, (GATEWAY, 15008))
        outer_conn = await HboneConnection.open(
            sock, TlsCredentials.build(cert), [gateway.identity], H2Settings()
        )
        try:
            outer = await outer_conn.connect(f"{REMOTE_HOST}:9080")
            with pytest.raises(IdentityMismatch):
                await open_inner(
                    outer,
                    TlsCredentials.build(cert),
                    [Identity.parse("spiffe://cluster.local/ns/demo/sa/nobody")],
                    H2Settings(),
                )
        finally:
            outer_conn.abort()


async def test_workload_known_by_hostname_is_resolved_by_dns(fleet: Fleet, servers: Servers) -> None:
    app = await start_named("127.0.0.1", 0, "by-name")
    servers.append(app)
    port = int(app.sockets[0].getsockname()[1])
    async with proxies(fleet, config(by_name_port=port), ("client", "client", CLIENT)):
        code, who, back = await exchange(CLIENT, VIP_BY_NAME, 9080, b"by name")
    assert (code, who, back) == (0, f"by-name@{port}".encode(), b"by name")
