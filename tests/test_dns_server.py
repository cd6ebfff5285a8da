"""The DNS server against programs we did not write: Debian's `dig` asks it over UDP and TCP, Debian's
`dnsmasq` is the upstream it forwards to. Each rule of authoritative answering and forwarding is a
row of a table, run over both transports; then the metrics it counts, and hostile input (random
bytes, short headers, oversized TCP length prefixes, a flood), after which it still answers."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import random
import socket
import struct
import subprocess
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import dns.flags
import dns.message
import dns.opcode
import dns.rcode
import dns.rdatatype
import pytest

from mesh.localconfig import parse_local_config
from mesh.model import Endpoint, Service, Workload
from tests.netns import require_tools
from tests.test_dns_resolver import MESH, SETTINGS
from ztunnel.dns.forwarder import Forwarder, UpstreamConfig
from ztunnel.dns.server import DnsServer
from ztunnel.metrics.families import Metrics
from ztunnel.sockets import SocketFactory
from ztunnel.state.store import ProxyState

UPSTREAM_TXT = "from-upstream"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_dnsmasq(dnsmasq: str, workdir: Path, ip: str, port: int) -> subprocess.Popen[bytes]:
    hosts = workdir / "hosts"
    hosts.write_text("192.0.2.7 known.upstream.test\n")
    return subprocess.Popen(
        [dnsmasq, "--keep-in-foreground", "--no-resolv", "--no-hosts", f"--addn-hosts={hosts}",
         "--bind-interfaces", f"--listen-address={ip}", f"--port={port}",
         "--local=/upstream.test/", "--local=/cluster.local/",
         f"--txt-record=web.ns1.svc.cluster.local,{UPSTREAM_TXT}",
         "--mx-host=mx.upstream.test,mail.upstream.test,10",
         "--user=" + ("root" if os.geteuid() == 0 else os.environ.get("USER", "nobody")),
         f"--pid-file={workdir / 'pid'}", "--log-facility=-"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    """dnsmasq on a loopback address of its own: authoritative for `upstream.test`, with a TXT and an
    MX of a mesh name (types the proxy does not answer itself)."""
    (dnsmasq,) = require_tools("dnsmasq", hint="Debian package dnsmasq-base")
    workdir = tmp_path_factory.mktemp("dnsmasq")
    query = dns.message.make_query("known.upstream.test.", "A").to_wire()
    errors = []
    for _ in range(5):  # a port some other test holds: another address and port
        ip, port = f"127.{random.randint(16, 250)}.{random.randint(0, 250)}.53", random.randint(20000, 60000)
        proc = _start_dnsmasq(dnsmasq, workdir, ip, port)
        for _ in range(100):
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.settimeout(0.1)
                try:
                    s.sendto(query, (ip, port))
                    s.recv(512)
                    break
                except OSError:
                    if proc.poll() is not None:
                        break
        if proc.poll() is None:
            break
        errors.append(proc.stderr.read().decode() if proc.stderr else "")
    else:
        pytest.fail(f"dnsmasq did not start: {errors}")
    try:
        yield (ip, port)
    finally:
        proc.terminate()
        proc.wait(5)


@dataclass
class Client:
    """The proxy instance's side the server asks for its client workload."""

    state: ProxyState
    uid: str | None

    def find_local_workload(self) -> Workload | None:
        return self.state.workload_by_uid(self.uid) if self.uid else None

    async def local_workload(self, timeout: float = 5.0) -> Workload | None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (w := self.find_local_workload()) is None and loop.time() < deadline:
            await asyncio.sleep(0.01)
        return w


@dataclass
class Running:
    server: DnsServer
    metrics: Metrics
    client: Client
    state: ProxyState

    @property
    def port(self) -> int:
        return self.server.address[1]


async def start(
    upstream: tuple[str, int] | None, uid: str | None = "c//Pod/ns1/client", *, loopback_v6: bool = False
) -> Running:
    state = ProxyState()
    state.apply_local_config(parse_local_config(MESH))
    metrics = Metrics(process_metrics=False)
    client = Client(state, uid)
    sockets = SocketFactory()
    nameservers = (upstream,) if upstream else ((("127.0.0.1", _free_port())),)
    forwarder = Forwarder(UpstreamConfig(nameservers=nameservers, timeout=1.0, attempts=1), sockets)
    server = DnsServer(
        ("127.0.0.1", 0), state, client, sockets, metrics.dns(), forwarder, SETTINGS, loopback_v6=loopback_v6
    )
    await server.start()
    return Running(server, metrics, client, state)


