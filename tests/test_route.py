"""Routing: a table of (source, destination) -> route or the reason there is none,
plus the inbound questions (`is_waypoint_for`, `hostname_target`) and the statistics of weighted
choices (capacity, weighted waypoints) under a fixed seed."""

from __future__ import annotations

import collections
import ipaddress
import random
from dataclasses import dataclass

import pytest

from xds.localconfig import parse_local_config
from ztunnel.route import (
    NoRoute,
    Protocol,
    Route,
    hostname_target,
    is_waypoint_for,
    locality_rank,
    pick_resolved,
    route,
)
from ztunnel.state import ProxyState

TD = "spiffe://cluster.local/ns"

CONFIG = """
workloads:
  # --- sources ---------------------------------------------------------------------------------
  - uid: c//Pod/demo/client
    name: client
    namespace: demo
    serviceAccount: client
    trustDomain: cluster.local
    workloadIps: ["10.0.0.1"]
    protocol: HBONE
    node: n1
    clusterId: c1
    locality: {region: r1, zone: z1, subzone: s1}
  - uid: c//Pod/private/client
    name: private-client
    namespace: private
    serviceAccount: client
    trustDomain: cluster.local
    workloadIps: ["10.0.0.9"]
    protocol: HBONE
  - uid: c//Pod/demo/client-with-waypoint
    name: client-with-waypoint
    namespace: demo
    serviceAccount: client
    trustDomain: cluster.local
    workloadIps: ["10.0.0.8"]
    protocol: HBONE
    waypoint: {destination: "/10.0.9.1"}
  # --- plain destinations ------------------------------------------------------------------------
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
    serviceAccount: sick
    trustDomain: cluster.local
    workloadIps: ["10.0.0.4"]
    protocol: HBONE
    status: Unhealthy
    services:
      "demo/sick.demo.svc.cluster.local": {80: 8080}
      "demo/allow-all.demo.svc.cluster.local": {80: 8080}
  - uid: c//Pod/demo/hostnet
    name: hostnet
    namespace: demo
    serviceAccount: hostnet
    trustDomain: cluster.local
    workloadIps: ["10.0.8.1"]
    protocol: HBONE
    networkMode: HostNetwork
  - uid: c//v1/WorkloadEntry/demo/entry
    name: entry
    namespace: demo
    serviceAccount: entry
    trustDomain: cluster.local
    workloadIps: ["10.0.8.2"]
    protocol: TCP
  - uid: c//Pod/demo/pod-on-entry-ip
    name: pod-on-entry-ip
    namespace: demo
    serviceAccount: pod
    trustDomain: cluster.local
    workloadIps: ["10.0.8.2"]
    protocol: HBONE
  - uid: c//Pod/demo/dual
    name: dual
    namespace: demo
    serviceAccount: dual
    trustDomain: cluster.local
    workloadIps: ["10.0.7.1", "fd00::7:1"]
    protocol: HBONE
    services:
      "demo/v6only.demo.svc.cluster.local": {80: 8080}
      "demo/v4only.demo.svc.cluster.local": {80: 8080}
  # --- services sharing a VIP, CIDR VIPs, visibility ------------------------------------------------
  - {uid: c//Pod/other/a, name: other-a, namespace: other, serviceAccount: a, trustDomain: cluster.local,
     workloadIps: ["10.0.1.1"], protocol: HBONE, services: {"other/shared.example": {80: 8080}}}
  - {uid: c//Pod/demo/b, name: demo-b, namespace: demo, serviceAccount: b, trustDomain: cluster.local,
     workloadIps: ["10.0.1.2"], protocol: HBONE, services: {"demo/shared.example": {80: 8080}}}
  - {uid: c//Pod/x/a, name: x-a, namespace: x, serviceAccount: a, trustDomain: cluster.local,
     workloadIps: ["10.0.1.3"], protocol: HBONE, services: {"x/canon.example": {80: 8080}}}
  - {uid: c//Pod/y/a, name: y-a, namespace: y, serviceAccount: a, trustDomain: cluster.local,
     workloadIps: ["10.0.1.4"], protocol: HBONE, services: {"y/canon.example": {80: 8080}}}
  - {uid: c//Pod/private/a, name: private-a, namespace: private, serviceAccount: a,
     trustDomain: cluster.local, workloadIps: ["10.0.1.5"], protocol: HBONE,
     services: {"private/secret.private.svc.cluster.local": {80: 8080}}}
  - {uid: c//Pod/demo/wide, name: wide, namespace: demo, serviceAccount: wide, trustDomain: cluster.local,
     workloadIps: ["10.0.2.1"], protocol: HBONE, services: {"demo/wide.example": {80: 8080}}}
  - {uid: c//Pod/demo/narrow, name: narrow, namespace: demo, serviceAccount: narrow,
     trustDomain: cluster.local, workloadIps: ["10.0.2.2"], protocol: HBONE,
     services: {"demo/narrow.example": {80: 8080}}}
  - {uid: c//Pod/demo/exact, name: exact, namespace: demo, serviceAccount: exact, trustDomain: cluster.local,
     workloadIps: ["10.0.2.3"], protocol: HBONE, services: {"demo/exact.example": {80: 8080}}}
  # --- ports and health ------------------------------------------------------------------------------
  - {uid: c//Pod/demo/named-a, name: named-a, namespace: demo, serviceAccount: named,
     trustDomain: cluster.local, workloadIps: ["10.0.3.1"], protocol: HBONE,
     services: {"demo/named.example": {80: 9001}, "demo/override.example": {80: 7070}}}
  - {uid: c//Pod/demo/named-b, name: named-b, namespace: demo, serviceAccount: named,
     trustDomain: cluster.local, workloadIps: ["10.0.3.2"], protocol: HBONE,
     services: {"demo/named.example": {}, "demo/unnamed.example": {}}}
  - {uid: c//Pod/demo/zero, name: zero, namespace: demo, serviceAccount: zero, trustDomain: cluster.local,
     workloadIps: ["10.0.3.3"], protocol: HBONE, capacity: 0, services: {"demo/capacity.example": {80: 8080}}}
  - {uid: c//Pod/demo/one, name: one, namespace: demo, serviceAccount: one, trustDomain: cluster.local,
     workloadIps: ["10.0.3.4"], protocol: HBONE, services: {"demo/capacity.example": {80: 8080}}}
  # --- locality ---------------------------------------------------------------------------------------
  - {uid: c//Pod/demo/far, name: far, namespace: demo, serviceAccount: lb, trustDomain: cluster.local,
     workloadIps: ["10.0.5.1"], protocol: HBONE, node: n9, clusterId: c1,
     locality: {region: r2, zone: z1, subzone: s1},
     services: {"demo/strict.example": {80: 8080}, "demo/failover.example": {80: 8080},
                "demo/faraway.example": {80: 8080}, "demo/netfirst.example": {80: 8080}}}
  - {uid: c//Pod/demo/near, name: near, namespace: demo, serviceAccount: lb, trustDomain: cluster.local,
     workloadIps: ["10.0.5.2"], protocol: HBONE, node: n2, clusterId: c1,
     locality: {region: r1, zone: z1, subzone: s2},
     services: {"demo/strict.example": {80: 8080}, "demo/failover.example": {80: 8080},
                "demo/strict-node.example": {80: 8080}}}
  - {uid: c//Pod/demo/same-region, name: same-region, namespace: demo, serviceAccount: lb,
     trustDomain: cluster.local, workloadIps: ["10.0.5.3"], protocol: HBONE, node: n3, clusterId: c1,
     locality: {region: r1, zone: z2, subzone: s1},
     services: {"demo/failover.example": {80: 8080}}}
  - {uid: c//Pod/demo/remote-same-region, name: remote-same-region, namespace: demo, serviceAccount: lb,
     trustDomain: cluster.local, workloadIps: [], network: net2, locality: {region: r1},
     networkGateway: {destination: "net2/10.10.0.1"}, protocol: HBONE,
     services: {"demo/netfirst.example": {80: 8080}, "demo/netfirst-remote.example": {80: 8080}}}
  - {uid: c//Pod/demo/remote-other-region, name: remote-other-region, namespace: demo, serviceAccount: lb,
     trustDomain: cluster.local, workloadIps: [], network: net2, locality: {region: r2},
     networkGateway: {destination: "net2/10.10.0.1"}, protocol: HBONE,
     services: {"demo/netfirst-remote.example": {80: 8080}}}
  # --- waypoints ---------------------------------------------------------------------------------------
  - {uid: c//Pod/demo/waypoint, name: waypoint, namespace: demo, serviceAccount: waypoint,
     trustDomain: cluster.local, workloadIps: ["10.0.9.1"], protocol: HBONE,
     services: {"demo/waypoint.demo.svc.cluster.local": {15008: 15008}}}
  - {uid: c//Pod/demo/waypoint2, name: waypoint2, namespace: demo, serviceAccount: waypoint2,
     hostname: wp2.example, trustDomain: cluster.local, workloadIps: ["10.0.9.2"], protocol: HBONE}
  - {uid: c//Pod/demo/guarded, name: guarded, namespace: demo, serviceAccount: guarded,
     trustDomain: cluster.local, workloadIps: ["10.0.4.1"], protocol: HBONE,
     waypoint: {destination: "/10.0.9.1"}, services: {"demo/guarded.example": {80: 8080}}}
  - {uid: c//Pod/demo/guarded-tcp, name: guarded-tcp, namespace: demo, serviceAccount: guarded,
     trustDomain: cluster.local, workloadIps: ["10.0.4.2"], protocol: TCP,
     waypoint: {destination: "demo/waypoint.demo.svc.cluster.local"}}
  - {uid: c//Pod/demo/svc-backend, name: svc-backend, namespace: demo, serviceAccount: backend,
     trustDomain: cluster.local, workloadIps: ["10.0.4.3"], protocol: HBONE,
     services: {"demo/wp-by-addr.example": {80: 8080}, "demo/wp-by-vip.example": {80: 8080},
                "demo/wp-by-host.example": {80: 8080}, "demo/wp-by-workload-host.example": {80: 8080},
                "demo/wp-port.example": {80: 8080}, "demo/wp-unknown.example": {80: 8080},
                "demo/wp-weighted.example": {80: 8080}, "demo/wp-zero.example": {80: 8080}}}
  # --- other networks ------------------------------------------------------------------------------
  - {uid: c//Pod/istio-system/eastwest, name: eastwest, namespace: istio-system, serviceAccount: eastwest,
     hostname: eastwest.example, trustDomain: cluster.local, workloadIps: ["10.10.0.1"], network: net2,
     protocol: HBONE, services: {"istio-system/eastwest.istio-system.svc.cluster.local": {15008: 15008}}}
  - {uid: c//Pod/demo/remote-a, name: remote-a, namespace: demo, serviceAccount: remote,
     trustDomain: cluster.local, workloadIps: [], network: net2, protocol: HBONE,
     networkGateway: {destination: "net2/10.10.0.1"}, services: {"demo/global.example": {80: 8080}}}
  - {uid: c//Pod/demo/remote-b, name: remote-b, namespace: demo, serviceAccount: remote,
     trustDomain: cluster.local, workloadIps: [], network: net2, protocol: HBONE,
     networkGateway: {destination: "istio-system/eastwest.example"},
     services: {"demo/global-by-host.example": {80: 8080}}}
  - {uid: c//Pod/demo/remote-c, name: remote-c, namespace: demo, serviceAccount: remote,
     trustDomain: cluster.local, workloadIps: [], network: net2, protocol: HBONE,
     networkGateway: {destination: "net2/10.10.0.100", hboneMtlsPort: 15443},
     services: {"demo/global-by-vip.example": {80: 8080}}}
  - {uid: c//Pod/demo/remote-lost, name: remote-lost, namespace: demo, serviceAccount: remote,
     trustDomain: cluster.local, workloadIps: [], network: net2, protocol: HBONE,
     services: {"demo/global-lost.example": {80: 8080}}}
  - {uid: c//Pod/demo/remote-ip, name: remote-ip, namespace: demo, serviceAccount: remote,
     trustDomain: cluster.local, workloadIps: ["10.10.1.5"], network: net2, protocol: HBONE,
     services: {"demo/global-no-gateway.example": {80: 8080}}}
  - {uid: c//Pod/demo/remote-waypoint, name: remote-waypoint, namespace: demo, serviceAccount: waypoint,
     trustDomain: cluster.local, workloadIps: [], network: net2, protocol: HBONE,
     networkGateway: {destination: "net2/10.10.0.1"},
     services: {"demo/remote-waypoint.demo.svc.cluster.local": {15008: 15008}}}
  # --- hostnames resolved by DNS -----------------------------------------------------------------------
  - {uid: c//v1/WorkloadEntry/demo/by-name, name: by-name, namespace: demo, serviceAccount: ext,
     hostname: backend.example.com, trustDomain: cluster.local, workloadIps: [], protocol: TCP,
     services: {"demo/by-name.example": {80: 8080}}}
  - {uid: c//v1/WorkloadEntry/demo/by-name-hbone, name: by-name-hbone, namespace: demo, serviceAccount: ext,
     hostname: hbone.example.com, trustDomain: cluster.local, workloadIps: [], protocol: HBONE,
     services: {"demo/by-name-hbone.example": {80: 8080}}}
  - {uid: c//v1/WorkloadEntry/demo/nowhere, name: nowhere, namespace: demo, serviceAccount: ext,
     trustDomain: cluster.local, workloadIps: [], protocol: TCP,
     services: {"demo/nowhere.example": {80: 8080}}}
services:
  - name: web
    namespace: demo
    hostname: web.demo.svc.cluster.local
    vips: ["/10.96.0.1"]
    ports: {80: 8080}
    subjectAltNames: ["spiffe://cluster.local/ns/demo/sa/web-extra"]
  - {name: legacy, namespace: demo, hostname: legacy.demo.svc.cluster.local, vips: ["/10.96.0.2"],
     ports: {80: 9090}}
  - {name: sick, namespace: demo, hostname: sick.demo.svc.cluster.local, vips: ["/10.96.0.3"],
     ports: {80: 8080}}
  - {name: passthrough, namespace: demo, hostname: pt.demo.svc.cluster.local, vips: ["/10.96.0.4"],
     ports: {80: 8080}, loadBalancer: {mode: Passthrough}}
  - {name: allow-all, namespace: demo, hostname: allow-all.demo.svc.cluster.local, vips: ["/10.96.0.5"],
     ports: {80: 8080}, loadBalancer: {healthPolicy: AllowAll}}
  - {name: pt-waypoint, namespace: demo, hostname: pt-waypoint.example, vips: ["/10.96.0.6"],
     ports: {80: 8080}, loadBalancer: {mode: Passthrough}, waypoint: {destination: "/10.0.9.1"}}
  - {name: v6only, namespace: demo, hostname: v6only.demo.svc.cluster.local, vips: ["/10.96.7.1"],
     ports: {80: 8080}, ipFamilies: IPv6}
  - {name: v4only, namespace: demo, hostname: v4only.demo.svc.cluster.local, vips: ["/fd00::96:7:2"],
     ports: {80: 8080}, ipFamilies: IPv4}
  # several services on one VIP: the client's namespace first, then a canonical one
  - {name: shared, namespace: other, hostname: shared.example, vips: ["/10.96.1.1"], ports: {80: 8080}}
  - {name: shared, namespace: demo, hostname: shared.example, vips: ["/10.96.1.1"], ports: {80: 8080}}
  - {name: canon, namespace: x, hostname: canon.example, vips: ["/10.96.1.2"], ports: {80: 8080}}
  - {name: canon, namespace: y, hostname: canon.example, vips: ["/10.96.1.2"], ports: {80: 8080},
     canonical: true}
  - {name: secret, namespace: private, hostname: secret.private.svc.cluster.local, vips: ["/10.96.1.3"],
     ports: {80: 8080}, visibility: Namespace}
  - {name: wide, namespace: demo, hostname: wide.example, vips: [], ports: {80: 8080},
     cidrVips: [{cidr: 10.200.0.0/16}]}
  - {name: narrow, namespace: demo, hostname: narrow.example, vips: [], ports: {80: 8080},
     cidrVips: [{cidr: 10.200.5.0/24}]}
  - {name: exact, namespace: demo, hostname: exact.example, vips: ["/10.200.5.5"], ports: {80: 8080}}
  # ports and capacity
  - {name: named, namespace: demo, hostname: named.example, vips: ["/10.96.2.1"], ports: {80: 0}}
  - {name: unnamed, namespace: demo, hostname: unnamed.example, vips: ["/10.96.2.2"], ports: {80: 0}}
  - {name: override, namespace: demo, hostname: override.example, vips: ["/10.96.2.3"], ports: {80: 8080}}
  - {name: capacity, namespace: demo, hostname: capacity.example, vips: ["/10.96.2.4"], ports: {80: 8080}}
  # locality
  - {name: strict, namespace: demo, hostname: strict.example, vips: ["/10.96.5.1"], ports: {80: 8080},
     loadBalancer: {mode: Strict, routingPreferences: [Region, Zone]}}
  - {name: strict-node, namespace: demo, hostname: strict-node.example, vips: ["/10.96.5.2"],
     ports: {80: 8080}, loadBalancer: {mode: Strict, routingPreferences: [Node]}}
  - {name: failover, namespace: demo, hostname: failover.example, vips: ["/10.96.5.3"], ports: {80: 8080},
     loadBalancer: {mode: Failover, routingPreferences: [Region, Zone, Subzone]}}
  - {name: faraway, namespace: demo, hostname: faraway.example, vips: ["/10.96.5.4"], ports: {80: 8080},
     loadBalancer: {mode: Failover, routingPreferences: [Region, Zone]}}
  - {name: netfirst, namespace: demo, hostname: netfirst.example, vips: ["/10.96.5.5"], ports: {80: 8080},
     subjectAltNames: ["spiffe://cluster.local/ns/demo/sa/lb"],
     loadBalancer: {mode: Failover, routingPreferences: [Network, Region]}}
  - {name: netfirst-remote, namespace: demo, hostname: netfirst-remote.example, vips: ["/10.96.5.6"],
     ports: {80: 8080}, subjectAltNames: ["spiffe://cluster.local/ns/demo/sa/lb"],
     loadBalancer: {mode: Failover, routingPreferences: [Network, Region]}}
  # waypoints
  - {name: waypoint, namespace: demo, hostname: waypoint.demo.svc.cluster.local, vips: ["/10.96.9.1"],
     ports: {15008: 15008}, subjectAltNames: ["spiffe://cluster.local/ns/demo/sa/waypoint-svc"]}
  - {name: wp-by-addr, namespace: demo, hostname: wp-by-addr.example, vips: ["/10.96.3.1"],
     ports: {80: 8080}, waypoint: {destination: "/10.0.9.1"}}
  - {name: wp-by-vip, namespace: demo, hostname: wp-by-vip.example, vips: ["/10.96.3.2"],
     ports: {80: 8080}, waypoint: {destination: "/10.96.9.1"}}
  - {name: wp-by-host, namespace: demo, hostname: wp-by-host.example, vips: ["/10.96.3.3"],
     ports: {80: 8080}, waypoint: {destination: "demo/waypoint.demo.svc.cluster.local"}}
  - {name: wp-by-workload-host, namespace: demo, hostname: wp-by-workload-host.example,
     vips: ["/10.96.3.4"], ports: {80: 8080}, waypoint: {destination: "demo/wp2.example"}}
  - {name: wp-port, namespace: demo, hostname: wp-port.example, vips: ["/10.96.3.5"],
     ports: {80: 8080}, waypoint: {destination: "/10.0.9.1", hboneMtlsPort: 15009}}
  - {name: wp-unknown, namespace: demo, hostname: wp-unknown.example, vips: ["/10.96.3.6"],
     ports: {80: 8080}, waypoint: {destination: "/10.0.9.99"}}
  - {name: wp-weighted, namespace: demo, hostname: wp-weighted.example, vips: ["/10.96.3.7"],
     ports: {80: 8080}, waypoint: {destination: "/10.0.9.1"},
     weightedWaypoints: [{destination: {destination: "/10.0.9.1"}, weight: 0},
                         {destination: {destination: "/10.0.9.2"}, weight: 5}]}
  - {name: wp-zero, namespace: demo, hostname: wp-zero.example, vips: ["/10.96.3.8"],
     ports: {80: 8080}, waypoint: {destination: "/10.0.9.1"},
     weightedWaypoints: [{destination: {destination: "/10.0.9.2"}, weight: 0}]}
  - {name: guarded, namespace: demo, hostname: guarded.example, vips: ["/10.96.4.1"], ports: {80: 8080}}
  # other networks
  - {name: eastwest, namespace: istio-system, hostname: eastwest.istio-system.svc.cluster.local,
     vips: ["net2/10.10.0.100"], ports: {15443: 15008},
     subjectAltNames: ["spiffe://cluster.local/ns/istio-system/sa/eastwest-svc"]}
  - {name: global, namespace: demo, hostname: global.example, vips: ["/10.96.6.1"], ports: {80: 8080},
     subjectAltNames: ["spiffe://cluster.local/ns/demo/sa/remote"]}
  - {name: global-by-host, namespace: demo, hostname: global-by-host.example, vips: ["/10.96.6.2"],
     ports: {80: 8080}, subjectAltNames: ["spiffe://cluster.local/ns/demo/sa/remote"]}
  - {name: global-by-vip, namespace: demo, hostname: global-by-vip.example, vips: ["/10.96.6.3"],
     ports: {80: 8080}, subjectAltNames: ["spiffe://cluster.local/ns/demo/sa/remote"]}
  - {name: global-lost, namespace: demo, hostname: global-lost.example, vips: ["/10.96.6.4"],
     ports: {80: 8080}}
  - {name: global-no-gateway, namespace: demo, hostname: global-no-gateway.example, vips: ["/10.96.6.5"],
     ports: {80: 8080}}
  - {name: remote-waypoint, namespace: demo, hostname: remote-waypoint.demo.svc.cluster.local, vips: [],
     ports: {15008: 15008}, subjectAltNames: ["spiffe://cluster.local/ns/demo/sa/remote-waypoint-svc"]}
  - {name: global-wp, namespace: demo, hostname: global-wp.example, vips: ["/10.96.6.6"], ports: {80: 8080},
     waypoint: {destination: "demo/remote-waypoint.demo.svc.cluster.local"}}
  # DNS
  - {name: by-name, namespace: demo, hostname: by-name.example, vips: ["/10.96.8.1"], ports: {80: 8080}}
  - {name: by-name-hbone, namespace: demo, hostname: by-name-hbone.example, vips: ["/10.96.8.2"],
     ports: {80: 8080}}
  - {name: nowhere, namespace: demo, hostname: nowhere.example, vips: ["/10.96.8.3"], ports: {80: 8080}}
"""

