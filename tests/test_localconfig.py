"""The local config read into the model: the reference's example, files, every key of a workload
and a service, and their defaults."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mesh.localconfig import (
    LocalConfig,
    LocalConfigError,
    load_local_config,
    parse_local_config,
)
from mesh.model import (
    ApplicationTunnel,
    AppTunnelProtocol,
    CidrVip,
    Endpoint,
    GatewayAddress,
    HealthPolicy,
    IPFamilies,
    LoadBalancer,
    LoadBalancingMode,
    LoadBalancingScope,
    Locality,
    NamespacedHostname,
    NetworkAddress,
    NetworkMode,
    Service,
    TunnelProtocol,
    Visibility,
    WeightedWaypoint,
    Workload,
    WorkloadStatus,
)
from policy.model import (
    Action,
    Authorization,
    Match,
    Scope,
    StringMatch,
    StringMatchKind,
)
from tests.localdocs import (
    SPEC_EXAMPLE,
    ip,
    net,
    parse,
)


def test_spec_example_loads() -> None:
    cfg = parse_local_config(SPEC_EXAMPLE, "config.yaml")
    client, server = cfg.workloads
    assert client == Workload(
        uid="lab//v1/Pod/demo/client",
        name="client",
        namespace="demo",
        service_account="client-sa",
        trust_domain="cluster.local",
        addresses=(ip("127.0.0.1"),),
        tunnel_protocol=TunnelProtocol.HBONE,
        node="node-a",
    )
    assert server.services == (("demo/server.demo.svc.cluster.local", ((80, 8080),)),)
    assert cfg.services == (
        Service(
            name="server",
            namespace="demo",
            hostname="server.demo.svc.cluster.local",
            vips=(NetworkAddress("", ip("10.96.1.1")),),
            ports=((80, 8080),),
        ),
    )
    only_client, block = cfg.policies
    assert only_client == Authorization(
        name="only-client",
        namespace="demo",
        scope=Scope.NAMESPACE,
        action=Action.ALLOW,
        rules=(
            (
                (
                    Match(
                        principals=(StringMatch(StringMatchKind.EXACT, "cluster.local/ns/demo/sa/client-sa"),)
                    ),
                ),
            ),
        ),
    )
    assert block.action is Action.DENY
    assert block.rules == (((Match(destination_ports=(9999,)),),),)


def test_raw_document_is_kept_as_json() -> None:
    cfg = parse_local_config(SPEC_EXAMPLE)
    raw = json.loads(json.dumps(cfg.raw))
    assert raw["policies"][0]["rules"] == [
        [[{"principals": [{"Exact": "cluster.local/ns/demo/sa/client-sa"}]}]]
    ]
    assert raw["workloads"][0]["workloadIps"] == ["127.0.0.1"]


def test_raw_is_not_part_of_equality() -> None:
    assert parse_local_config("workloads: []") == parse_local_config("{}")


def test_load_from_file(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(SPEC_EXAMPLE)
    assert load_local_config(path) == parse_local_config(SPEC_EXAMPLE)


def test_unreadable_file_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "missing.yaml"
    with pytest.raises(LocalConfigError, match=f"^{missing}: cannot read: "):
        load_local_config(missing)


def test_file_errors_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("policies: 3\n")
    with pytest.raises(LocalConfigError) as info:
        load_local_config(path)
    assert str(info.value) == f"{path}: policies: expected a list, got the number 3"


@pytest.mark.parametrize("text", ["", "# nothing\n", "workloads:\nservices:\npolicies:\n"])
def test_empty_document_is_empty_config(text: str) -> None:
    assert parse_local_config(text) == LocalConfig()


def test_unknown_keys_in_workload_entries_are_ignored() -> None:
    cfg = parse(
        """
        workloads:
          - namespace: x
            workloadIps: []
            addresses: [whatever]
            locality: {region: r, planet: earth}
            waypoint: {destination: ns/wp.example, color: blue}
        """
    )
    assert cfg.workloads[0].locality == Locality(region="r")
    assert cfg.workloads[0].waypoint == GatewayAddress(NamespacedHostname("ns", "wp.example"))


def test_workload_defaults_are_not_the_xds_ones() -> None:
    (w,) = parse("workloads: [{namespace: ns, workloadIps: [10.0.0.1]}]").workloads
    assert w == Workload(uid="", namespace="ns", addresses=(ip("10.0.0.1"),))
    assert w.trust_domain == "" and w.service_account == "" and w.cluster_id == ""
    assert w.identity_uri == "spiffe:///ns/ns/sa/"
    assert w.capacity == 1
    assert w.tunnel_protocol is TunnelProtocol.NONE


def test_every_workload_key() -> None:
    (w,) = parse(
        """
        workloads:
          - uid: c//v1/Pod/ns/w
            name: w
            namespace: ns
            serviceAccount: sa
            trustDomain: td
            network: net1
            node: n1
            hostname: w.example
            workloadIps: ["10.0.0.1", "fd00::1"]
            protocol: HBONE
            networkMode: HostNetwork
            status: Unhealthy
            clusterId: c
            workloadName: w-deploy
            workloadType: Deployment
            canonicalName: app
            canonicalRevision: 1
            nativeTunnel: true
            applicationTunnel: {protocol: PROXY, port: 15088}
            waypoint: {destination: net1/10.0.0.9, hboneMtlsPort: 15009}
            networkGateway: {destination: "net2/fd00::9"}
            authorizationPolicies: [ns/p1, istio-system/strict]
            locality: {region: r, zone: z, subzone: s}
            capacity: 3
            services:
              ns/svc.example: {80: 8080, 443: 8443}
        """
    ).workloads
    assert w == Workload(
        uid="c//v1/Pod/ns/w",
        name="w",
        namespace="ns",
        addresses=(ip("10.0.0.1"), ip("fd00::1")),
        hostname="w.example",
        network="net1",
        tunnel_protocol=TunnelProtocol.HBONE,
        trust_domain="td",
        service_account="sa",
        waypoint=GatewayAddress(NetworkAddress("net1", ip("10.0.0.9")), 15009),
        network_gateway=GatewayAddress(NetworkAddress("net2", ip("fd00::9")), 15008),
        node="n1",
        canonical_name="app",
        canonical_revision="1",
        workload_type="Deployment",
        workload_name="w-deploy",
        native_tunnel=True,
        application_tunnel=ApplicationTunnel(AppTunnelProtocol.PROXY, 15088),
        services=(("ns/svc.example", ((80, 8080), (443, 8443))),),
        authorization_policies=("ns/p1", "istio-system/strict"),
        status=WorkloadStatus.UNHEALTHY,
        cluster_id="c",
        locality=Locality("r", "z", "s"),
        network_mode=NetworkMode.HOST_NETWORK,
        capacity=3,
    )


def test_application_tunnel_defaults() -> None:
    (w,) = parse(
        "workloads: [{namespace: x, workloadIps: [], applicationTunnel: {protocol: PROXY}}]"
    ).workloads
    assert w.application_tunnel == ApplicationTunnel(AppTunnelProtocol.PROXY, None)
    (w,) = parse("workloads: [{namespace: x, workloadIps: [], applicationTunnel: {port: 0}}]").workloads
    assert w.application_tunnel == ApplicationTunnel(AppTunnelProtocol.NONE, None)


def test_every_service_key() -> None:
    (s,) = parse(
        """
        services:
          - name: svc
            namespace: ns
            hostname: svc.example
            vips: ["/10.96.0.1", "net1/fd00::10"]
            cidrVips: [{network: net1, cidr: 10.97.0.0/16}, {cidr: 10.98.0.1}]
            ports: {80: 8080, 443: 0}
            endpoints:
              uid-1: {workloadUid: uid-1, port: {80: 9090}, status: Unhealthy}
              uid-2: {}
            subjectAltNames: [spiffe://td/ns/ns/sa/svc]
            waypoint: {destination: ns/waypoint.example}
            weightedWaypoints:
              - {destination: {destination: ns/wp-a.example}, weight: 3}
              - destination: {destination: /10.0.0.5, hboneMtlsPort: 15009}
            loadBalancer: {routingPreferences: [Network, Zone], mode: Failover, healthPolicy: AllowAll}
            ipFamilies: Dual
            canonical: true
            visibility: Namespace
        """
    ).services
    assert s == Service(
        name="svc",
        namespace="ns",
        hostname="svc.example",
        vips=(NetworkAddress("", ip("10.96.0.1")), NetworkAddress("net1", ip("fd00::10"))),
        cidr_vips=(CidrVip("net1", net("10.97.0.0/16")), CidrVip("", net("10.98.0.1/32"))),
        ports=((80, 8080), (443, 0)),
        subject_alt_names=("spiffe://td/ns/ns/sa/svc",),
        waypoint=GatewayAddress(NamespacedHostname("ns", "waypoint.example")),
        weighted_waypoints=(
            WeightedWaypoint(GatewayAddress(NamespacedHostname("ns", "wp-a.example")), 3),
            WeightedWaypoint(GatewayAddress(NetworkAddress("", ip("10.0.0.5")), 15009), 1),
        ),
        load_balancer=LoadBalancer(
            (LoadBalancingScope.NETWORK, LoadBalancingScope.ZONE),
            LoadBalancingMode.FAILOVER,
            HealthPolicy.ALLOW_ALL,
        ),
        ip_families=IPFamilies.DUAL,
        canonical=True,
        visibility=Visibility.NAMESPACE,
        endpoints=(
            Endpoint("uid-1", ((80, 9090),), WorkloadStatus.UNHEALTHY),
            Endpoint("uid-2", (), WorkloadStatus.HEALTHY),
        ),
    )


@pytest.mark.parametrize(
    ("load_balancer", "expected"),
    [
        ("{}", LoadBalancer()),
        ("{mode: Strict}", LoadBalancer(mode=LoadBalancingMode.STRICT)),
        ("{healthPolicy: AllowAll}", LoadBalancer(health_policy=HealthPolicy.ALLOW_ALL)),
        ("{routingPreferences: [Node]}", LoadBalancer(routing_preferences=(LoadBalancingScope.NODE,))),
    ],
)
def test_load_balancer_keys_left_out_take_defaults(load_balancer: str, expected: LoadBalancer) -> None:
    cfg = parse(
        f"services: [{{name: s, namespace: n, hostname: h, vips: [], ports: {{}}, loadBalancer: {load_balancer}}}]"
    )
    assert cfg.services[0].load_balancer == expected
