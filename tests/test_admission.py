"""Inbound admission as a table: what arrives (method, authority, addresses, identity, headers) and
which workload we are -> the status and reason, or the delivery plan. Every 400/401/503 row of the
server side's request processing is here, without sockets; the app connection's own 503 (a refused
or timed-out dial) is I/O and is covered end to end. Also the one classifier of upstream failures and
the SOCKS5 replies it implies."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

import pytest

from hbone.errors import (
    ConnectionClosed,
    H2HandshakeError,
    HttpStatusError,
    IdentityMismatch,
    StreamResetError,
    TlsHandshakeError,
)
from hbone.identity import Identity
from mesh.localconfig import parse_local_config
from ztunnel.decisions.admission import (
    UNKNOWN_LOCAL,
    AdmissionRules,
    Admit,
    InboundRequest,
    Reject,
    admit,
    forwarded_host,
)
from ztunnel.decisions.rejection import RejectionKind
from ztunnel.decisions.route import RECURSIVE_CALL, Protocol, is_self_call
from ztunnel.proxy.socks5_codec import Reply
from ztunnel.proxy.socks5_listener import reply_for
from ztunnel.proxy.upstream import DUMP_PROTOCOL, NETWORK_POLICY_HINT, classify_upstream_error
from ztunnel.state.store import ProxyState

CONFIG = """
workloads:
  - {uid: c//Pod/demo/server, name: server, namespace: demo, serviceAccount: server,
     trustDomain: cluster.local, workloadIps: ["10.0.0.2"], protocol: HBONE,
     services: {"demo/web.demo.svc.cluster.local": {80: 8080}}}
  - {uid: c//Pod/demo/client, name: client, namespace: demo, serviceAccount: client,
     trustDomain: cluster.local, workloadIps: ["10.0.0.1"], protocol: HBONE}
  - {uid: c//Pod/demo/sandwich, name: sandwich, namespace: demo, serviceAccount: waypoint,
     trustDomain: cluster.local, workloadIps: ["10.0.0.5"], protocol: HBONE,
     applicationTunnel: {protocol: PROXY, port: 15088}}
  - {uid: c//Pod/demo/tunnel-none, name: tunnel-none, namespace: demo, serviceAccount: waypoint,
     trustDomain: cluster.local, workloadIps: ["10.0.0.6"], protocol: HBONE,
     applicationTunnel: {protocol: NONE}}
  - {uid: c//Pod/demo/waypoint, name: waypoint, namespace: demo, serviceAccount: waypoint,
     trustDomain: cluster.local, workloadIps: ["10.0.9.1"], protocol: HBONE}
  - {uid: c//Pod/demo/guarded, name: guarded, namespace: demo, serviceAccount: guarded,
     trustDomain: cluster.local, workloadIps: ["10.0.4.1"], protocol: HBONE,
     waypoint: {destination: "/10.0.9.1"}}
services:
  - {name: web, namespace: demo, hostname: web.demo.svc.cluster.local, vips: ["/10.96.0.1"],
     ports: {80: 8080}}
policies:
  - name: block-9999
    namespace: demo
    scope: Namespace
    action: Deny
    dryRun: false
    rules:
      - - - destinationPorts: [9999]
  - name: no-evil
    namespace: demo
    scope: Namespace
    action: Deny
    dryRun: false
    rules:
      - - - principals: [!Exact "cluster.local/ns/demo/sa/evil"]