IP = ipaddress.ip_address
CLIENT = "c//Pod/demo/client"
WAYPOINT_ID = f"{TD}/demo/sa/waypoint"
WAYPOINT_SVC_ID = f"{TD}/demo/sa/waypoint-svc"
EASTWEST_ID = f"{TD}/istio-system/sa/eastwest"
REMOTE_ID = f"{TD}/demo/sa/remote"


@pytest.fixture(scope="module")
def state() -> ProxyState:
    s = ProxyState()
    s.apply_local_config(parse_local_config(CONFIG))
    return s


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


def _addr(text: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    host, _, port = text.rpartition(":")
    return IP(host.strip("[]")), int(port)


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
        _addr(case.dst),
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
        got = route(state, client, _addr(dst), rng=random.Random(1))
        assert isinstance(got, Route) and got.service is not None
        assert got.service.hostname == hostname
    direct = route(state, client, _addr("10.0.0.2:8080"), rng=random.Random(1))
    assert isinstance(direct, Route) and direct.service is None


def test_dns_route_is_completed_with_the_resolved_address(state: ProxyState) -> None:
    client = state.workload_by_uid(CLIENT)
    assert client is not None
    r = route(state, client, _addr("10.96.8.2:80"), rng=random.Random(1))
    assert isinstance(r, Route) and r.needs_dns
    done = r.resolved(IP("192.0.2.10"))
    assert not done.needs_dns
    assert (_hop(done.next_hop), done.authority) == (("192.0.2.10", 15008), "192.0.2.10:8080")
    tcp_route = route(state, client, _addr("10.96.8.1:80"), rng=random.Random(1))
    assert isinstance(tcp_route, Route)
    assert _hop(tcp_route.resolved(IP("2001:db8::1")).next_hop) == ("2001:db8::1", 8080)


def test_dns_answer_prefers_the_dialled_family() -> None:
    answers = [IP("2001:db8::1"), IP("192.0.2.1"), IP("192.0.2.2")]
    rng = random.Random(3)
    assert {pick_resolved(answers, 4, rng) for _ in range(50)} == {IP("192.0.2.1"), IP("192.0.2.2")}
    assert pick_resolved(answers, 6, rng) == IP("2001:db8::1")
    assert pick_resolved([IP("192.0.2.1")], 6, rng) == IP("192.0.2.1")
    assert pick_resolved([], 4, rng) is None


# --- locality rank -------------------------------------------------------------------------------


def test_network_first_rank_puts_every_same_network_endpoint_first(state: ProxyState) -> None:
    from xds.model import LoadBalancingScope as S
    from xds.model import Locality, Workload

    src = Workload("s", network="n1", locality=Locality("r1", "z1"))
    prefs = (S.NETWORK, S.REGION, S.ZONE)
    same_net_far = Workload("a", network="n1", locality=Locality("r9", "z9"))
    other_net_near = Workload("b", network="n2", locality=Locality("r1", "z1"))
    assert locality_rank(prefs, src, same_net_far) > locality_rank(prefs, src, other_net_near)
    assert locality_rank(prefs, src, other_net_near) == 2
    # Without NETWORK first a mismatch stops the count.
    assert locality_rank((S.REGION, S.NETWORK, S.ZONE), src, other_net_near) == 1


# --- the inbound questions --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("local_uid", "local_ip", "target", "expected"),
    [
        ("c//Pod/demo/waypoint", "10.0.9.1", "10.96.3.1", True),  # service waypoint by address
        ("c//Pod/demo/waypoint", "10.0.9.1", "10.96.3.2", True),  # by the waypoint's VIP
        ("c//Pod/demo/waypoint", "10.0.9.1", "10.96.3.3", True),  # by hostname
        ("c//Pod/demo/waypoint", "10.0.9.1", "10.0.4.1", True),  # workload waypoint
        ("c//Pod/demo/waypoint", "10.0.9.1", "10.96.3.7", True),  # one of weighted waypoints (weight 0)
        ("c//Pod/demo/waypoint2", "10.0.9.2", "10.96.3.7", True),
        ("c//Pod/demo/waypoint2", "10.0.9.2", "10.0.4.1", False),  # another workload's waypoint
        ("c//Pod/demo/waypoint", "10.0.9.1", "10.96.0.1", False),  # a service without waypoint
        ("c//Pod/demo/waypoint", "10.0.9.1", "10.0.0.2", False),  # a workload without waypoint
        ("c//Pod/demo/mesh-a", "10.0.0.2", "10.96.3.1", False),  # not the waypoint
        ("c//Pod/demo/waypoint", "10.0.9.1", "192.0.2.1", False),  # unknown address
    ],
)
def test_is_waypoint_for(
    state: ProxyState, local_uid: str, local_ip: str, target: str, expected: bool
) -> None:
    local = state.workload_by_uid(local_uid)
    assert local is not None
    assert is_waypoint_for(state, local, IP(local_ip), IP(target), "") is expected


