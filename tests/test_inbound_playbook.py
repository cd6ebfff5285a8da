"""The inbound HBONE listener's playbook: a CONNECT's method, authority, headers and the peer's
identity in; the status answered (and when), the app connection dialled (or not), what the app
reads first, the response flags `/metrics` counts and the access log out. One row per decision of
`ztunnel/proxy/inbound.py` (admission, then the dial, then the 200 and the relay), run in this
process over `tests/playbook.py`'s fakes: change a decision and its row fails.

The statuses are the reference's: 400 for a request that is not a CONNECT or names no `ip:port` or
`host:port`, or an address that is not ours; 503 for an unknown local workload (after waiting 5 s for
it), an unknown hostname, one of the proxy's own ports, or an app that cannot be reached (refused, or
10 s without an answer); 401 for a policy's denial; else 200, with the destination's baggage, once
the app is connected.

The plaintext listener (15006, `inbound_passthrough.py`) has its own table below: the original
destination in, the connection closed or carried to the app out."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace

import pytest

from hbone.identity import Identity
from hbone.server import ConnectRequest
from hbone.stream import HboneStream
from mesh.localconfig import parse_local_config
from tests.conftest import LogLines
from tests.playbook import (
    App,
    Dial,
    FakeSession,
    connect_request_stream,
    mesh_state,
    now,
    proxy,
    run,
)
from ztunnel.config.settings import Config, WorkloadInfo
from ztunnel.proxy import proxyprotocol
from ztunnel.proxy.inbound import Inbound
from ztunnel.proxy.inbound_passthrough import InboundPassthrough
from ztunnel.state.store import ProxyState

MESH = """
workloads:
  - {uid: c1//Pod/demo/server, name: server, namespace: demo, serviceAccount: server,
     trustDomain: cluster.local, workloadIps: ["10.0.0.2"], protocol: HBONE, clusterId: c1,
     workloadName: server, workloadType: deployment, canonicalName: web, canonicalRevision: v1,
     services: {"demo/web.demo.svc.cluster.local": {80: 8080}}}
  - {uid: c1//Pod/demo/client, name: client, namespace: demo, serviceAccount: client,
     trustDomain: cluster.local, workloadIps: ["10.0.0.1"], protocol: HBONE}
  - {uid: c1//Pod/demo/waypoint, name: waypoint, namespace: demo, serviceAccount: waypoint,
     trustDomain: cluster.local, workloadIps: ["10.0.9.1"], protocol: HBONE}
  - {uid: c1//Pod/demo/guarded, name: guarded, namespace: demo, serviceAccount: guarded,
     trustDomain: cluster.local, workloadIps: ["10.0.4.1"], protocol: HBONE,
     waypoint: {destination: "/10.0.9.1"}}
  - {uid: c1//Pod/demo/sandwich, name: sandwich, namespace: demo, serviceAccount: sandwich,
     trustDomain: cluster.local, workloadIps: ["10.0.0.5"], protocol: HBONE,
     applicationTunnel: {protocol: PROXY, port: 15088}}
services:
  - {name: web, namespace: demo, hostname: web.demo.svc.cluster.local, vips: ["/10.96.0.1"],
     ports: {80: 8080}}
policies:
  - {name: no-9999, namespace: demo, scope: Namespace, action: Deny, dryRun: false, rules: [[[{destinationPorts: [9999]}]]]}
  - {name: no-evil, namespace: demo, scope: Namespace, action: Deny, dryRun: false,
     rules: [[[{principals: [{Exact: "cluster.local/ns/demo/sa/evil"}]}]]]}
