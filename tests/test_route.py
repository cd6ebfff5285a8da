"""Routing: a table of (source, destination) -> route or the reason there is none, and the routes
of DNS answers."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from tests.route_mesh import (
    CLIENT,
    EASTWEST_ID,
    IP,
    REMOTE_ID,
    TD,
    WAYPOINT_ID,
    WAYPOINT_SVC_ID,
    addr,
    state_fixture,  # noqa: F401 (a fixture)
)
from ztunnel.decisions.route import (
    NoRoute,
    Protocol,
    Route,
    pick_resolved,
    route,
)
from ztunnel.state.store import ProxyState


@dataclass(frozen=True)
class Want:
    """The parts of a `Route` a case pins down (None: not checked)."""

    protocol: Protocol
    next_hop: tuple[str, int]
    authority: str | None = None
    ids: tuple[str, ...] | None = None
    uid: str | None = None  # the workload that terminates the tunnel
    waypoint: bool = False
    final: tuple[str, ...] | None = None  # DOUBLE_HBONE inner identities


@dataclass(frozen=True)
class Case:
    name: str
    dst: str
    want: Want | NoRoute
    source: str = CLIENT
    source_ip: str | None = None


def hbone(ip: str, port: int, ids: tuple[str, ...] | None = None, uid: str | None = None) -> Want:
    host = f"[{ip}]" if ":" in ip else ip
    return Want(Protocol.HBONE, (ip, 15008), f"{host}:{port}", ids, uid)


def via_waypoint(wp: str, dst: str, ids: tuple[str, ...], port: int = 15008) -> Want:
    return Want(Protocol.HBONE, (wp, port), dst, ids, None, waypoint=True)


def tcp(ip: str, port: int, uid: str | None = None) -> Want:
    return Want(Protocol.TCP, (ip, port), uid=uid)


def no(reason: str) -> NoRoute:
    return NoRoute(reason)


CASES: list[Case] = [
    # workloads by IP, passthrough
    Case("hbone workload by ip", "10.0.0.2:8080", hbone("10.0.0.2", 8080, (f"{TD}/demo/sa/mesh",))),
    Case("tcp workload by ip", "10.0.0.3:9090", tcp("10.0.0.3", 9090, "c//Pod/demo/plain")),
    Case("unknown ip passes through", "192.0.2.7:443", tcp("192.0.2.7", 443)),
    Case("host-network workload ip is the node's: passthrough", "10.0.8.1:80", tcp("10.0.8.1", 80)),
    Case(
        "several workloads on one ip: the pod wins",
        "10.0.8.2:80",
        hbone("10.0.8.2", 80, uid="c//Pod/demo/pod-on-entry-ip"),
    ),
    Case("an ip of another network is not ours: passthrough", "10.10.1.5:8080", tcp("10.10.1.5", 8080)),
    Case("dual-stack workload dialled on ipv6", "[fd00::7:1]:8080", hbone("fd00::7:1", 8080)),
    Case(
        "the source's own waypoint is not used outbound",
        "10.0.0.2:8080",
        hbone("10.0.0.2", 8080),
        source="c//Pod/demo/client-with-waypoint",
    ),
    # services: port translation, SANs, health, passthrough
    Case(
        "service vip to hbone endpoint, port translated, service SANs first",
        "10.96.0.1:80",
        hbone("10.0.0.2", 8080, (f"{TD}/demo/sa/web-extra", f"{TD}/demo/sa/mesh")),
    ),
    Case("service vip to tcp endpoint", "10.96.0.2:80", tcp("10.0.0.3", 9090)),
    Case("service port not listed", "10.96.0.1:81", no("no healthy upstream: 10.96.0.1:81")),
    Case("only unhealthy endpoints", "10.96.0.3:80", no("no healthy upstream: 10.96.0.3:80")),
    Case("ALLOW_ALL keeps unhealthy endpoints", "10.96.0.5:80", hbone("10.0.0.4", 8080)),
    Case("passthrough service keeps the dialled address", "10.96.0.4:80", tcp("10.96.0.4", 80)),
    Case("named port: the endpoint's own mapping", "10.96.2.1:80", hbone("10.0.3.1", 9001)),
    Case("named port no endpoint exposes", "10.96.2.2:80", no("no healthy upstream: 10.96.2.2:80")),
    Case("endpoint mapping wins over the service target", "10.96.2.3:80", hbone("10.0.3.1", 7070)),
    Case("capacity 0 is never chosen", "10.96.2.4:80", hbone("10.0.3.4", 8080)),
    Case("ip families: IPv6-only service picks the v6 address", "10.96.7.1:80", hbone("fd00::7:1", 8080)),
    Case("ip families: IPv4-only service dialled on v6", "[fd00::96:7:2]:80", hbone("10.0.7.1", 8080)),
    # service lookup: shared VIPs, canonical, visibility, CIDR
    Case("shared vip: the client's namespace wins", "10.96.1.1:80", hbone("10.0.1.2", 8080)),
    Case("shared vip: the canonical service next", "10.96.1.2:80", hbone("10.0.1.4", 8080)),
    Case(
        "namespace-visible service is invisible to others: passthrough", "10.96.1.3:80", tcp("10.96.1.3", 80)
    ),
    Case(
        "namespace-visible service is visible in its namespace",
        "10.96.1.3:80",
        hbone("10.0.1.5", 8080),
        source="c//Pod/private/client",
    ),
    Case("cidr vip", "10.200.6.1:80", hbone("10.0.2.1", 8080)),
    Case("cidr vips: longest prefix", "10.200.5.9:80", hbone("10.0.2.2", 8080)),
    Case("exact vip before any cidr vip", "10.200.5.5:80", hbone("10.0.2.3", 8080)),
    # load balancing modes
    Case("strict: only endpoints matching every preference", "10.96.5.1:80", hbone("10.0.5.2", 8080)),
    Case("strict: nothing matches", "10.96.5.2:80", no("no healthy upstream: 10.96.5.2:80")),
    Case("failover: the best-ranked endpoint", "10.96.5.3:80", hbone("10.0.5.2", 8080)),
    Case("failover: falls over to a far endpoint", "10.96.5.4:80", hbone("10.0.5.1", 8080)),
    Case("network first: same network outranks a better locality", "10.96.5.5:80", hbone("10.0.5.1", 8080)),
    Case(
        "network first: among remote endpoints the locality still counts",
        "10.96.5.6:80",
        Want(
            Protocol.DOUBLE_HBONE,
            ("10.10.0.1", 15008),
            "netfirst-remote.example:80",
            (EASTWEST_ID,),
            "c//Pod/demo/remote-same-region",
            final=(f"{TD}/demo/sa/lb",),
        ),
    ),
    # service waypoints
    Case(
        "service waypoint by address: HBONE, original destination as authority",
        "10.96.3.1:80",
        via_waypoint("10.0.9.1", "10.96.3.1:80", (WAYPOINT_ID,)),
    ),
    Case(
        "service waypoint by vip: its service's SANs too",
        "10.96.3.2:80",
        via_waypoint("10.0.9.1", "10.96.3.2:80", (WAYPOINT_SVC_ID, WAYPOINT_ID)),
    ),
    Case(
        "service waypoint by hostname",
        "10.96.3.3:80",
        via_waypoint("10.0.9.1", "10.96.3.3:80", (WAYPOINT_SVC_ID, WAYPOINT_ID)),
    ),
    Case(
        "service waypoint by a workload's hostname",
        "10.96.3.4:80",
        via_waypoint("10.0.9.2", "10.96.3.4:80", (f"{TD}/demo/sa/waypoint2",)),
    ),
    Case(
        "waypoint on another HBONE port",
        "10.96.3.5:80",
        via_waypoint("10.0.9.1", "10.96.3.5:80", (WAYPOINT_ID,), port=15009),
    ),
    Case("unknown waypoint", "10.96.3.6:80", no("unknown waypoint: /10.0.9.99")),
    Case(
        "weighted waypoints: weight 0 never chosen",
        "10.96.3.7:80",
        via_waypoint("10.0.9.2", "10.96.3.7:80", (f"{TD}/demo/sa/waypoint2",)),
    ),
    Case(
        "weighted waypoints all zero: the single waypoint",
        "10.96.3.8:80",
        via_waypoint("10.0.9.1", "10.96.3.8:80", (WAYPOINT_ID,)),
    ),
    Case(
        "passthrough service still goes through its waypoint",
        "10.96.0.6:80",
        via_waypoint("10.0.9.1", "10.96.0.6:80", (WAYPOINT_ID,)),
    ),
    # workload waypoints
    Case(
        "workload waypoint, original destination as authority",
        "10.0.4.1:8080",
        via_waypoint("10.0.9.1", "10.0.4.1:8080", (WAYPOINT_ID,)),
    ),
    Case(
        "workload waypoint of a TCP workload, by hostname",
        "10.0.4.2:9000",
        via_waypoint("10.0.9.1", "10.0.4.2:9000", (WAYPOINT_SVC_ID, WAYPOINT_ID)),
    ),
    Case(
        "service addressing ignores the endpoint's workload waypoint",
        "10.96.4.1:80",
        hbone("10.0.4.1", 8080, uid="c//Pod/demo/guarded"),
    ),
    Case(
        "the waypoint's own traffic goes direct",
        "10.0.4.1:8080",
        hbone("10.0.4.1", 8080),
        source="c//Pod/demo/waypoint",
        source_ip="10.0.9.1",
    ),
    Case(
        "the waypoint's identity from another ip still goes through the waypoint",
        "10.0.4.1:8080",
        via_waypoint("10.0.9.1", "10.0.4.1:8080", (WAYPOINT_ID,)),
        source="c//Pod/demo/waypoint",
        source_ip="10.0.9.77",
    ),
    # other networks: double HBONE
    Case(
        "remote endpoint through its network gateway",
        "10.96.6.1:80",
        Want(
            Protocol.DOUBLE_HBONE,
            ("10.10.0.1", 15008),
            "global.example:80",
            (EASTWEST_ID,),
            "c//Pod/demo/remote-a",
            final=(REMOTE_ID,),
        ),
    ),
    Case(
        "network gateway by hostname",
        "10.96.6.2:80",
        Want(Protocol.DOUBLE_HBONE, ("10.10.0.1", 15008), "global-by-host.example:80", final=(REMOTE_ID,)),
    ),
    Case(
        "network gateway by service vip: its service's SANs too",
        "10.96.6.3:80",
        Want(
            Protocol.DOUBLE_HBONE,
            ("10.10.0.1", 15008),
            "global-by-vip.example:80",
            (EASTWEST_ID, f"{TD}/istio-system/sa/eastwest-svc"),
            final=(REMOTE_ID,),
        ),
    ),
    Case(
        "remote endpoint without address or gateway", "10.96.6.4:80", no("no healthy upstream: 10.96.6.4:80")
    ),
    Case(
        "remote endpoint with an address but no gateway",
        "10.96.6.5:80",
        no("no network gateway for workload c//Pod/demo/remote-ip in network 'net2'"),
    ),
    Case(
        "waypoint in another network: double HBONE to the waypoint service's SANs",
        "10.96.6.6:80",
        Want(
            Protocol.DOUBLE_HBONE,
            ("10.10.0.1", 15008),
            "global-wp.example:80",
            (EASTWEST_ID,),
            "c//Pod/demo/remote-waypoint",
            waypoint=True,
            final=(f"{TD}/demo/sa/remote-waypoint-svc",),
        ),
    ),
    # hostnames resolved by DNS
    Case("tcp endpoint known by hostname", "10.96.8.1:80", tcp("backend.example.com", 8080)),
    Case(
        "hbone endpoint known by hostname",
        "10.96.8.2:80",
        Want(Protocol.HBONE, ("hbone.example.com", 15008), "hbone.example.com:8080"),
    ),
    Case(
        "endpoint with neither address nor hostname", "10.96.8.3:80", no("no healthy upstream: 10.96.8.3:80")
    ),
]


def _hop(hop: tuple[object, int]) -> tuple[str, int]:
    return (str(hop[0]), hop[1])


def test_the_table_is_large_enough() -> None:
    assert len(CASES) >= 40


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_route(state: ProxyState, case: Case) -> None:
    source = state.workload_by_uid(case.source)
    assert source is not None
    got = route(
        state,
        source,
        addr(case.dst),
        rng=random.Random(1),
        source_ip=IP(case.source_ip) if case.source_ip else None,
    )
    want = case.want
    if isinstance(want, NoRoute):
        assert got == want
        return
    assert isinstance(got, Route), got
    assert (got.protocol, _hop(got.next_hop), got.authority, got.waypoint) == (
        want.protocol,
        want.next_hop,
        want.authority,
        want.waypoint,
    )
    if want.ids is not None:
        assert got.expected_identities == want.ids
    if want.uid is not None:
        assert got.workload is not None and got.workload.uid == want.uid
    if want.final is not None:
        assert got.final_identities == want.final
        assert got.inner_authority == got.authority  # outer and inner name the same service:port


def test_route_names_the_addressed_service(state: ProxyState) -> None:
    client = state.workload_by_uid(CLIENT)
    assert client is not None
    for dst, hostname in (
        ("10.96.0.1:80", "web.demo.svc.cluster.local"),
        ("10.96.3.1:80", "wp-by-addr.example"),
    ):
        got = route(state, client, addr(dst), rng=random.Random(1))
        assert isinstance(got, Route) and got.service is not None
        assert got.service.hostname == hostname
    direct = route(state, client, addr("10.0.0.2:8080"), rng=random.Random(1))
    assert isinstance(direct, Route) and direct.service is None


def test_dns_route_is_completed_with_the_resolved_address(state: ProxyState) -> None:
    client = state.workload_by_uid(CLIENT)
    assert client is not None
    r = route(state, client, addr("10.96.8.2:80"), rng=random.Random(1))
    assert isinstance(r, Route) and r.needs_dns
    done = r.resolved(IP("192.0.2.10"))
    assert not done.needs_dns
    assert (_hop(done.next_hop), done.authority) == (("192.0.2.10", 15008), "192.0.2.10:8080")
    tcp_route = route(state, client, addr("10.96.8.1:80"), rng=random.Random(1))
    assert isinstance(tcp_route, Route)
    assert _hop(tcp_route.resolved(IP("2001:db8::1")).next_hop) == ("2001:db8::1", 8080)


def test_dns_answer_prefers_the_dialled_family() -> None:
    answers = [IP("2001:db8::1"), IP("192.0.2.1"), IP("192.0.2.2")]
    rng = random.Random(3)
    assert {pick_resolved(answers, 4, rng) for _ in range(50)} == {IP("192.0.2.1"), IP("192.0.2.2")}
    assert pick_resolved(answers, 6, rng) == IP("2001:db8::1")
    assert pick_resolved([IP("192.0.2.1")], 6, rng) == IP("192.0.2.1")
    assert pick_resolved([], 4, rng) is None
