"""The outbound listener's playbook: an accepted connection's original destination in; the route
taken, the TCP dial or the HBONE pool checkout (its key: the peer's identities and address) and the
CONNECT sent on it (authority, `forwarded`, `baggage`, the app's first bytes), or the failure with
its response flag, out. One row per decision of `ztunnel/proxy/outbound.py` and `upstream.py` (route,
pool, stream), run in this process over `tests/playbook.py`'s fakes: change a decision and its row
fails.

The client is `demo/client` (10.0.0.1, network net1), whose app has sent `hello` before the proxy
acts: on a direct HBONE route those bytes ride with the CONNECT; on TCP and double HBONE they are
relayed once the upstream is up."""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field

import pytest

from hbone.errors import ConnectionClosed, H2HandshakeError, IdentityMismatch
from hbone.h2core.codes import ErrorCode
from hbone.identity import Identity
from tests.conftest import LogLines
from tests.playbook import Answer, App, Dial, PlaybookProxy, mesh_state, now, proxy, run
from ztunnel.config.settings import Config, WorkloadInfo
from ztunnel.proxy.outbound import Outbound
from ztunnel.proxy.upstream import NETWORK_POLICY_HINT

MESH = """
workloads:
  - {uid: c1//Pod/demo/client, name: client, namespace: demo, serviceAccount: client, network: net1,
     trustDomain: cluster.local, workloadIps: ["10.0.0.1"], protocol: HBONE, clusterId: c1,
     workloadName: client, workloadType: deployment, canonicalName: client, canonicalRevision: v1,
     locality: {region: r1, zone: z1}}
  - {uid: c1//Pod/demo/server, name: server, namespace: demo, serviceAccount: server, network: net1,
     trustDomain: cluster.local, workloadIps: ["10.0.0.2"], protocol: HBONE,
     services: {"demo/web.demo.svc.cluster.local": {80: 8080}}}
  - {uid: c1//Pod/demo/plain, name: plain, namespace: demo, serviceAccount: plain, network: net1,
     trustDomain: cluster.local, workloadIps: ["10.0.0.3"], protocol: TCP,
     services: {"demo/legacy.demo.svc.cluster.local": {80: 9090}}}
  - {uid: c1//Pod/demo/waypoint, name: waypoint, namespace: demo, serviceAccount: waypoint, network: net1,
     trustDomain: cluster.local, workloadIps: ["10.0.9.1"], protocol: HBONE}
  - {uid: c1//Pod/demo/guarded, name: guarded, namespace: demo, serviceAccount: guarded, network: net1,
     trustDomain: cluster.local, workloadIps: ["10.0.4.1"], protocol: HBONE,
     waypoint: {destination: "net1/10.0.9.1"}}
  - {uid: c2//Pod/istio-system/eastwest, name: eastwest, namespace: istio-system, serviceAccount: eastwest,
     network: net2, trustDomain: cluster.local, workloadIps: ["10.10.0.1"], protocol: HBONE}
  - {uid: c2//Pod/demo/remote, name: remote, namespace: demo, serviceAccount: remote, network: net2,
     trustDomain: cluster.local, workloadIps: [], protocol: HBONE,
     networkGateway: {destination: "net2/10.10.0.1"}, services: {"demo/global.example": {80: 8080}}}
services:
  - {name: web, namespace: demo, hostname: web.demo.svc.cluster.local, vips: ["net1/10.96.0.1"],
     ports: {80: 8080}}
  - {name: legacy, namespace: demo, hostname: legacy.demo.svc.cluster.local, vips: ["net1/10.96.0.3"],
     ports: {80: 9090}}
  - {name: waypointed, namespace: demo, hostname: waypointed.example, vips: ["net1/10.96.0.2"],
     ports: {80: 8080}, waypoint: {destination: "net1/10.0.9.1"}}
  - {name: empty, namespace: demo, hostname: empty.example, vips: ["net1/10.96.0.9"], ports: {80: 8080}}
  - {name: global, namespace: demo, hostname: global.example, vips: ["net1/10.96.6.1"], ports: {80: 8080},
     subjectAltNames: ["spiffe://cluster.local/ns/demo/sa/remote"]}
"""