"""

RULES = AdmissionRules(network="", illegal_ports=frozenset({15001, 15006, 15008}))
CLIENT = Identity("cluster.local", "demo", "client")
DENIED = "connection closed due to policy rejection: "


@pytest.fixture(scope="module")
def state() -> ProxyState:
    s = ProxyState()
    s.apply_local_config(parse_local_config(CONFIG))
    return s


def ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    return ipaddress.ip_address(text)


@dataclass
class Case:
    name: str
    local: str | None  # our workload's name; None: not known yet
    authority: str | None  # None: a plaintext connection (15006) to `local_addr`
    status: int | None = None  # the rejection, or None when admitted
    reason: str = ""  # the rejection's reason starts with this
    method: str = "CONNECT"
    local_addr: str = "10.0.0.2:15008"
    identity: Identity | None = CLIENT
    headers: dict[str, str] = field(default_factory=dict)
    app: tuple[str, int] | None = None  # where an admitted connection is delivered


ROWS = [
    # -- request shape --------------------------------------------------------------------------
    Case("method other than CONNECT", "server", "10.0.0.2:8080", 400, "invalid method: GET", method="GET"),
    Case("authority without a port", "server", "10.0.0.2", 400, "invalid authority"),
    Case("authority with a port over 65535", "server", "10.0.0.2:99999", 400, "invalid authority"),
    Case("bare IPv6 authority", "server", "fd00::1:80", 400, "invalid authority"),
    Case("authority with a bad host", "server", "a/b:80", 400, "invalid authority"),
    Case("unknown local workload", None, "10.0.0.2:8080", 503, UNKNOWN_LOCAL),
    # -- the destination must be ours -------------------------------------------------------------
    Case("our address", "server", "10.0.0.2:8080", app=("10.0.0.2", 8080)),
    Case("ip mismatch", "server", "10.0.0.7:8080", 400, "ip mismatch: 10.0.0.2 != 10.0.0.7"),
    Case(
        "app tunnel (PROXY) skips the ip check and delivers on its port over loopback",
        "sandwich",
        "10.0.0.7:80",
        local_addr="10.0.0.5:15008",
        app=("127.0.0.1", 15088),
    ),
    Case(
        "app tunnel (NONE) skips the ip check",
        "tunnel-none",
        "10.0.0.7:80",
        local_addr="10.0.0.6:15008",
        app=("10.0.0.6", 80),
    ),
    Case(
        "the waypoint of the destination",
        "waypoint",
        "10.0.4.1:80",
        local_addr="10.0.9.1:15008",
        app=("10.0.9.1", 80),
    ),
    Case(
        "not the waypoint of that destination",
        "waypoint",
        "10.0.0.2:80",
        400,
        "ip mismatch",
        local_addr="10.0.9.1:15008",
    ),
    # -- hostname authorities (from a network gateway) -----------------------------------------------
    Case("hostname of our service", "server", "web.demo.svc.cluster.local:80", app=("10.0.0.2", 8080)),
    Case("unknown hostname", "server", "nope.example:80", 503, "unknown service or port: nope.example:80"),
    Case(
        "hostname with a port the service lacks",
        "server",
        "web.demo.svc.cluster.local:81",
        503,
        "unknown service or port",
    ),
    # -- the self-call guard ------------------------------------------------------------------------
    Case("to our HBONE port", "server", "10.0.0.2:15008", 503, "illegal port: 15008"),
    Case("to our outbound port", "server", "10.0.0.2:15001", 503, "illegal port: 15001"),
    Case("to our plaintext port", "server", "10.0.0.2:15006", 503, "illegal port: 15006"),
    # -- authorization ---------------------------------------------------------------------------------
    Case("denied by port", "server", "10.0.0.2:9999", 401, DENIED + "explicitly denied by: demo/block-9999"),
    Case(
        "denied by principal",
        "server",
        "10.0.0.2:8080",
        401,
        DENIED + "explicitly denied by: demo/no-evil",
        identity=Identity("cluster.local", "demo", "evil"),
    ),
    # -- plaintext (15006): the original destination is the target ---------------------------------------
    Case("plaintext to our app", "server", None, local_addr="10.0.0.2:8080", app=("10.0.0.2", 8080)),
    Case("plaintext to our own port", "server", None, 503, RECURSIVE_CALL, local_addr="10.0.0.2:15006"),
    Case(
        "plaintext, recursion refused before the workload is known",
        None,
        None,
        503,
        RECURSIVE_CALL,
        local_addr="10.0.0.2:15001",
    ),
    Case("plaintext, unknown local workload", None, None, 503, UNKNOWN_LOCAL, local_addr="10.0.0.2:8080"),
    Case("plaintext denied by port", "server", None, 401, DENIED, local_addr="10.0.0.2:9999"),
]


def request(case: Case) -> InboundRequest:
    host, _, port = case.local_addr.rpartition(":")
    hbone = case.authority is not None
    return InboundRequest(
        peer=(ip("10.0.0.1"), 40000),
        local=(ip(host), int(port)),
        method=case.method if hbone else None,
        authority=case.authority,
        identity=case.identity if hbone else None,
        headers=case.headers,
    )


def workload(state: ProxyState, name: str | None):  # type: ignore[no-untyped-def]
    return None if name is None else state.workload_by_uid(f"c//Pod/demo/{name}")


@pytest.mark.parametrize("case", ROWS, ids=lambda c: c.name)
def test_admission_table(state: ProxyState, case: Case) -> None:
    decision = admit(state, workload(state, case.local), request(case), RULES)
    if case.status is None:
        assert isinstance(decision, Admit), decision
        assert decision.plan.app == case.app
    else:
        assert isinstance(decision, Reject), decision
        assert decision.status == case.status
        assert decision.reason.startswith(case.reason), decision.reason
        # Only an authorization denial carries the plan it judged (to be recorded as DENY).
        assert (decision.plan is not None) == (case.status == 401)


def test_admitted_plan_carries_authorization_input_and_tunnel_target(state: ProxyState) -> None:
    case = Case("", "sandwich", "10.0.0.7:80", local_addr="10.0.0.5:15008")
    decision = admit(state, workload(state, "sandwich"), request(case), RULES)
    assert isinstance(decision, Admit)
    plan = decision.plan
    # The PROXY v2 header names the client and the destination it asked for.
    assert plan.proxy_header == ((ip("10.0.0.1"), 40000), (ip("10.0.0.7"), 80))
    assert plan.source_ip == "127.0.0.1" and not plan.transparent
    conn = plan.connection
    assert (conn.dst_ip, conn.dst_port) == (ip("10.0.0.5"), 15088)
    assert conn.src_principal == "spiffe://cluster.local/ns/demo/sa/client"


def test_hostname_authority_tunnel_target_is_the_service_vip(state: ProxyState) -> None:
    case = Case("", "server", "web.demo.svc.cluster.local:80")
    decision = admit(state, workload(state, "server"), request(case), RULES)
    assert isinstance(decision, Admit)
    assert decision.plan.service is not None and decision.plan.service.name == "web"


def test_spoofing_dials_from_the_client_address(state: ProxyState) -> None:
    rules = AdmissionRules(network="", illegal_ports=RULES.illegal_ports, spoof_source=True)
    decision = admit(state, workload(state, "server"), request(Case("", "server", "10.0.0.2:8080")), rules)
    assert isinstance(decision, Admit)
    assert (decision.plan.source_ip, decision.plan.transparent) == ("10.0.0.1", True)


def test_source_workload_not_looked_up_for_a_request_from_another_network(state: ProxyState) -> None:
    local = workload(state, "server")
    same = admit(state, local, request(Case("", "server", "10.0.0.2:8080")), RULES)
    via = admit(
        state,
        local,
        request(Case("", "server", "10.0.0.2:8080", headers={"x-forwarded-network": "net2"})),
        RULES,
    )
    assert isinstance(same, Admit) and isinstance(via, Admit)
    assert same.plan.src_workload is not None and same.plan.src_workload.name == "client"
    assert via.plan.src_workload is None


def test_forwarded_host_picks_the_service_for_telemetry(state: ProxyState) -> None:
    case = Case(
        "", "server", "10.0.0.2:1234", headers={"forwarded": 'for="10.0.0.1";host=web.demo.svc.cluster.local'}
    )
    decision = admit(state, workload(state, "server"), request(case), RULES)
    assert isinstance(decision, Admit)
    assert decision.plan.service is not None and decision.plan.service.name == "web"


@pytest.mark.parametrize(
    ("dst", "port", "ours", "expected"),
    [
        ("127.0.0.1", 15001, False, True),  # outbound to our own port on loopback
        ("10.0.0.9", 15008, False, False),  # another proxy's HBONE port is a fine destination
        ("127.0.0.1", 8080, False, False),
        ("10.0.0.2", 15006, True, True),  # inbound: every address is ours
    ],
)
def test_self_call_guard(dst: str, port: int, ours: bool, expected: bool) -> None:
    assert is_self_call(ip(dst), port, RULES.illegal_ports, ours=ours) is expected


@pytest.mark.parametrize(
    ("error", "protocol", "flags", "kind", "reply"),
    [
        (HttpStatusError(401), Protocol.HBONE, "CONNECT", RejectionKind.DENIED, Reply.NOT_ALLOWED),
        (HttpStatusError(503), Protocol.HBONE, "CONNECT", RejectionKind.REFUSED, Reply.CONNECTION_REFUSED),
        (HttpStatusError(400), Protocol.HBONE, "CONNECT", RejectionKind.FAILED, Reply.GENERAL_FAILURE),
        (
            ConnectionRefusedError(111, "refused"),
            Protocol.TCP,
            "CONNECT",
            RejectionKind.REFUSED,
            Reply.CONNECTION_REFUSED,
        ),
        (TimeoutError(), Protocol.HBONE, "NETWORK_POLICY", RejectionKind.UNREACHABLE, Reply.HOST_UNREACHABLE),
        (TimeoutError(), Protocol.TCP, "CONNECT", RejectionKind.UNREACHABLE, Reply.HOST_UNREACHABLE),
        (
            TlsHandshakeError("tls handshake error: x"),
            Protocol.HBONE,
            "TLS_FAILURE",
            RejectionKind.FAILED,
            Reply.GENERAL_FAILURE,
        ),
        (
            IdentityMismatch([CLIENT], []),
            Protocol.HBONE,
            "TLS_FAILURE",
            RejectionKind.FAILED,
            Reply.GENERAL_FAILURE,
        ),
        (
            H2HandshakeError("no settings"),
            Protocol.HBONE,
            "H2_HANDSHAKE_FAILURE",
            RejectionKind.FAILED,
            Reply.GENERAL_FAILURE,
        ),
        (
            StreamResetError(2),
            Protocol.HBONE,
            "H2_HANDSHAKE_FAILURE",
            RejectionKind.UNREACHABLE,
            Reply.HOST_UNREACHABLE,
        ),
        (
            ConnectionClosed("goaway"),
            Protocol.HBONE,
            "H2_HANDSHAKE_FAILURE",
            RejectionKind.UNREACHABLE,
            Reply.HOST_UNREACHABLE,
        ),
        (
            OSError(113, "No route to host"),
            Protocol.TCP,
            "CONNECT",
            RejectionKind.UNREACHABLE,
            Reply.HOST_UNREACHABLE,
        ),
        (ValueError("bug"), Protocol.TCP, "CONNECT", RejectionKind.FAILED, Reply.GENERAL_FAILURE),
    ],
)
def test_upstream_errors_are_classified_by_type(
    error: BaseException, protocol: Protocol, flags: str, kind: RejectionKind, reply: Reply
) -> None:
    failure = classify_upstream_error(error, protocol)
    assert (failure.flags, failure.kind) == (flags, kind)
    assert reply_for(failure) is reply
    if flags == "NETWORK_POLICY":
        assert failure.error == NETWORK_POLICY_HINT


def test_a_tls_error_named_otherwise_is_still_a_tls_failure() -> None:
    """Classification follows the type, not the class name."""

    class PeerRefusedCertificate(TlsHandshakeError):
        pass

    assert classify_upstream_error(PeerRefusedCertificate("bad"), Protocol.HBONE).flags == "TLS_FAILURE"


@pytest.mark.parametrize(
    ("header", "host"),
    [
        ('for="10.0.0.1:4000";host=b.ns.svc.cluster.local', "b.ns.svc.cluster.local"),
        ('for="10.0.0.1:4000"; Host="b.ns.svc"', "b.ns.svc"),
        ('for="10.0.0.1:4000"', None),
        ("host=", None),
        (None, None),
    ],
)
def test_the_forwarded_host_is_the_service_the_client_addressed(header: str | None, host: str | None) -> None:
    assert forwarded_host(header) == host


def test_workload_state_spells_the_protocols_as_the_reference() -> None:
    assert {p.name: DUMP_PROTOCOL[p] for p in Protocol} == {
        "TCP": "TCP",
        "HBONE": "HBONE",
        "DOUBLE_HBONE": "DOUBLEHBONE",
    }
