"""The DNS proxy inside a whole dedicated proxy.

Against a `ztunnel proxy` process: SOCKS5 clients reach a mesh-only name (its VIP, from the DNS resolver), the proxy's
DNS port answers while being fed garbage and a proxied TCP connection beside it keeps echoing, and
the metrics and readiness endpoints show the DNS proxy.

As root: `ztunnel proxy` runs with its own `/etc/resolv.conf` (pointing at a dnsmasq the test runs)
bind-mounted in a private mount namespace, and the system resolver (`getent`, glibc) of a client
whose `/etc/resolv.conf` names the proxy, in another private mount namespace, resolves mesh names
(short names through the search list, the stripping CNAME) and forwarded names.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import dns.message
import dns.rcode
import pytest

from tests.apps import socks5_connect, start_echo
from tests.harness import Fleet, Proxy, proxy_env
from tests.netns import require_root, require_tools

NET = f"127.{random.randint(16, 250)}.{random.randint(0, 250)}"
CLIENT_IP, ECHO_IP = f"{NET}.2", f"{NET}.3"

MESH = """
workloads:
  - {{uid: t//Pod/ns1/client, name: client, namespace: ns1, serviceAccount: client,
     trustDomain: cluster.local, workloadIps: ["{client}"], canonicalName: client-app, canonicalRevision: v1}}
  - {{uid: t//Pod/ns1/echo, name: echo, namespace: ns1, serviceAccount: echo, trustDomain: cluster.local,
     workloadIps: ["{echo}"], protocol: TCP,
     services: {{"ns1/echo.ns1.svc.cluster.local": {{80: {port}}}, "ns1/mesh-only.example": {{80: {port}}}}}}}
services:
  - {{name: echo, namespace: ns1, hostname: echo.ns1.svc.cluster.local, vips: ["/10.200.0.1"],
     ports: {{80: {port}}}}}
  - {{name: mesh-only, namespace: ns1, hostname: mesh-only.example, vips: ["/240.0.0.1"], ports: {{80: {port}}}}}
  - {{name: web, namespace: ns2, hostname: web.ns2.svc.cluster.local, vips: ["/10.96.0.20"], ports: {{80: 80}}}}
  - {{name: by-name, namespace: ns1, hostname: by-name.example, vips: ["/240.0.0.9"], ports: {{80: {local_port}}}}}
"""
# A workload known by hostname only (no IPs): reached through on-demand DNS.
BY_NAME = """
  - {{uid: t//Pod/ns1/by-name, name: by-name, namespace: ns1, serviceAccount: x, trustDomain: cluster.local,
     hostname: localhost, workloadIps: [], protocol: TCP, services: {{"ns1/by-name.example": {{80: {local_port}}}}}}}