CONFIG = Config(network="net1")
CLIENT = WorkloadInfo(namespace="demo", name="client", service_account="client")
CLIENT_ID = Identity("cluster.local", "demo", "client")
SERVER_ID = Identity("cluster.local", "demo", "server")
SRC = ("10.0.0.1", 41000)
FOR = 'for="10.0.0.1:41000"'
CLIENT_BAGGAGE = (
    "k8s.cluster.name=c1,k8s.namespace.name=demo,k8s.deployment.name=client,service.name=client,"
    "service.version=v1,cloud.region=r1,cloud.availability_zone=z1"
)
TRACEPARENT = re.compile(r"00-[0-9a-f]{32}-[0-9a-f]{16}-00")


def sa(name: str, ns: str = "demo") -> str:
    return f"spiffe://cluster.local/ns/{ns}/sa/{name}"


@dataclass(frozen=True)
class Out:
    """What is observed: the TCP connection dialled; the pool checkout (the peer identities expected,
    the peer's address) and the CONNECT sent (authority, `forwarded`); for double HBONE what the inner
    TLS expects and the inner CONNECT's authority and `x-forwarded-network`; the closed connections by
    response flag once it ended; a text of the access log; when (seconds after the accept) the
    upstream was up, or the app's connection closed."""

    tcp: Dial | None = None
    pool: tuple[tuple[str, ...], tuple[str, int]] | None = None
    connect: tuple[str, str] | None = None
    inner: tuple[tuple[str, ...], str, str] | None = None
    flags: dict[str, int] = field(default_factory=lambda: {"-": 1})
    log: str = ""
    at: float = 0.0

    @property
    def carried(self) -> bool:
        return "-" in self.flags


@dataclass(frozen=True)
class Row:
    name: str
    dst: tuple[str, int]
    out: Out
    peer: Answer = field(default_factory=Answer)  # how the HBONE peers answer
    refusing: bool = False  # the TCP destination refuses
    info: WorkloadInfo = CLIENT


def failed(flags: str, log: str, **kw: object) -> Out:
    """The upstream failed: the app's connection closed, the failure counted with `flags`."""
    return Out(flags={flags: 1}, log=log, **kw)  # type: ignore[arg-type]


def refused(log: str, **kw: object) -> Out:
    """Refused before any upstream (no metrics, a "connection failed" warning): the app's connection
    closed."""
    return Out(flags={}, log=log, **kw)  # type: ignore[arg-type]


SERVER = (sa("server"),), ("10.0.0.2", 15008)
WAYPOINT = (sa("waypoint"),), ("10.0.9.1", 15008)
TO_SERVER = ("10.0.0.2:8080", FOR)

