"""SOCKS5 CONNECT to a mesh host name, through a real `ztunnel proxy` on loopback: the name is looked
up in the client's family first, then in the other one, so a service that has only IPv6 addresses is
reached through the IPv4 listener (and, on a listener on `::1`, AAAA is asked first, then A); a name
with no address of either family gets "host unreachable" (reply 4) and a log line naming it. A
headless service's per-pod name reaches only its own namespace's pod, and only for a client that sees
the service. Clients: `curl --socks5-hostname` and a raw SOCKS5 client."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from tests.apps import Echo, echo_roundtrip, loopback_net, sha, socks5_connect, start_echo, workload_yaml
from tests.harness import Fleet, Proxy, proxy_env
from tests.waiting import eventually_async

NET = loopback_net()
FRONTEND, SERVER, FRONTEND6, VIP4 = f"{NET}.2", f"{NET}.3", f"{NET}.4", f"{NET}.100"
VIP6 = "fd00:5:5::1"
APP6 = "::1"  # the IPv6-only app: on the loopback, the one IPv6 address every host has
V6_HOST, V4_HOST, EMPTY_HOST = (f"{n}.demo.svc.cluster.local" for n in ("only-v6", "only-v4", "no-endpoints"))


def config(app6_port: int) -> str:
    return f"""
workloads:{workload_yaml("frontend", FRONTEND)}{
        workload_yaml(
            "server",
            SERVER,
            protocol="TCP",
            extra='''
    services:
      "demo/only-v4.demo.svc.cluster.local":
        80: 8080''',
        )
    }{
        workload_yaml(
            "server6",
            APP6,
            protocol="TCP",
            extra=f'''
    services:
      "demo/only-v6.demo.svc.cluster.local":
        80: {app6_port}''',
        )
    }
services:
  - name: only-v6
    namespace: demo
    hostname: {V6_HOST}
    vips: ["/{VIP6}"]
    ipFamilies: IPv6
    ports:
      80: {app6_port}
  - name: only-v4
    namespace: demo
    hostname: {V4_HOST}
    vips: ["/{VIP4}"]
    ports:
      80: 8080
  - name: no-endpoints
    namespace: demo
    hostname: {EMPTY_HOST}
    vips: []
    ports:
      80: 8080
