"""The mesh the routing tests route through (one local config), and their address helpers."""

from __future__ import annotations

import ipaddress

import pytest

from mesh.localconfig import parse_local_config
from ztunnel.state.store import ProxyState

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


@pytest.fixture(scope="module", name="state")
def state_fixture() -> ProxyState:
    s = ProxyState()
    s.apply_local_config(parse_local_config(CONFIG))
    return s


def addr(text: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    host, _, port = text.rpartition(":")
    return IP(host.strip("[]")), int(port)