"""


@pytest.fixture
async def mesh(fleet: Fleet) -> AsyncIterator[tuple[Proxy, int]]:
    echo = await start_echo(ECHO_IP, 0)
    port = echo.server.sockets[0].getsockname()[1]
    local_echo = await start_echo("127.0.0.1", 0)
    local_port = local_echo.server.sockets[0].getsockname()[1]
    text = MESH.format(client=CLIENT_IP, echo=ECHO_IP, port=port, local_port=local_port)
    text = text.replace("services:\n", BY_NAME.format(local_port=local_port).lstrip("\n") + "services:\n", 1)
    try:
        [proxy] = await fleet.start(proxy_env(CLIENT_IP, "ns1/client/client", text))
        yield proxy, port
    finally:
        echo.server.close()
        local_echo.server.close()


async def _http_get(host: str, port: int, path: str) -> tuple[int, str]:
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    data = await reader.read()
    writer.close()
    head, _, body = data.decode().partition("\r\n\r\n")
    return int(head.split()[1]), body


async def _dns_udp(addr: tuple[str, int], name: str, rdtype: str = "A") -> dns.message.Message:
    loop = asyncio.get_running_loop()
    query = dns.message.make_query(name, rdtype)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.setblocking(False)
        s.connect(addr)
        await loop.sock_sendall(s, query.to_wire())
        async with asyncio.timeout(3):
            return dns.message.from_wire(await loop.sock_recv(s, 65535))


async def test_socks5_reaches_a_mesh_name_by_its_vip(mesh: tuple[Proxy, int]) -> None:
    proxy, _ = mesh
    for name in ("mesh-only.example", "echo.ns1.svc.cluster.local"):
        code, reader, writer = await socks5_connect((CLIENT_IP, 15080), name, 80)
        assert code == 0, name
        writer.write(b"ping " + name.encode())
        assert await reader.readexactly(5 + len(name)) == b"ping " + name.encode()
        writer.close()
    # Reached through the service (its VIP): the connection metrics name it.
    status, body = await _http_get(CLIENT_IP, 15020, "/metrics")
    assert status == 200
    assert 'destination_service="mesh-only.example"' in body
    assert proxy.listeners()["dns"] == (CLIENT_IP, 15053)


async def test_on_demand_dns_is_counted(mesh: tuple[Proxy, int]) -> None:
    code, reader, writer = await socks5_connect((CLIENT_IP, 15080), "240.0.0.9", 80)
    assert code == 0
    writer.write(b"by name")
    assert await reader.readexactly(7) == b"by name"
    writer.close()
    _, body = await _http_get(CLIENT_IP, 15020, "/metrics")
    assert (
        'istio_on_demand_dns_total{source_workload="client",source_canonical_service="client-app",'
        'source_canonical_revision="v1",source_workload_namespace="ns1",'
        'source_principal="spiffe://cluster.local/ns/ns1/sa/client",source_app="client-app",'
        'source_version="v1",source_cluster="unknown",hostname="localhost"} 1'
    ) in body, body


async def test_dns_beside_proxied_traffic_under_garbage(mesh: tuple[Proxy, int]) -> None:
    dns_addr = (CLIENT_IP, 15053)
    code, reader, writer = await socks5_connect((CLIENT_IP, 15080), ECHO_IP, mesh[1])
    assert code == 0
    rng = random.Random(5)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(dns_addr)
        for i in range(3000):
            s.send(rng.randbytes(rng.randrange(0, 200)))
            if i % 500 == 0:
                # The proxied connection keeps echoing while the flood goes on.
                writer.write(f"chunk {i}".encode())
                assert (
                    await asyncio.wait_for(reader.readexactly(len(f"chunk {i}")), 3) == f"chunk {i}".encode()
                )
    hang = []
    for prefix in (b"\xff\xff", b"\x00\x0c" + rng.randbytes(12), rng.randbytes(100)):
        _, w = await asyncio.open_connection(*dns_addr)
        w.write(prefix)
        hang.append(w)
    # Asked as a stub resolver asks: again after a timeout. The flood can still fill the receiving
    # worker's socket buffer (the proxy is another process now, draining it at its own pace), and
    # the kernel drops a datagram that finds it full: the query is lost, never seen.
    for attempt in range(3):
        try:
            reply = await _dns_udp(dns_addr, "echo.ns1.svc.cluster.local.")
            break
        except TimeoutError:
            if attempt == 2:
                raise
    assert reply.rcode() == dns.rcode.NOERROR and "10.200.0.1" in reply.to_text()
    writer.write(b"still here")
    assert await asyncio.wait_for(reader.readexactly(10), 3) == b"still here"
    writer.close()
    for w in hang:
        w.close()
    status, body = await _http_get(CLIENT_IP, 15020, "/metrics")
    assert (
        'istio_dns_requests_total{request_query_type="a",request_protocol="udp",'
        'source_canonical_service="client-app",source_canonical_revision="v1"} 1'
    ) in body
    status, body = await _http_get(CLIENT_IP, 15021, "/healthz/ready")
    assert (status, body) == (200, "ready\n")


async def test_dns_capture_off_means_no_dns_port(fleet: Fleet) -> None:
    echo = await start_echo(ECHO_IP, 0)
    local = MESH.format(client=CLIENT_IP, echo=ECHO_IP, port=1, local_port=1)
    try:
        [proxy] = await fleet.start(
            proxy_env(CLIENT_IP, "ns1/client/client", local, ISTIO_META_DNS_CAPTURE="false")
        )
        assert "socks5" in proxy.listeners() and "dns" not in proxy.listeners()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s, pytest.raises(ConnectionRefusedError):
            s.connect((CLIENT_IP, 15053))
    finally:
        echo.server.close()


# -- the system resolver, with the proxy's resolv.conf in a private mount namespace (root) ----------

SEARCH = (
    "search ns1.svc.cluster.local svc.cluster.local cluster.local\noptions ndots:5 timeout:2 attempts:1\n"
)


def _wait_udp(addr: tuple[str, int], proc: subprocess.Popen[bytes], what: str, log: Path) -> None:
    query = dns.message.make_query("probe.upstream.test.", "A").to_wire()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{what} exited {proc.returncode}: {log.read_text()[-2000:]}")
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(0.2)
            try:
                s.sendto(query, addr)
                s.recv(512)
                return
            except OSError:
                time.sleep(0.1)  # before asking again (the deadline above bounds the wait)
    pytest.fail(f"{what} did not answer on {addr}: {log.read_text()[-2000:]}")


@contextlib.contextmanager
def dedicated_dns(
    tmp_path: Path, mesh: Callable[[str], str], hosts: str, search: str = SEARCH
) -> Iterator[tuple[str, str]]:
    """A `ztunnel proxy` (its workload `ns1/client` at <ip>, the local config `mesh(ip)`) serving DNS
    on <ip>:53, with its own /etc/resolv.conf naming a dnsmasq that answers `hosts` (a hosts file)
    and is authoritative for `upstream.test` and `cluster.local`. Yields the proxy's address and a
    client's resolv.conf naming it."""
    require_root("unshare", "mount", "getent")
    (dnsmasq,) = require_tools("dnsmasq", hint="Debian package dnsmasq-base")
    net = f"127.{random.randint(16, 250)}.{random.randint(0, 250)}"
    upstream_ip, proxy_ip = f"{net}.53", f"{net}.2"
    hosts_file = tmp_path / "hosts"
    hosts_file.write_text(hosts + "192.0.2.8 probe.upstream.test\n")
    up_log = tmp_path / "dnsmasq.log"
    upstream = subprocess.Popen(
        [dnsmasq, "--keep-in-foreground", "--no-resolv", "--no-hosts", f"--addn-hosts={hosts_file}",
         "--bind-interfaces", f"--listen-address={upstream_ip}", "--port=53", "--local=/upstream.test/",
         "--local=/cluster.local/", "--user=root", f"--pid-file={tmp_path / 'dnsmasq.pid'}",
         "--log-facility=-"],
        stdout=up_log.open("wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    own_resolv = tmp_path / "ztunnel-resolv.conf"
    own_resolv.write_text(f"nameserver {upstream_ip}\n{search}")
    local = tmp_path / "mesh.yaml"
    local.write_text(mesh(proxy_ip))
    env = {
        **proxy_env(proxy_ip, "ns1/client/client"),
        "LOCAL_XDS_PATH": str(local),
        "ISTIO_META_DNS_PROXY_ADDR": f"{proxy_ip}:53",
    }
    env.pop("LOCAL_XDS")
    script = 'mount --bind "$0" /etc/resolv.conf && exec "$@"'
    wrap = ["unshare", "-m", "--propagation", "private", "sh", "-c", script, str(own_resolv)]
    proxy = Proxy(env, tmp_path / "proxy.log", wrap=wrap)
    try:
        _wait_udp((upstream_ip, 53), upstream, "dnsmasq", up_log)
        proxy.start()
        assert proxy.process is not None
        _wait_udp((proxy_ip, 53), proxy.process, "ztunnel proxy", proxy.log_path)
        client_resolv = tmp_path / "client-resolv.conf"
        client_resolv.write_text(f"nameserver {proxy_ip}\n{search}")
        yield proxy_ip, str(client_resolv)
    finally:
        proxy.stop()
        upstream.terminate()
        try:
            upstream.wait(10)
        except subprocess.TimeoutExpired:
            upstream.kill()


@pytest.fixture
def system(tmp_path: Path) -> Iterator[str]:
    """The proxy's DNS on <ip>:53 and a dnsmasq upstream; yields a client's resolv.conf naming it."""

    def mesh(ip: str) -> str:
        return MESH.format(client=ip, echo=ip.rpartition(".")[0] + ".3", port=8080, local_port=8080)

    with dedicated_dns(tmp_path, mesh, "192.0.2.7 known.upstream.test\n") as (_, client_resolv):
        yield client_resolv


def getent(client_resolv: str, database: str, name: str) -> tuple[int, str]:
    """The system resolver of a client whose /etc/resolv.conf is `client_resolv` (bind-mounted in a
    private mount namespace, the machine's own is never touched)."""
    script = 'mount --bind "$0" /etc/resolv.conf && exec getent "$1" "$2"'
    done = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", script, client_resolv, database, name],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return done.returncode, done.stdout


@pytest.mark.root
@pytest.mark.parametrize(
    ("name", "addresses"),
    [
        ("echo", ["10.200.0.1"]),  # the search list's first domain makes the exact name
        ("echo.ns1", ["10.200.0.1"]),
        ("echo.ns1.svc.cluster.local", ["10.200.0.1"]),
        ("web.ns2", ["10.96.0.20"]),  # stripped and expanded: answered with a CNAME
        ("mesh-only.example", ["240.0.0.1"]),  # a name only the mesh knows
        ("known.upstream.test", ["192.0.2.7"]),  # forwarded to ztunnel's own nameserver
        ("nothere.upstream.test", []),  # the upstream's NXDOMAIN
    ],
)
def test_system_resolver(system: str, name: str, addresses: list[str]) -> None:
    code, out = getent(system, "ahostsv4", name)
    got = sorted({line.split()[0] for line in out.splitlines()})
    assert got == addresses, out
    assert code == (0 if addresses else 2)