"""


@dataclass
class Setup:
    frontend: Proxy
    echo4: Echo
    echo6: Echo
    port6: int  # the IPv6-only app's


@pytest.fixture
async def setup(fleet: Fleet) -> AsyncIterator[Setup]:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this host")
    echo6 = await start_echo(APP6, 0)
    port6 = echo6.server.sockets[0].getsockname()[1]
    echo4 = await start_echo(SERVER, 8080)
    try:
        (frontend,) = await fleet.start(proxy_env(FRONTEND, "demo/frontend/frontend", config(port6)))
        yield Setup(frontend, echo4, echo6, port6)
    finally:
        echo4.server.close()
        echo6.server.close()


async def test_an_ipv6_only_service_is_reached_through_the_ipv4_listener(setup: Setup) -> None:
    payload = os.urandom(20_000)
    ex = await echo_roundtrip((FRONTEND, 15080), V6_HOST, 80, payload)
    assert (ex.code, ex.digest) == (0, sha(payload))
    # The IPv4 service still answers with its A record (asked first).
    ex = await echo_roundtrip((FRONTEND, 15080), "only-v4.demo", 80, b"four")
    assert (ex.code, ex.digest) == (0, sha(b"four"))
    frontend = setup.frontend
    await eventually_async(
        lambda: frontend.metric("istio_tcp_connections_closed_total", destination_service=V6_HOST) >= 1,
        "the IPv6 connection counted against its service",
        10.0,
        blocking=True,
    )


async def test_curl_socks5_hostname_reaches_the_ipv6_only_service(setup: Setup) -> None:
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    # curl speaks its request to the echo app, which sends it back: curl shows what it sent.
    done = await asyncio.to_thread(
        subprocess.run,
        [
            "curl",
            "-sS",
            "--max-time",
            "10",
            "--socks5-hostname",
            f"{FRONTEND}:15080",
            f"telnet://{V6_HOST}:80",
        ],
        input=b"hello over v6\n",
        capture_output=True,
        timeout=30,
    )
    assert done.stdout == b"hello over v6\n", done.stderr


async def test_a_name_with_no_address_is_host_unreachable_and_logged(setup: Setup) -> None:
    frontend = setup.frontend
    frontend.mark()
    ex = await echo_roundtrip((FRONTEND, 15080), EMPTY_HOST, 80, b"anyone?")
    assert ex.code == 4  # RFC 1928: host unreachable
    await eventually_async(
        lambda: f"dst.addr={EMPTY_HOST}:80" in frontend.log_since_mark(),
        "a log line naming the host",
        10.0,
        blocking=True,
    )
    line = next(line for line in frontend.log_since_mark().splitlines() if EMPTY_HOST in line)
    assert "connection failed" in line and "no IPv4 or IPv6 address" in line, line


async def test_a_client_on_ipv6_reaches_services_of_either_family(setup: Setup, fleet: Fleet) -> None:
    """A SOCKS5 listener on `::1`: AAAA is asked first, and A when there is none."""
    with socket.socket(socket.AF_INET6) as s:
        s.bind((APP6, 0))
        port = s.getsockname()[1]
    env = proxy_env(
        FRONTEND6, "demo/frontend/frontend", config(setup.port6), SOCKS5_ADDRESS=f"[{APP6}]:{port}"
    )
    await fleet.start(env)
    for host, payload in ((V6_HOST, b"six"), (V4_HOST, b"four")):
        ex = await echo_roundtrip((APP6, port), host, 80, payload)
        assert (ex.code, ex.digest) == (0, sha(payload)), host
    ex = await echo_roundtrip((APP6, port), EMPTY_HOST, 80, b"anyone?")
    assert ex.code == 4


# Per-pod names: shop's headless service `web` and its pod web-0; a VIP-less service of namespace evil
# with the same hostname, known first, with a pod web-0 of its own; a headless service of namespace
# other exported to its own namespace only, with a pod priv-0. Each pod's app says who it is.
SHOP_WEB0, EVIL_WEB0, OTHER_PRIV0 = f"{NET}.5", f"{NET}.6", f"{NET}.7"


def pod_names_config() -> str:
    def pod(name: str, ip: str, ns: str, service: str) -> str:
        extra = f"""
    services:
      "{service}":
        80: 8080"""
        return workload_yaml(name, ip, ns=ns, protocol="TCP", extra=extra)

    pods = (
        pod("web-0", EVIL_WEB0, "evil", "evil/web.shop.svc.cluster.local")
        + pod("web-0", SHOP_WEB0, "shop", "shop/web.shop.svc.cluster.local")
        + pod("priv-0", OTHER_PRIV0, "other", "other/private.other.svc.cluster.local")
    )
    return f"""
workloads:{workload_yaml("frontend", FRONTEND)}{pods}
services:
  - {{name: web, namespace: evil, hostname: web.shop.svc.cluster.local, vips: [], ports: {{80: 8080}}}}
  - {{name: web, namespace: shop, hostname: web.shop.svc.cluster.local, vips: [], ports: {{80: 8080}}}}
  - {{name: private, namespace: other, hostname: private.other.svc.cluster.local, vips: [],
     ports: {{80: 8080}}, visibility: Namespace}}
"""


async def test_a_pod_name_reaches_only_its_own_namespaces_visible_pod(fleet: Fleet) -> None:
    async def start_named(ip: str) -> asyncio.Server:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(ip.encode())
            await writer.drain()
            writer.close()

        return await asyncio.start_server(handle, ip, 8080)

    apps = [await start_named(ip) for ip in (SHOP_WEB0, EVIL_WEB0, OTHER_PRIV0)]
    try:
        await fleet.start(proxy_env(FRONTEND, "demo/frontend/frontend", pod_names_config()))

        async def reached(host: str) -> tuple[int, bytes]:
            code, reader, writer = await socks5_connect((FRONTEND, 15080), host, 8080)
            try:
                return code, (await asyncio.wait_for(reader.read(), 10) if code == 0 else b"")
            finally:
                writer.close()

        # The hijack: evil's lookalike service lends its pod no name of shop's.
        assert await reached("web-0.web.shop.svc.cluster.local") == (0, SHOP_WEB0.encode())
        # The leak: the name of a pod of a service exported to namespace other only is no mesh name to
        # a client of demo (the system resolver does not know it either).
        assert await reached("priv-0.private.other.svc.cluster.local") == (4, b"")
    finally:
        for app in apps:
            app.close()