"""

CLIENT = Identity("cluster.local", "demo", "client")
EVIL = Identity("cluster.local", "demo", "evil")
PEER = ("10.0.0.1", 41000)
# Our workload by name: who the proxy serves, and the address a CONNECT to it arrives on.
LOCALS = {
    "server": (WorkloadInfo(namespace="demo", name="server", service_account="server"), "10.0.0.2"),
    "waypoint": (WorkloadInfo(namespace="demo", name="waypoint", service_account="waypoint"), "10.0.9.1"),
    "sandwich": (WorkloadInfo(namespace="demo", name="sandwich", service_account="sandwich"), "10.0.0.5"),
    "nobody": (WorkloadInfo(namespace="demo", name="nobody", service_account="nobody"), "10.0.0.2"),
}
SERVER_BAGGAGE = "k8s.cluster.name=c1,k8s.namespace.name=demo,k8s.deployment.name=server,service.name=web,service.version=v1"
NS_BAGGAGE = "k8s.namespace.name=demo"  # a workload that names nothing else
DENIED = "connection closed due to policy rejection: "


@dataclass(frozen=True)
class Out:
    """What is observed: the status and when it was answered (seconds after the CONNECT arrived),
    the app connection dialled, the 200's baggage, the PROXY v2 header the app reads first (source,
    destination, client identity), the closed connections by response flag, a text of the access log."""

    status: int
    at: float = 0.0
    dial: Dial | None = None
    baggage: str | None = None
    proxy_header: tuple[tuple[str, int], tuple[str, int], str | None] | None = None
    flags: dict[str, int] = field(default_factory=dict)
    log: str = ""


@dataclass(frozen=True)
class Row:
    name: str
    authority: str
    out: Out
    local: str = "server"
    method: str = "CONNECT"
    identity: Identity | None = CLIENT
    headers: dict[str, str] = field(default_factory=dict)
    app: str = "listening"  # or "refusing", or "silent" (never answers the dial)
    config: Config = field(default_factory=Config)
    spoof_source: bool = False


def allowed(dial: Dial, **kw: object) -> Out:
    return Out(200, dial=dial, flags={"-": 1}, **kw)  # type: ignore[arg-type]


ROWS = [
    # -- the request ------------------------------------------------------------------------------
    Row("not a CONNECT", "10.0.0.2:8080", Out(400, log="invalid method: GET"), method="GET"),
    Row("authority without a port", "10.0.0.2", Out(400, log="invalid authority: '10.0.0.2'")),
    Row("authority with a bad host", "a/b:80", Out(400, log="invalid authority")),
    # -- our own workload -------------------------------------------------------------------------
    Row(
        "our workload unknown: 503 after 5 s",
        "10.0.0.2:8080",
        Out(503, at=5.0, log="unknown local workload"),
        local="nobody",
    ),
    # -- the destination must be ours -------------------------------------------------------------
    Row(
        "allowed: 200 with our baggage, the app dialled",
        "10.0.0.2:8080",
        allowed(Dial(("10.0.0.2", 8080)), baggage=SERVER_BAGGAGE, log="connection complete"),
    ),
    Row("another address: ip mismatch", "10.0.0.7:8080", Out(400, log="ip mismatch: 10.0.0.2 != 10.0.0.7")),
    Row("one of the proxy's own ports", "10.0.0.2:15008", Out(503, log="illegal port: 15008")),
    Row(
        "IPv6 literal, bracketed, not ours",
        "[fd00::2]:8080",
        Out(400, log="ip mismatch: 10.0.0.2 != fd00::2"),
    ),
    # -- authorization ----------------------------------------------------------------------------
    Row(
        "denied by port",
        "10.0.0.2:9999",
        Out(401, flags={"DENY": 1}, log=DENIED + "explicitly denied by: demo/no-9999"),
    ),
    Row(
        "denied by the peer's identity",
        "10.0.0.2:8080",
        Out(401, flags={"DENY": 1}, log=DENIED + "explicitly denied by: demo/no-evil"),
        identity=EVIL,
    ),
    # -- the app ----------------------------------------------------------------------------------
    Row(
        "app refuses: 503",
        "10.0.0.2:8080",
        Out(503, dial=Dial(("10.0.0.2", 8080)), flags={"CONNECT": 1}, log="connect to app: [Errno 111]"),
        app="refusing",
    ),
    Row(
        "app silent: 503 after the 10 s connect timeout",
        "10.0.0.2:8080",
        Out(
            503,
            at=10.0,
            dial=Dial(("10.0.0.2", 8080)),
            flags={"CONNECT": 1},
            log="connect to app: connection timed out",
        ),
        app="silent",
    ),
    Row(
        "in a pod: the app dialled from the client's own address",
        "10.0.0.2:8080",
        allowed(Dial(("10.0.0.2", 8080), source_ip="10.0.0.1", transparent=True), baggage=SERVER_BAGGAGE),
        spoof_source=True,
    ),
    Row(
        "ENABLE_RESPONSE_BAGGAGE=false: no baggage",
        "10.0.0.2:8080",
        allowed(Dial(("10.0.0.2", 8080))),
        config=Config(enable_response_baggage=False),
    ),
    # -- a hostname authority: from another network's gateway --------------------------------------
    Row(
        "service hostname: its target port",
        "web.demo.svc.cluster.local:80",
        allowed(Dial(("10.0.0.2", 8080)), baggage=SERVER_BAGGAGE),
        headers={"x-forwarded-network": "net2"},
    ),
    Row(
        "unknown hostname: 503",
        "nope.demo.svc.cluster.local:80",
        Out(503, log="unknown service or port: nope.demo.svc.cluster.local:80"),
    ),
    # -- waypoints ----------------------------------------------------------------------------------
    Row(
        "the waypoint of the address: delivered to the waypoint's own app",
        "10.0.4.1:80",
        allowed(Dial(("10.0.9.1", 80)), baggage=NS_BAGGAGE),
        local="waypoint",
    ),
    Row(
        "a waypoint, not of that address",
        "10.0.0.2:8080",
        Out(400, log="ip mismatch: 10.0.9.1 != 10.0.0.2"),
        local="waypoint",
    ),
    Row(
        "sandwiched waypoint: its tunnel port on loopback, with a PROXY v2 header",
        "10.0.4.1:80",
        allowed(
            Dial(("127.0.0.1", 15088), source_ip="127.0.0.1"),
            baggage=NS_BAGGAGE,
            proxy_header=(PEER, ("10.0.4.1", 80), str(CLIENT)),
        ),
        local="sandwich",
    ),
    Row(
        "sandwiched waypoint, LOCALHOST_APP_TUNNEL=false: its own address",
        "10.0.4.1:80",
        allowed(
            Dial(("10.0.0.5", 15088)), baggage=NS_BAGGAGE, proxy_header=(PEER, ("10.0.4.1", 80), str(CLIENT))
        ),
        local="sandwich",
        config=Config(localhost_app_tunnel=False),
    ),
]


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.name)
def test_inbound_playbook(row: Row, proxy_logs: LogLines) -> None:
    run(lambda: play(row, mesh_state(MESH)))
    assert row.out.log in proxy_logs.text()


async def play(row: Row, state: ProxyState) -> None:
    out = row.out
    info, our_ip = LOCALS[row.local]
    p = proxy(state, info, row.config, spoof_source=row.spoof_source)
    try:
        if row.app != "listening":
            assert out.dial is not None, "an app that does not answer is one the proxy dials"
            (p.sockets.refusing if row.app == "refusing" else p.sockets.silent).add(out.dial.addr)
        stream, session = connect_request_stream(row.identity)
        request = ConnectRequest(
            row.method, row.authority, dict(row.headers), row.identity, PEER, (our_ip, 15008), stream
        )
        start = now()
        await Inbound(p.ctx).handle(request)
        assert (session.status, now() - start) == (out.status, pytest.approx(out.at))
        assert p.sockets.dials == ([out.dial] if out.dial else [])
        assert session.response_headers.get("baggage") == out.baggage
        if out.status == 200:
            await relay_both_ways(p.sockets.apps[0], stream, session, out)
            await p.settled()
        else:
            assert session.ended  # an error response ends the stream
        assert p.closed_flags() == out.flags
    finally:
        await p.close()


async def relay_both_ways(app: App, stream: HboneStream, session: FakeSession, out: Out) -> None:
    """An admitted stream: the app reads the PROXY header (if any), then the client's bytes; its
    answer reaches the client; the client's END_STREAM and the app's close end the connection."""
    if out.proxy_header is not None:
        header = await app.read(16)
        length = int.from_bytes(header[14:16], "big")
        decoded = proxyprotocol.decode(header + await app.read(length))
        assert decoded is not None
        h = decoded[0]
        assert h.source is not None and h.destination is not None
        got = ((str(h.source[0]), h.source[1]), (str(h.destination[0]), h.destination[1]), h.peer_identity)
        assert got == out.proxy_header
    stream.received_data(b"ping", 4)
    assert await app.read(4) == b"ping"
    await app.send(b"pong")
    await session.wait_for(lambda: bytes(session.data) == b"pong")
    stream.received_end()
    assert await app.read_to_end() == b""
    app.close()
    await session.wait_for(lambda: session.ended)


def test_our_workload_arriving_during_the_wait_is_served_then() -> None:
    """The CONNECT waits for our workload (up to 5 s): it arrives after 1 s, and the CONNECT is
    answered then."""
    full = parse_local_config(MESH)
    state = ProxyState()
    state.apply_local_config(replace(full, workloads=[w for w in full.workloads if w.name != "server"]))

    async def main() -> None:
        p = proxy(state, LOCALS["server"][0])
        try:
            asyncio.get_running_loop().call_later(1.0, state.apply_local_config, full)
            stream, session = connect_request_stream(CLIENT)
            request = ConnectRequest(
                "CONNECT", "10.0.0.2:8080", {}, CLIENT, PEER, ("10.0.0.2", 15008), stream
            )
            await Inbound(p.ctx).handle(request)
            assert (session.status, now()) == (200, pytest.approx(1.0))
            assert p.sockets.dials == [Dial(("10.0.0.2", 8080))]
        finally:
            await p.close()

    run(main)


def test_a_policy_change_cuts_an_open_connection_it_now_denies(proxy_logs: LogLines) -> None:
    """An allowed connection is authorized again on every policy change: once a policy denies its
    client, both sides are cut and it is recorded as denied."""
    deny_client = """
  - {name: no-client, namespace: demo, scope: Namespace, action: Deny, dryRun: false,
     rules: [[[{principals: [{Exact: "cluster.local/ns/demo/sa/client"}]}]]]}