ROWS = [
    # -- TCP ------------------------------------------------------------------------------------------
    Row(
        "unknown address: TCP passthrough, as dialled",
        ("192.168.1.1", 80),
        Out(tcp=Dial(("192.168.1.1", 80))),
    ),
    Row("TCP workload: straight to it", ("10.0.0.3", 9090), Out(tcp=Dial(("10.0.0.3", 9090)))),
    Row("TCP workload's service: port translated", ("10.96.0.3", 80), Out(tcp=Dial(("10.0.0.3", 9090)))),
    Row(
        "TCP destination refuses",
        ("192.168.1.1", 80),
        failed("CONNECT", 'error="[Errno 111] Connection refused"', tcp=Dial(("192.168.1.1", 80))),
        refusing=True,
    ),
    # -- HBONE ------------------------------------------------------------------------------------------
    Row(
        "HBONE workload: CONNECT ip:port on its 15008",
        ("10.0.0.2", 8080),
        Out(pool=SERVER, connect=TO_SERVER),
    ),
    Row(
        "service VIP: an endpoint, the port translated, the service in forwarded",
        ("10.96.0.1", 80),
        Out(pool=SERVER, connect=("10.0.0.2:8080", FOR + ";host=web.demo.svc.cluster.local")),
    ),
    # -- waypoints --------------------------------------------------------------------------------------
    Row(
        "service with a waypoint: to the waypoint, authority the VIP as dialled",
        ("10.96.0.2", 80),
        Out(pool=WAYPOINT, connect=("10.96.0.2:80", FOR + ";host=waypointed.example")),
    ),
    Row(
        "workload with a waypoint: to the waypoint, authority the address as dialled",
        ("10.0.4.1", 80),
        Out(pool=WAYPOINT, connect=("10.0.4.1:80", FOR)),
    ),
    # -- double HBONE -----------------------------------------------------------------------------------
    Row(
        "another network: double HBONE through its gateway",
        ("10.96.6.1", 80),
        Out(
            pool=((sa("eastwest", "istio-system"),), ("10.10.0.1", 15008)),
            connect=("global.example:80", FOR + ";host=global.example"),
            inner=((sa("remote"),), "global.example:80", "net1"),
        ),
    ),
    # -- no route -----------------------------------------------------------------------------------------
    Row("service without endpoints", ("10.96.0.9", 80), refused("no healthy upstream: 10.96.0.9:80")),
    Row(
        "our own outbound port: refused",
        ("127.0.0.1", 15001),
        refused("attempted recursive call to ourselves"),
    ),
    Row(
        "our own workload unknown: refused after 5 s",
        ("10.0.0.2", 8080),
        refused("unknown source workload: demo/nobody", at=5.0),
        info=WorkloadInfo(namespace="demo", name="nobody", service_account="nobody"),
    ),
    # -- the HBONE peer fails -----------------------------------------------------------------------------
    Row(
        "peer denies: 401",
        ("10.0.0.2", 8080),
        failed("CONNECT", "http status: 401", pool=SERVER, connect=TO_SERVER),
        peer=Answer(status=401),
    ),
    Row(
        "peer has no app: 503",
        ("10.0.0.2", 8080),
        failed("CONNECT", "http status: 503", pool=SERVER, connect=TO_SERVER),
        peer=Answer(status=503),
    ),
    Row(
        "peer resets the CONNECT",
        ("10.0.0.2", 8080),
        failed("H2_HANDSHAKE_FAILURE", "stream reset", pool=SERVER, connect=TO_SERVER),
        peer=Answer(reset=ErrorCode.REFUSED_STREAM),
    ),
    Row(
        "peer's 15008 refuses",
        ("10.0.0.2", 8080),
        failed("CONNECT", "Connection refused", pool=SERVER),
        peer=Answer(dial_error=ConnectionRefusedError(111, "Connection refused")),
    ),
    Row(
        "peer's 15008 never answers",
        ("10.0.0.2", 8080),
        failed("NETWORK_POLICY", NETWORK_POLICY_HINT, pool=SERVER),
        peer=Answer(dial_error=TimeoutError()),
    ),
    Row(
        "peer is not who the route expects",
        ("10.0.0.2", 8080),
        failed("TLS_FAILURE", "peer did not present the expected SAN", pool=SERVER),
        peer=Answer(dial_error=IdentityMismatch([SERVER_ID], [Identity("cluster.local", "demo", "evil")])),
    ),
    Row(
        "peer's TLS up, HTTP/2 not",
        ("10.0.0.2", 8080),
        failed("H2_HANDSHAKE_FAILURE", "no SETTINGS", pool=SERVER),
        peer=Answer(dial_error=H2HandshakeError("no SETTINGS")),
    ),
    Row(
        "peer's connection closed",
        ("10.0.0.2", 8080),
        failed("H2_HANDSHAKE_FAILURE", "gone", pool=SERVER),
        peer=Answer(dial_error=ConnectionClosed("gone")),
    ),
]


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.name)
def test_outbound_playbook(row: Row, proxy_logs: LogLines) -> None:
    run(lambda: play(row))
    assert row.out.log in proxy_logs.text()