def test_hostname_target(state: ProxyState) -> None:
    named = state.workload_by_uid("c//Pod/demo/named-a")
    plain = state.workload_by_uid("c//Pod/demo/mesh-a")
    assert named is not None and plain is not None
    found = hostname_target(state, named, "named.example", 80)
    assert found is not None and (found[0].name, found[1]) == ("named", 9001)  # our endpoint's mapping
    found = hostname_target(state, plain, "web.demo.svc.cluster.local", 80)
    assert found is not None and found[1] == 8080  # the service's target port
    assert hostname_target(state, plain, "web.demo.svc.cluster.local", 81) is None  # port not listed
    assert hostname_target(state, plain, "unnamed.example", 80) is None  # target port 0, no mapping
    assert hostname_target(state, plain, "nosuch.example", 80) is None


# --- weighted choices, statistically --------------------------------------------------------------

STATS = """
workloads:
  - {uid: c//Pod/demo/client, name: client, namespace: demo, serviceAccount: client,
     trustDomain: cluster.local, workloadIps: ["10.0.0.1"], protocol: HBONE}
  - {uid: c//Pod/demo/w1, name: w1, namespace: demo, serviceAccount: w, trustDomain: cluster.local,
     workloadIps: ["10.0.0.11"], protocol: HBONE, capacity: 1, services: {"demo/svc.example": {80: 8080}}}
  - {uid: c//Pod/demo/w2, name: w2, namespace: demo, serviceAccount: w, trustDomain: cluster.local,
     workloadIps: ["10.0.0.12"], protocol: HBONE, capacity: 2, services: {"demo/svc.example": {80: 8080}}}
  - {uid: c//Pod/demo/w7, name: w7, namespace: demo, serviceAccount: w, trustDomain: cluster.local,
     workloadIps: ["10.0.0.17"], protocol: HBONE, capacity: 7, services: {"demo/svc.example": {80: 8080}}}
  - {uid: c//Pod/demo/wp-a, name: wp-a, namespace: demo, serviceAccount: wp, trustDomain: cluster.local,
     workloadIps: ["10.0.9.1"], protocol: HBONE}
  - {uid: c//Pod/demo/wp-b, name: wp-b, namespace: demo, serviceAccount: wp, trustDomain: cluster.local,
     workloadIps: ["10.0.9.2"], protocol: HBONE}
  - {uid: c//Pod/demo/wp-c, name: wp-c, namespace: demo, serviceAccount: wp, trustDomain: cluster.local,
     workloadIps: ["10.0.9.3"], protocol: HBONE}
services:
  - {name: svc, namespace: demo, hostname: svc.example, vips: ["/10.96.0.1"], ports: {80: 8080}}
  - {name: split, namespace: demo, hostname: split.example, vips: ["/10.96.0.2"], ports: {80: 8080},
     weightedWaypoints: [{destination: {destination: "/10.0.9.1"}, weight: 1},
                         {destination: {destination: "/10.0.9.2"}, weight: 3},
                         {destination: {destination: "/10.0.9.3"}, weight: 0}]}
"""


