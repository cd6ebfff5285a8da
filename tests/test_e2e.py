"""End to end on loopback: dedicated `ztunnel proxy` processes (2 workers each), each on its own
127.x.y.z address, with the fake CA and one local config; traffic enters through SOCKS5 like a
user's would, and what is checked is what a user sees (the traffic, `/metrics`, the logs)."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime

import pytest

from tests.apps import (
    ONLY_FRONTEND,
    Echo,
    echo_roundtrip,
    http,
    loopback_net,
    sha,
    socks5_connect,
    start_echo,
    workload_yaml,
)
from tests.harness import Fleet, Proxy, Samples, proxy_env
from tests.netns import require_tools
from tests.waiting import eventually_async

NET = loopback_net()
SERVER, FRONTEND, INTRUDER, STRANGER, VIP = (f"{NET}.{i}" for i in (3, 2, 4, 9, 100))

# The server: a workload of service echo (80 → 8080), with canonical labels for telemetry.
SERVER_LABELS = """
    canonicalName: echo
    canonicalRevision: v1
    workloadName: server
    services:
      "demo/echo.demo.svc.cluster.local":
        80: 8080"""
FRONTEND_LABELS = "\n    workloadName: frontend"

CONFIG = f"""
workloads:{workload_yaml("server", SERVER, extra=SERVER_LABELS)}{
    workload_yaml("frontend", FRONTEND, extra=FRONTEND_LABELS)
}{workload_yaml("intruder", INTRUDER)}
services:
  - name: echo
    namespace: demo
    hostname: echo.demo.svc.cluster.local
    vips: ["/{VIP}"]
    ports:
      80: 8080{ONLY_FRONTEND}"""


@dataclass
class Mesh:
    server: Proxy
    frontend: Proxy
    intruder: Proxy
    echo: Echo
    before: dict[str, Samples]  # each proxy's metrics as this test began

    def count(self, proxy: Proxy, name: str, **labels: str) -> float:
        """What `name` (its samples with `labels`) grew by during this test."""
        return proxy.metric(name, since=self.before[proxy.name], **labels)


@pytest.fixture(scope="module")
def proxies(module_fleet: Fleet) -> list[Proxy]:
    """The three proxies, started once for the module (a start costs seconds): each test counts
    from the metrics and the log as it found them."""
    names = (("server", SERVER), ("frontend", FRONTEND), ("intruder", INTRUDER))
    return module_fleet.start_all(*(proxy_env(ip, f"demo/{name}/{name}", CONFIG) for name, ip in names))


@pytest.fixture
async def mesh(proxies: list[Proxy]) -> AsyncIterator[Mesh]:
    echo = await start_echo(SERVER, 8080)
    try:
        before = {}
        for proxy in proxies:
            before[proxy.name] = await asyncio.to_thread(proxy.samples)
            proxy.mark()
        server, frontend, intruder = proxies
        yield Mesh(server, frontend, intruder, echo, before)
    finally:
        echo.server.close()


async def test_allowed_and_denied_by_identity(mesh: Mesh) -> None:
    server = mesh.server
    payload = os.urandom(50_000)
    allowed = await echo_roundtrip((FRONTEND, 15080), SERVER, 8080, payload)
    assert allowed.code == 0
    assert allowed.digest == sha(payload)

    denied = await echo_roundtrip((INTRUDER, 15080), SERVER, 8080, b"let me in")
    assert denied.code == 2  # SOCKS5 "connection not allowed by ruleset": the server said 401

    frontend_id = "spiffe://cluster.local/ns/demo/sa/frontend"
    intruder_id = "spiffe://cluster.local/ns/demo/sa/intruder"
    await eventually_async(
        lambda: mesh.count(server, "istio_tcp_connections_closed_total", reporter="destination") >= 2,
        "both connections closed",
        10.0,
        blocking=True,
    )
    assert (
        mesh.count(
            server, "istio_tcp_connections_opened_total", reporter="destination", source_principal=frontend_id
        )
        == 1
    )
    assert mesh.count(
        server, "istio_tcp_received_bytes_total", reporter="destination", source_principal=frontend_id
    ) == len(payload)
    assert mesh.count(
        server, "istio_tcp_sent_bytes_total", reporter="destination", source_principal=frontend_id
    ) == len(payload)
    assert (
        mesh.count(
            server,
            "istio_tcp_connections_closed_total",
            reporter="destination",
            source_principal=intruder_id,
            response_flags="DENY",
        )
        == 1
    )
    frontend = mesh.frontend
    assert (
        mesh.count(
            frontend,
            "istio_tcp_connections_opened_total",
            reporter="source",
            destination_principal="spiffe://cluster.local/ns/demo/sa/server",
            connection_security_policy="mutual_tls",
            destination_workload="server",
        )
        == 1
    )


async def test_service_vip_is_translated_to_an_endpoint(mesh: Mesh) -> None:
    payload = b"to the service" * 100
    ex = await echo_roundtrip((FRONTEND, 15080), VIP, 80, payload)
    assert (ex.code, ex.digest) == (0, sha(payload))
    frontend = mesh.frontend
    await eventually_async(
        lambda: mesh.count(frontend, "istio_tcp_connections_closed_total") >= 1,
        "the connection closed",
        10.0,
        blocking=True,
    )
    assert (
        mesh.count(
            frontend, "istio_tcp_connections_opened_total", destination_service="echo.demo.svc.cluster.local"
        )
        == 1
    )


async def test_unknown_destination_is_passed_through_in_plain_tcp(mesh: Mesh) -> None:
    stranger = await start_echo(STRANGER, 9000)
    try:
        payload = b"plain" * 1000
        ex = await echo_roundtrip((INTRUDER, 15080), STRANGER, 9000, payload)
        assert (ex.code, ex.digest) == (0, sha(payload))
        intruder = mesh.intruder
        await eventually_async(
            lambda: mesh.count(intruder, "istio_tcp_connections_closed_total") >= 1,
            "the connection closed",
            10.0,
            blocking=True,
        )
        assert (
            mesh.count(intruder, "istio_tcp_connections_opened_total", connection_security_policy="unknown")
            == 1
        )
    finally:
        stranger.server.close()


async def test_nothing_listening_gives_refused(mesh: Mesh) -> None:
    code, _, writer = await socks5_connect((FRONTEND, 15080), SERVER, 8081)
    writer.close()
    assert code == 5  # the server proxy answered 503: nothing listens on 8081


async def test_half_close_from_the_server_side(mesh: Mesh) -> None:
    """The app closes its side first; the client can still send, and the app still receives."""
    got = asyncio.get_running_loop().create_future()

    async def banner_then_read(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"banner")
        writer.write_eof()
        data = await reader.read()
        got.set_result(data)
        writer.close()

    app = await asyncio.start_server(banner_then_read, SERVER, 8090)
    try:
        code, reader, writer = await socks5_connect((FRONTEND, 15080), SERVER, 8090)
        assert code == 0
        assert await reader.read() == b"banner"  # EOF arrives after the banner
        writer.write(b"still talking after your EOF")
        writer.write_eof()
        assert await asyncio.wait_for(got, 5) == b"still talking after your EOF"
        writer.close()
    finally:
        app.close()


async def test_half_close_from_the_client_side(mesh: Mesh) -> None:
    """The client half-closes first; the echo app keeps sending what it got, then closes."""
    code, reader, writer = await socks5_connect((FRONTEND, 15080), SERVER, 8080)
    assert code == 0
    writer.write(b"one way")
    writer.write_eof()
    assert await asyncio.wait_for(reader.read(), 5) == b"one way"
    writer.close()


@pytest.mark.parametrize("size", [1 << 20, 100 << 20], ids=["1MiB", "100MiB"])
async def test_large_transfers_arrive_intact(mesh: Mesh, size: int) -> None:
    payload = os.urandom(size)
    ex = await asyncio.wait_for(echo_roundtrip((FRONTEND, 15080), SERVER, 8080, payload), 120)
    assert ex.received == size
    assert ex.digest == sha(payload)


async def test_200_concurrent_connections_over_the_pool(mesh: Mesh) -> None:
    server = mesh.server
    payloads = [os.urandom(1000 + i) for i in range(200)]
    results = await asyncio.wait_for(
        asyncio.gather(*(echo_roundtrip((FRONTEND, 15080), SERVER, 8080, p) for p in payloads)), 60
    )
    assert [r.digest for r in results] == [sha(p) for p in payloads]
    await eventually_async(
        lambda: mesh.count(server, "istio_tcp_connections_closed_total", reporter="destination") >= 200,
        "every connection closed",
        10.0,
        blocking=True,
    )
    assert mesh.count(server, "istio_tcp_connections_opened_total", reporter="destination") == 200

    # The server's access log names the client proxy's address of each HBONE connection.
    def complete() -> list[str]:
        return [
            line
            for line in server.log_since_mark().splitlines()
            if '"connection complete"' in line and 'direction="inbound"' in line
        ]

    await eventually_async(
        lambda: len(complete()) >= 200, lambda: f"200 access logs, {len(complete())} so far"
    )
    inbound = complete()
    ports = collections.Counter(
        re.search(rf"src.addr={re.escape(FRONTEND)}:(\d+)", line).group(1)  # type: ignore[union-attr]
        for line in inbound
    )
    assert len(inbound) == 200
    # The frontend's two workers each have their own pool, and the streams spread over the workers:
    # pooled, not one connection per stream (at 100 streams a connection, at most two per worker's
    # share). Seen: a worker opening its second connection at once beside the first (94 + 4 streams),
    # where one process's pool made exactly two for all 200.
    assert 2 <= len(ports) <= 4, ports


async def test_curl_through_socks5(mesh: Mesh) -> None:
    """curl, a client we did not write, reaches an HTTP app through the proxy's SOCKS5 listener."""
    [curl] = require_tools("curl")

    async def http_app(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\nConnection: close\r\n\r\nhello, mesh\n")
        await writer.drain()
        writer.close()

    app = await asyncio.start_server(http_app, SERVER, 8088)
    try:
        proc = await asyncio.create_subprocess_exec(
            curl,
            "-sS",
            "--max-time",
            "10",
            "--socks5",
            f"{FRONTEND}:15080",
            f"http://{SERVER}:8088/",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await proc.communicate()
        assert proc.returncode == 0, err.decode()
        assert out == b"hello, mesh\n"
        denied = await asyncio.create_subprocess_exec(
            curl,
            "-sS",
            "--max-time",
            "10",
            "--socks5",
            f"{INTRUDER}:15080",
            f"http://{SERVER}:8088/",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        _, err = await denied.communicate()
        # curl's exit 97 (CURLE_PROXY) and the SOCKS5 reply code it got: 2, not allowed by ruleset.
        assert denied.returncode == 97, err.decode()
        assert b"SOCKS5" in err  # curl reports the SOCKS5 failure reply
        assert err.rstrip().endswith(b"(2)"), err.decode()
    finally:
        app.close()


async def test_operator_endpoints(mesh: Mesh) -> None:
    """What an operator sees on the admin, metrics and readiness ports of a running proxy."""
    status, body = await asyncio.to_thread(http, "GET", f"http://{FRONTEND}:15021/healthz/ready")
    assert (status, body) == (200, b"ready\n")
    status, body = await asyncio.to_thread(http, "GET", f"http://{FRONTEND}:15000/config_dump")
    assert status == 200
    dump = json.loads(body)
    assert {"workloads", "services", "policies", "certificates", "config", "staticConfig"} <= dump.keys()
    assert sorted(w["name"] for w in dump["workloads"]) == ["frontend", "intruder", "server"]
    assert [p["name"] for p in dump["policies"]] == ["only-frontend"]
    assert dump["config"]["proxyMode"] == "dedicated"
    certs = {c["identity"]: c for c in dump["certificates"]}
    assert certs["spiffe://cluster.local/ns/demo/sa/frontend"]["state"] == "Available"
    assert dump["staticConfig"]["policies"][0]["name"] == "only-frontend"
    status, body = await asyncio.to_thread(http, "GET", f"http://{FRONTEND}:15020/stats/prometheus")
    assert status == 200 and b'istio_build{component="ztunnel"' in body
    status, _ = await asyncio.to_thread(http, "GET", f"http://{FRONTEND}:15000/quitquitquit")
    assert status == 405


async def test_cert_expiry_of_each_identity_held(mesh: Mesh) -> None:
    """`istio_cert_expiry_seconds{identity}`: the NotAfter (Unix seconds) of each certificate the
    proxy holds, as `/config_dump` shows it; the frontend holds its own once it has connected."""
    ex = await echo_roundtrip((FRONTEND, 15080), SERVER, 8080, b"warm")
    assert ex.code == 0
    for proxy in (mesh.frontend, mesh.server):
        dump = await asyncio.to_thread(proxy.config_dump)
        held = {c["identity"]: c for c in dump["certificates"] if c["state"] == "Available"}
        assert f"spiffe://cluster.local/ns/demo/sa/{proxy.name}" in held, dump["certificates"]
        samples = await asyncio.to_thread(proxy.samples)
        shown = {labels["identity"]: v for n, labels, v in samples if n == "istio_cert_expiry_seconds"}
        expected = {
            identity: datetime.strptime(
                c["certChain"][0]["expirationTime"], "%Y-%m-%dT%H:%M:%S%z"
            ).timestamp()
            for identity, c in held.items()
        }
        assert shown == expected


async def test_the_bytes_of_an_open_connection_are_in_the_metrics_as_it_carries_them(mesh: Mesh) -> None:
    """Both proxies' byte counters include an open connection's bytes at each scrape (the relay's
    own counts, read then), and end exact once it closes."""
    code, reader, writer = await socks5_connect((FRONTEND, 15080), SERVER, 8080)
    assert code == 0
    principal = "spiffe://cluster.local/ns/demo/sa/frontend"
    counted = {"frontend": "source", "server": "destination"}
    total = 0
    try:
        for size in (1000, 70_000):
            payload = os.urandom(size)
            writer.write(payload)
            assert await asyncio.wait_for(reader.readexactly(size), 10) == payload
            total += size
            for proxy in (mesh.frontend, mesh.server):
                for name in ("istio_tcp_received_bytes_total", "istio_tcp_sent_bytes_total"):
                    await eventually_async(
                        lambda p=proxy, n=name, t=total: (
                            mesh.count(p, n, reporter=counted[p.name], source_principal=principal) == t
                        ),
                        f"{proxy.name}'s {name} at {total} while the connection is open",
                        10.0,
                        blocking=True,
                    )
    finally:
        writer.close()
    await eventually_async(
        lambda: mesh.count(mesh.server, "istio_tcp_connections_closed_total", reporter="destination") >= 1,
        "the connection closed",
        10.0,
        blocking=True,
    )
    for proxy in (mesh.frontend, mesh.server):
        for name in ("istio_tcp_received_bytes_total", "istio_tcp_sent_bytes_total"):
            assert mesh.count(proxy, name, reporter=counted[proxy.name], source_principal=principal) == total
