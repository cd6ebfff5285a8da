"""The DNS proxy on `localhost:15053`: 127.0.0.1 and, when IPv6 is enabled (and the network
namespace's loopback has `::1`), `[::1]` as well, as the reference binds it. Asked with Debian's
`dig`; then (root) a live `ztunnel proxy` with worker processes in namespaces of its own, one of
them with IPv6 switched off on its loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from collections.abc import AsyncIterator

import pytest

from tests.harness import Fleet, Proxy
from tests.netns import Netns, require_root, require_tools
from tests.test_dns_server import Running, start
from tests.waiting import eventually
from ztunnel.config.settings import Config
from ztunnel.dns import dns_on_ipv6_loopback

pytestmark = pytest.mark.timeout(120)

SERVICE = "web.ns1.svc.cluster.local"  # a service of the resolver tests' mesh
SERVICE_VIP = "10.96.0.10"


def dig_command(server: str, port: int, *args: str) -> list[str]:
    (path,) = require_tools("dig", hint="Debian package bind9-dnsutils")
    return [path, f"@{server}", "-p", str(port), "+tries=1", "+time=2", "+short", *args]


async def adig(server: str, port: int, *args: str) -> str:
    """`dig`, while this test's event loop serves the DNS server it asks."""
    proc = await asyncio.create_subprocess_exec(
        *dig_command(server, port, *args), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await proc.communicate()
    return out.decode().strip()


def dig(server: str, port: int, *args: str, netns: str) -> str:
    command = ["ip", "netns", "exec", netns, *dig_command(server, port, *args)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=20, check=False)
    return (done.stdout + done.stderr).strip()


@pytest.fixture
async def both() -> AsyncIterator[Running]:
    running = await start(None, loopback_v6=True)
    yield running
    await running.server.close()


async def test_localhost_is_both_loopbacks(both: Running) -> None:
    port = both.port
    assert both.server.addresses == [("127.0.0.1", port), ("::1", port)]
    for server in ("127.0.0.1", "::1"):
        for transport in ("+notcp", "+tcp"):
            assert await adig(server, port, transport, SERVICE, "A") == SERVICE_VIP, (server, transport)


async def test_without_it_only_127_0_0_1() -> None:
    running = await start(None)
    try:
        assert running.server.addresses == [("127.0.0.1", running.port)]
        assert "no servers could be reached" in await adig("::1", running.port, "+notcp", SERVICE, "A")
    finally:
        await running.server.close()


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, True),
        ({"IPV6_ENABLED": "false"}, False),
        ({"ISTIO_META_DNS_PROXY_ADDR": "localhost:15054"}, True),
        ({"ISTIO_META_DNS_PROXY_ADDR": "127.0.0.1:15053"}, False),  # an address, not localhost
        (
            {"PROXY_MODE": "dedicated", "PROXY_WORKLOAD_INFO": "ns/a/sa", "PROXY_BIND_ADDRESS": "127.0.0.5"},
            False,
        ),
        ({"PROXY_MODE": "dedicated", "PROXY_WORKLOAD_INFO": "ns/a/sa"}, True),
    ],
)
def test_which_configurations_listen_on_ipv6_loopback(env: dict[str, str], expected: bool) -> None:
    assert dns_on_ipv6_loopback(Config.from_env(env, mesh_config_path=None)) is expected


# -- a live proxy in namespaces of its own (root) --------------------------------------------------

MESH = f"""
workloads:
  - uid: k//v1/Pod/demo/client
    name: client
    namespace: demo
    serviceAccount: client
    workloadIps: ["127.0.0.1"]
    protocol: HBONE
services:
  - name: web
    namespace: demo
    hostname: web.demo.svc.cluster.local
    vips: ["/{SERVICE_VIP}"]
    ports: {{80: 8080}}
"""


def run_proxy(fleet: Fleet, ns: Netns, **extra: str) -> Proxy:
    env = dict(
        PROXY_MODE="dedicated",
        PROXY_WORKLOAD_INFO="demo/client/client",
        ZTUNNEL_WORKER_THREADS="2",
        FAKE_CA="true",
        XDS_ADDRESS="",
        LOCAL_XDS=MESH,
        **extra,
    )
    return fleet.proxy(env, netns=ns.name).start(timeout=45)


def answered(ns: Netns, server: str) -> str:
    """The name's answer from the proxy at `server`, once it is the service's VIP (or the last one)."""
    out: list[str] = [""]

    def check() -> bool:
        out[0] = dig(server, 15053, "web.demo.svc.cluster.local", "A", netns=ns.name)
        return out[0] == SERVICE_VIP

    with contextlib.suppress(AssertionError):
        eventually(check, "the service's address", timeout=45, interval=0.3)
    return out[0]


@pytest.mark.root
@pytest.mark.parametrize(
    ("lo_ipv6", "ipv6_enabled", "on_v6"),
    [(True, "true", True), (False, "true", False), (True, "false", False)],
)
def test_a_proxy_answers_on_the_loopbacks_its_namespace_has(
    lo_ipv6: bool, ipv6_enabled: str, on_v6: bool, fleet: Fleet
) -> None:
    require_root("ip", "sysctl")
    ns = Netns("dns6")
    try:
        if not lo_ipv6:
            ns.exec("sysctl", "-qw", "net.ipv6.conf.lo.disable_ipv6=1")
        proxy = run_proxy(fleet, ns, IPV6_ENABLED=ipv6_enabled)
        try:
            assert answered(ns, "127.0.0.1") == SERVICE_VIP
            on = dig("::1", 15053, "web.demo.svc.cluster.local", "A", netns=ns.name)
            assert (on == SERVICE_VIP) is on_v6, on
        finally:
            proxy.stop()
        assert proxy.returncode == 0, proxy.tail()
    finally:
        ns.delete()