@pytest.fixture
async def proxy(upstream: tuple[str, int]) -> AsyncIterator[Running]:
    running = await start(upstream)
    yield running
    await running.server.close()


async def dig(port: int, *args: str) -> str:
    (path,) = require_tools("dig", hint="Debian package bind9-dnsutils")
    proc = await asyncio.create_subprocess_exec(
        path,
        "@127.0.0.1",
        "-p",
        str(port),
        "+tries=1",
        "+time=3",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await proc.communicate()
    return out.decode()


def header(out: str) -> tuple[str, set[str]]:
    """dig's status and flags."""
    for line in out.splitlines():
        if line.startswith(";; ->>HEADER<<-"):
            status = line.split("status: ")[1].split(",")[0]
        if line.startswith(";; flags:"):
            flags = set(line.split(";")[2].split(":")[1].split())
    return status, flags


def answers(out: str) -> list[tuple[str, str, str, str]]:
    """dig +noall +answer lines as (owner, ttl, type, data)."""
    rows = []
    for line in out.splitlines():
        if not line or line.startswith(";"):
            continue
        owner, ttl, _cls, rdtype, data = line.split(None, 4)
        rows.append((owner, ttl, rdtype, data))
    return rows


# (name, type, status, flags that must be set, answer records sorted) -- authoritative rows then forwarded
TABLE = [
    ("web.ns1.svc.cluster.local", "A", "NOERROR", {"aa", "ra"},
     [("web.ns1.svc.cluster.local.", "30", "A", "10.96.0.10")]),
    ("web", "AAAA", "NOERROR", {"aa", "ra"}, [("web.", "30", "AAAA", "fd00::10")]),
    ("web.ns2.svc.cluster.local.ns1.svc.cluster.local", "A", "NOERROR", {"aa"},
     [("web.ns2.svc.cluster.local.", "30", "A", "10.96.0.20"),
      ("web.ns2.svc.cluster.local.ns1.svc.cluster.local.", "30", "CNAME", "web.ns2.svc.cluster.local.")]),
    ("x.wild.example", "A", "NOERROR", {"aa"}, [("x.wild.example.", "30", "A", "240.0.0.3")]),
    ("headless.ns1.svc.cluster.local", "A", "NOERROR", {"aa"},
     [("headless.ns1.svc.cluster.local.", "30", "A", "10.1.0.1"),
      ("headless.ns1.svc.cluster.local.", "30", "A", "10.1.0.2")]),
    ("v4.ns1.svc.cluster.local", "AAAA", "NOERROR", {"aa"}, []),
    ("mesh-only.example", "A", "NOERROR", {"aa"}, [("mesh-only.example.", "30", "A", "240.0.0.1")]),
    # forwarded: relayed, not authoritative, the upstream's RCODE kept
    ("known.upstream.test", "A", "NOERROR", {"ra"}, [("known.upstream.test.", "0", "A", "192.0.2.7")]),
    ("web.ns1.svc.cluster.local", "TXT", "NOERROR", {"ra"},
     [("web.ns1.svc.cluster.local.", "0", "TXT", f'"{UPSTREAM_TXT}"')]),
    ("mx.upstream.test", "MX", "NOERROR", {"ra"}, [("mx.upstream.test.", "0", "MX", "10 mail.upstream.test.")]),
    ("nothere.upstream.test", "A", "NXDOMAIN", {"ra"}, []),
    ("private.ns2.svc.cluster.local", "A", "NXDOMAIN", {"ra"}, []),
]  # fmt: skip


@pytest.mark.interop
@pytest.mark.parametrize("transport", ["udp", "tcp"])
@pytest.mark.parametrize(
    ("name", "rdtype", "status", "flags", "records"), TABLE, ids=[f"{r[0]}/{r[1]}" for r in TABLE]
)
async def test_dig_table(
    proxy: Running,
    transport: str,
    name: str,
    rdtype: str,
    status: str,
    flags: set[str],
    records: list[object],
) -> None:
    tcp = ["+tcp"] if transport == "tcp" else ["+notcp"]
    out = await dig(proxy.port, *tcp, name, rdtype, "+nocookie")
    got_status, got_flags = header(out)
    assert got_status == status, out
    assert flags <= got_flags, out
    if "aa" not in flags:
        assert "aa" not in got_flags, out
    got = answers(await dig(proxy.port, *tcp, name, rdtype, "+noall", "+answer", "+nocookie"))
    # dnsmasq's answers from --txt-record / hosts carry its own TTL; ours are 30.
    if "aa" not in flags:
        got = [(o, "0", t, d) for o, _, t, d in got]
    assert sorted(got) == sorted(records), out  # type: ignore[type-var]


async def test_edns_echoed_and_cached_answers_stay_correct(proxy: Running) -> None:
    for _ in range(3):  # the second and third come from the cache of ready answers
        out = await dig(proxy.port, "web.ns1.svc.cluster.local", "A", "+dnssec", "+bufsize=1400", "+cookie")
        assert "; EDNS: version: 0, flags: do; udp: 1400" in out, out
        assert "10.96.0.10" in out
    # A change of the store is seen at once (the cache is invalidated).
    proxy.state.remove_service("ns1/web.ns1.svc.cluster.local")
    out = await dig(proxy.port, "web.ns1.svc.cluster.local", "A", "+nocookie")
    # Forwarded now: dnsmasq knows the name only for its TXT record.
    status, flags = header(out)
    assert status == "NOERROR" and "aa" not in flags and "10.96.0.10" not in out, out


def _metric(metrics: Metrics, line_start: str) -> float:
    body, _ = metrics.render(None)
    for line in body.decode().splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_metrics(proxy: Running) -> None:
    labels = 'request_protocol="{}",source_canonical_service="client-app",source_canonical_revision="v1"'
    for _ in range(3):
        await dig(proxy.port, "web.ns1.svc.cluster.local", "A", "+nocookie")
    await dig(proxy.port, "+tcp", "known.upstream.test", "A")
    m = proxy.metrics
    assert _metric(m, 'istio_dns_requests_total{request_query_type="a",' + labels.format("udp") + "}") == 3
    assert _metric(m, 'istio_dns_requests_total{request_query_type="a",' + labels.format("tcp") + "}") == 1
    upstream = 'request_query_type="a",' + labels.format("tcp")
    assert _metric(m, "istio_dns_upstream_requests_total{" + upstream + "}") == 1
    assert _metric(m, "istio_dns_upstream_failures_total{" + upstream) == 0
    assert _metric(m, "istio_dns_upstream_request_duration_seconds_count{" + upstream + "}") == 1
    assert _metric(m, "istio_dns_upstream_request_duration_seconds_bucket{" + upstream + ',le="5.0"}') == 1


async def test_upstream_failure_is_servfail() -> None:
    running = await start(None)  # nothing listens where the nameserver should be
    try:
        for tcp in ("+notcp", "+tcp"):
            out = await dig(running.port, tcp, "example.com", "A")
            assert header(out)[0] == "SERVFAIL", out
        assert (
            _metric(
                running.metrics,
                'istio_dns_upstream_failures_total{request_query_type="a",request_protocol="udp"',
            )
            == 1
        )
        # Our own answers do not need the upstream.
        out = await dig(running.port, "web.ns1.svc.cluster.local", "A")
        assert header(out)[0] == "NOERROR" and "10.96.0.10" in out
    finally:
        await running.server.close()


async def _udp_exchange(port: int, data: bytes, timeout: float = 2.0) -> bytes | None:
    loop = asyncio.get_running_loop()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.setblocking(False)
        s.connect(("127.0.0.1", port))
        await loop.sock_sendall(s, data)
        try:
            async with asyncio.timeout(timeout):
                return await loop.sock_recv(s, 65535)
        except TimeoutError:
            return None


async def test_opcodes_and_responses(proxy: Running) -> None:
    query = dns.message.make_query("web.ns1.svc.cluster.local.", "A")
    query.set_opcode(dns.opcode.NOTIFY)
    reply = await _udp_exchange(proxy.port, query.to_wire())
    assert reply is not None and dns.message.from_wire(reply).rcode() == dns.rcode.NOTIMP
    response = dns.message.make_response(dns.message.make_query("web.ns1.svc.cluster.local.", "A"))
    reply = await _udp_exchange(proxy.port, response.to_wire())
    assert reply is not None
    parsed = dns.message.from_wire(reply)
    assert parsed.rcode() == dns.rcode.FORMERR and parsed.id == response.id
    # Our own kind of error reply is not answered (two servers must not ping-pong FORMERRs).
    assert await _udp_exchange(proxy.port, reply, timeout=0.5) is None
    two = dns.message.make_query("a.example.", "A")
    two.question.append(dns.message.make_query("b.example.", "A").question[0])
    reply = await _udp_exchange(proxy.port, two.to_wire())
    assert reply is not None and dns.message.from_wire(reply).rcode() == dns.rcode.FORMERR


async def test_unknown_client_gets_servfail(upstream: tuple[str, int]) -> None:
    running = await start(upstream, uid=None)
    try:
        started = asyncio.get_running_loop().time()
        reply = await _udp_exchange(
            running.port, dns.message.make_query("web.ns1.svc.cluster.local.", "A").to_wire(), timeout=8
        )
        assert reply is not None and dns.message.from_wire(reply).rcode() == dns.rcode.SERVFAIL
        assert asyncio.get_running_loop().time() - started >= 4.5  # it waited for the workload
    finally:
        await running.server.close()


async def test_hostile_input(proxy: Running) -> None:
    rng = random.Random(11)
    good = dns.message.make_query("web.ns1.svc.cluster.local.", "A")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("127.0.0.1", proxy.port))
        # Random bytes, truncated headers, a header claiming more than it holds, and a flood of them.
        payloads = [rng.randbytes(rng.randrange(0, 600)) for _ in range(2000)]
        payloads += [good.to_wire()[:n] for n in range(0, 40)]
        payloads += [struct.pack("!6H", 1, 0x0100, 65535, 65535, 65535, 65535)]
        for p in payloads:
            s.send(p)
    # Over TCP: a length prefix that promises more than is sent, one of zero, garbage, then silence.
    writers = []
    for prefix in (b"\xff\xff" + b"x" * 10, b"\x00\x00", b"\x00\x05hello", rng.randbytes(300)):
        _, w = await asyncio.open_connection("127.0.0.1", proxy.port)
        w.write(prefix)
        writers.append(w)
    # Still answering, on both transports, while those TCP clients hang.
    reply = await _udp_exchange(proxy.port, good.to_wire())
    assert reply is not None and "10.96.0.10" in dns.message.from_wire(reply).to_text()
    out = await dig(proxy.port, "+tcp", "web.ns1.svc.cluster.local", "A")
    assert "10.96.0.10" in out, out
    # The oversized-prefix client is cut after the request timeout, not left holding a slot forever.
    r, w = await asyncio.open_connection("127.0.0.1", proxy.port)
    w.write(b"\xff\xff")
    async with asyncio.timeout(8):
        assert await r.read() == b""
    for w in writers:
        w.close()


async def test_truncated_udp_answer_for_small_buffers(proxy: Running) -> None:
    # Enough headless endpoints that the answer does not fit 512 bytes.
    for i in range(60):
        uid = f"c//Pod/ns1/many-{i}"
        proxy.state.upsert_workload(
            Workload(
                uid=uid,
                name=f"many-{i}",
                namespace="ns1",
                addresses=(ipaddress.ip_address(f"10.2.0.{i + 1}"),),
            )
        )
    proxy.state.upsert_service(
        Service(
            name="many",
            namespace="ns1",
            hostname="many.ns1.svc.cluster.local",
            endpoints=tuple(Endpoint(f"c//Pod/ns1/many-{i}") for i in range(60)),
        )
    )
    out = await dig(proxy.port, "+notcp", "+ignore", "+noedns", "many.ns1.svc.cluster.local", "A")
    _, flags = header(out)
    assert "tc" in flags, out
    out = await dig(proxy.port, "+tcp", "+noall", "+answer", "many.ns1.svc.cluster.local", "A")
    assert len(answers(out)) == 60