def _shares(state: ProxyState, dst: str, n: int) -> dict[str, float]:
    client = state.workload_by_uid("c//Pod/demo/client")
    assert client is not None
    rng = random.Random(20240601)
    counts: collections.Counter[str] = collections.Counter()
    for _ in range(n):
        r = route(state, client, _addr(dst), rng=rng)
        assert isinstance(r, Route)
        counts[str(r.next_hop[0])] += 1
    return {ip: c / n for ip, c in counts.items()}


def test_capacity_weights_the_choice_of_endpoint() -> None:
    state = ProxyState()
    state.apply_local_config(parse_local_config(STATS))
    shares = _shares(state, "10.96.0.1:80", 10_000)
    # Capacities 1:2:7. With 10,000 draws one standard deviation is at most 0.005 (the seed is fixed).
    for ip, expected in (("10.0.0.11", 0.1), ("10.0.0.12", 0.2), ("10.0.0.17", 0.7)):
        assert shares[ip] == pytest.approx(expected, abs=0.02), shares


def test_capacity_0_is_never_chosen_over_many_draws(state: ProxyState) -> None:
    # The table's case is a single draw; over many, the endpoint of capacity 0 still never comes up.
    assert _shares(state, "10.96.2.4:80", 1000) == {"10.0.3.4": 1.0}


def test_weighted_waypoints_split_by_weight() -> None:
    state = ProxyState()
    state.apply_local_config(parse_local_config(STATS))
    shares = _shares(state, "10.96.0.2:80", 10_000)
    assert "10.0.9.3" not in shares  # weight 0: never
    assert shares["10.0.9.1"] == pytest.approx(0.25, abs=0.02), shares
    assert shares["10.0.9.2"] == pytest.approx(0.75, abs=0.02), shares


def test_workload_by_hostname_follows_updates_and_removal() -> None:
    from dataclasses import replace

    from xds.model import Workload

    state = ProxyState()
    w = Workload("u1", namespace="demo", hostname="wp.example")
    state.upsert_workload(w)
    assert state.workload_by_hostname("demo", "wp.example") == w
    assert state.workload_by_hostname("other", "wp.example") is None
    state.upsert_workload(replace(w, hostname="wp2.example"))
    assert state.workload_by_hostname("demo", "wp.example") is None
    assert state.workload_by_hostname("demo", "wp2.example") is not None
    state.remove("u1")
    assert state.workload_by_hostname("demo", "wp2.example") is None