"""
    state = mesh_state(MESH)

    async def main() -> None:
        p = proxy(state, LOCALS["server"][0])
        try:
            stream, session = connect_request_stream(CLIENT)
            request = ConnectRequest(
                "CONNECT", "10.0.0.2:8080", {}, CLIENT, PEER, ("10.0.0.2", 15008), stream
            )
            await Inbound(p.ctx).handle(request)
            app = p.sockets.apps[0]
            stream.received_data(b"ping", 4)
            assert await app.read(4) == b"ping"
            state.apply_local_config(parse_local_config(MESH + deny_client))
            assert await app.read_to_end() == b""
            await session.wait_for(lambda: bool(session.resets))  # the client's stream reset
            await p.settled()
            assert p.closed_flags() == {"DENY": 1}
        finally:
            await p.close()

    run(main)
    assert "connection closed due to policy change" in proxy_logs.text()


# --- plaintext (15006) ------------------------------------------------------------------------------
# No request to answer: the connection's original destination is the target; a rejection closes it.


@dataclass(frozen=True)
class Plain:
    """A plaintext connection from PEER to `dst` (its original destination), and what is observed:
    the app connection dialled (None: the client's connection closed instead), when (seconds after
    the accept), the closed connections by response flag, a text of the access log."""

    name: str
    dst: tuple[str, int]
    dial: Dial | None
    flags: dict[str, int] = field(default_factory=dict)
    log: str = ""
    at: float = 0.0
    app: str = "listening"  # or "refusing", or "silent"
    local: str = "server"
    spoof_source: bool = False

    @property
    def carried(self) -> bool:
        return "-" in self.flags


PLAIN = [
    Plain("allowed: to the app at the port dialled", ("10.0.0.2", 8080), Dial(("10.0.0.2", 8080)), {"-": 1}),
    Plain(
        "in a pod: from the client's own address",
        ("10.0.0.2", 8080),
        Dial(("10.0.0.2", 8080), source_ip="10.0.0.1", transparent=True),
        {"-": 1},
        spoof_source=True,
    ),
    Plain(
        "one of the proxy's own ports", ("10.0.0.2", 15006), None, log="attempted recursive call to ourselves"
    ),
    Plain(
        "our workload unknown: closed after 5 s",
        ("10.0.0.2", 8080),
        None,
        log="unknown local workload",
        at=5.0,
        local="nobody",
    ),
    Plain(
        "denied by port", ("10.0.0.2", 9999), None, {"DENY": 1}, DENIED + "explicitly denied by: demo/no-9999"
    ),
    Plain(
        "app refuses",
        ("10.0.0.2", 8080),
        Dial(("10.0.0.2", 8080)),
        {"CONNECT": 1},
        "connect to app: [Errno 111]",
        app="refusing",
    ),
    Plain(
        "app silent: closed after the 10 s connect timeout",
        ("10.0.0.2", 8080),
        Dial(("10.0.0.2", 8080)),
        {"CONNECT": 1},
        "connect to app: connection timed out",
        at=10.0,
        app="silent",
    ),
]


@pytest.mark.parametrize("row", PLAIN, ids=lambda r: r.name)
def test_plaintext_playbook(row: Plain, proxy_logs: LogLines) -> None:
    run(lambda: play_plain(row, mesh_state(MESH)))
    assert row.log in proxy_logs.text()


async def play_plain(row: Plain, state: ProxyState) -> None:
    p = proxy(state, LOCALS[row.local][0], spoof_source=row.spoof_source)
    try:
        if row.app != "listening":
            assert row.dial is not None, "an app that does not answer is one the proxy dials"
            (p.sockets.refusing if row.app == "refusing" else p.sockets.silent).add(row.dial.addr)
        client, transport, inbox = await p.accept()
        await client.send(b"ping")
        start = now()
        carried = await InboundPassthrough(p.ctx).forward(transport, inbox, PEER, row.dst)
        assert now() - start == pytest.approx(row.at)
        assert p.sockets.dials == ([row.dial] if row.dial else [])
        assert (carried is not None) == row.carried
        if carried is None:
            assert await client.read_to_end() == b""  # closed, unanswered
        else:
            app = p.sockets.apps[0]
            assert await app.read(4) == b"ping"
            await app.send(b"pong")
            assert await client.read(4) == b"pong"
            await client.end()
            assert await app.read_to_end() == b""
            app.close()
            assert await client.read_to_end() == b""
            client.close()
        await p.settled()
        assert p.closed_flags() == row.flags
    finally:
        await p.close()