async def play(row: Row) -> None:
    out = row.out
    p = proxy(mesh_state(MESH), row.info, CONFIG)
    if row.refusing:
        p.sockets.refusing.add(row.dst)
    p.peer.answer = row.peer
    try:
        app, transport, inbox = await p.accept()
        await app.send(b"hello")
        await inbox.wait_data()
        start = now()
        carried = await Outbound(p.ctx, p.upstreams).forward(transport, inbox, SRC, row.dst)
        assert now() - start == pytest.approx(out.at)
        assert p.sockets.dials == ([out.tcp] if out.tcp else [])
        checkouts = [(tuple(str(i) for i in k.dst_identities), k.dst) for k in p.peer.dials]
        assert checkouts == ([out.pool] if out.pool else [])
        assert all(k.src_identity == CLIENT_ID and k.src_ip is None for k in p.peer.dials)
        outer = [c for c in p.peer.connects if c.connection]
        assert [(c.authority, c.headers["forwarded"]) for c in outer] == (
            [out.connect] if out.connect else []
        )
        for c in outer:
            assert c.headers["baggage"] == CLIENT_BAGGAGE
            assert TRACEPARENT.fullmatch(c.headers["traceparent"])
            assert "x-forwarded-network" not in c.headers
        inner_connects = [c for c in p.peer.connects if not c.connection]
        inner = [
            (tuple(str(i) for i in ids), c.authority, c.headers["x-forwarded-network"])
            for ids, c in zip(p.peer.inner_identities, inner_connects, strict=True)
        ]
        assert inner == ([out.inner] if out.inner else [])
        if carried is None:
            assert not out.carried
            assert await app.read_to_end() == b""  # the app's connection closed
        else:
            assert out.carried
            await carry_both_ways(p, app, early_with_connect=out.connect is not None and out.inner is None)
        await p.settled()
        assert p.closed_flags() == out.flags
    finally:
        await p.close()


async def carry_both_ways(p: PlaybookProxy, app: App, *, early_with_connect: bool) -> None:
    """The upstream up: the app's first bytes reach it (with the CONNECT on a direct HBONE route),
    then bytes both ways, then each side ends."""
    if p.sockets.apps:  # TCP
        upstream = p.sockets.apps[0]
        assert await upstream.read(5) == b"hello"
        await upstream.send(b"pong")
        assert await app.read(4) == b"pong"
        await app.end()
        assert await upstream.read_to_end() == b""
        upstream.close()
        assert await app.read_to_end() == b""
        app.close()
        return
    connect = p.peer.connects[-1]
    session = connect.session
    if early_with_connect:
        assert connect.early_data == b"hello"
    else:
        assert connect.early_data == b""
        await session.wait_for(lambda: bytes(session.data) == b"hello")
    stream = p.peer.streams[-1]
    stream.received_data(b"pong", 4)
    assert await app.read(4) == b"pong"
    await app.end()
    await session.wait_for(lambda: session.ended)
    stream.received_end()
    assert await app.read_to_end() == b""
    app.close()


def test_connections_share_a_pooled_connection_until_it_idles_out() -> None:
    """Two connections to one peer: one dial, two CONNECTs on it. After POOL_UNUSED_RELEASE_TIMEOUT
    without a checkout (5 min by the proxy's clock) the pool has let it go: the next one dials."""

    async def main() -> None:
        p = proxy(mesh_state(MESH), CLIENT, CONFIG)
        try:
            for _ in range(2):
                await one_connection(p, ("10.96.0.1", 80))
            assert [c.connection for c in p.peer.connects] == [1, 1]
            assert len(p.peer.dials) == 1
            await one_connection(p, ("10.0.0.2", 8080))  # the same peer, addressed directly
            assert len(p.peer.dials) == 1
            await asyncio.sleep(CONFIG.pool_unused_release_timeout + 31)  # the pool looks every 30 s
            await one_connection(p, ("10.0.0.2", 8080))
            assert [c.connection for c in p.peer.connects] == [1, 1, 1, 2]
            assert p.peer.connections[0].closed
        finally:
            await p.close()

    run(main)


async def one_connection(p: PlaybookProxy, dst: tuple[str, int]) -> None:
    app, transport, inbox = await p.accept()
    await app.send(b"hello")
    await inbox.wait_data()
    carried = await Outbound(p.ctx, p.upstreams).forward(transport, inbox, SRC, dst)
    assert carried is not None
    await carry_both_ways(p, app, early_with_connect=True)
    await p.settled()
