"""Routing, first cut (SPEC §3.2): a table of (state, destination) -> route or the reason there is none."""

from __future__ import annotations

import ipaddress
import random

import pytest

from xds.localconfig import parse_local_config
from ztunnel.route import NoRoute, Protocol, Route, route
from ztunnel.state import ProxyState

CONFIG = """
workloads:
  - uid: c//Pod/demo/client
    name: client
    namespace: demo
    serviceAccount: client
    trustDomain: cluster.local
    workloadIps: ["10.0.0.1"]
    protocol: HBONE
  - uid: c//Pod/demo/mesh-a
    name: mesh-a
    namespace: demo
    serviceAccount: mesh
    trustDomain: cluster.local
    workloadIps: ["10.0.0.2"]
    protocol: HBONE
    services:
      "demo/web.demo.svc.cluster.local": {80: 8080}
  - uid: c//Pod/demo/plain
    name: plain
    namespace: demo
    serviceAccount: plain
    trustDomain: cluster.local
    workloadIps: ["10.0.0.3"]
    protocol: TCP
    services:
      "demo/legacy.demo.svc.cluster.local": {80: 9090}
  - uid: c//Pod/demo/sick
    name: sick
    namespace: demo
    workloadIps: ["10.0.0.4"]
    protocol: HBONE
    status: Unhealthy
    services:
      "demo/sick.demo.svc.cluster.local": {80: 8080}
services:
  - name: web
    namespace: demo
    hostname: web.demo.svc.cluster.local
    vips: ["/10.96.0.1"]
    ports: {80: 8080}
    subjectAltNames: ["spiffe://cluster.local/ns/demo/sa/web-extra"]
  - name: legacy
    namespace: demo
    hostname: legacy.demo.svc.cluster.local
    vips: ["/10.96.0.2"]
    ports: {80: 9090}
  - name: sick
    namespace: demo
    hostname: sick.demo.svc.cluster.local
    vips: ["/10.96.0.3"]
    ports: {80: 8080}
  - name: passthrough
    namespace: demo
    hostname: pt.demo.svc.cluster.local
    vips: ["/10.96.0.4"]
    ports: {80: 8080}
    loadBalancer: {mode: Passthrough}
"""

IP = ipaddress.ip_address


@pytest.fixture(scope="module")
def state() -> ProxyState:
    s = ProxyState()
    s.apply_local_config(parse_local_config(CONFIG))
    return s


CASES: list[tuple[str, str, int, Route | NoRoute]] = [
    (
        "hbone workload by ip",
        "10.0.0.2",
        8080,
        Route(
            Protocol.HBONE,
            (IP("10.0.0.2"), 15008),
            "10.0.0.2:8080",
            ("spiffe://cluster.local/ns/demo/sa/mesh",),
        ),
    ),
    ("tcp workload by ip", "10.0.0.3", 9090, Route(Protocol.TCP, (IP("10.0.0.3"), 9090))),
    ("unknown ip passes through", "192.0.2.7", 443, Route(Protocol.TCP, (IP("192.0.2.7"), 443))),
    (
        "service vip to hbone endpoint, port translated, service SANs first",
        "10.96.0.1",
        80,
        Route(
            Protocol.HBONE,
            (IP("10.0.0.2"), 15008),
            "10.0.0.2:8080",
            ("spiffe://cluster.local/ns/demo/sa/web-extra", "spiffe://cluster.local/ns/demo/sa/mesh"),
        ),
    ),
    ("service vip to tcp endpoint", "10.96.0.2", 80, Route(Protocol.TCP, (IP("10.0.0.3"), 9090))),
    ("service port not listed", "10.96.0.1", 81, NoRoute("no healthy upstream: 10.96.0.1:81")),
    ("only unhealthy endpoints", "10.96.0.3", 80, NoRoute("no healthy upstream: 10.96.0.3:80")),
    (
        "passthrough service keeps the dialled address",
        "10.96.0.4",
        80,
        Route(Protocol.TCP, (IP("10.96.0.4"), 80)),
    ),
]


@pytest.mark.parametrize(("name", "ip", "port", "expected"), CASES, ids=[c[0] for c in CASES])
def test_route(state: ProxyState, name: str, ip: str, port: int, expected: Route | NoRoute) -> None:
    client = state.workload_by_uid("c//Pod/demo/client")
    assert client is not None
    got = route(state, client, (IP(ip), port), rng=random.Random(1))
    if isinstance(expected, NoRoute):
        assert got == expected
        return
    assert isinstance(got, Route)
    assert (got.protocol, got.next_hop, got.authority) == (
        expected.protocol,
        expected.next_hop,
        expected.authority,
    )
    if expected.expected_identities:
        assert got.expected_identities == expected.expected_identities
