"""The local config file: the reference's format, our map form, and errors."""

from __future__ import annotations

import ipaddress
import json
import textwrap
from pathlib import Path

import pytest

from policy.model import (
    Action,
    Authorization,
    Match,
    Scope,
    ServiceAccountMatch,
    StringMatch,
    StringMatchKind,
)
from xds.localconfig import (
    LocalConfig,
    LocalConfigError,
    load_local_config,
    parse_local_config,
)
from xds.model import (
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
from xds.render import (
    policy_to_dict,
    service_to_dict,
    workload_to_dict,
)

SPEC_EXAMPLE = """\
workloads:
  - uid: lab//v1/Pod/demo/client
    name: client
    namespace: demo
    serviceAccount: client-sa
    trustDomain: cluster.local
    workloadIps: ["127.0.0.1"]
    protocol: HBONE
    node: node-a
  - uid: lab//v1/Pod/demo/server
    name: server
    namespace: demo
    serviceAccount: server-sa
    trustDomain: cluster.local
    workloadIps: ["127.0.0.2"]
    protocol: HBONE
    node: node-a
    services:
      "demo/server.demo.svc.cluster.local":
        80: 8080
services:
  - name: server
    namespace: demo
    hostname: server.demo.svc.cluster.local
    vips: ["/10.96.1.1"]
    ports:
      80: 8080
policies:
  - name: only-client
    namespace: demo
    scope: Namespace
    action: Allow
    dryRun: false
    rules:
      - - - principals: [!Exact "cluster.local/ns/demo/sa/client-sa"]
  - name: block-9999
    namespace: demo
    scope: Namespace
    action: Deny
    dryRun: false
    rules:
      - - - destinationPorts: [9999]
"""


def ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    return ipaddress.ip_address(text)


def net(text: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    return ipaddress.ip_network(text)


def parse(text: str) -> LocalConfig:
    return parse_local_config(textwrap.dedent(text), "config.yaml")


def error_of(text: str) -> str:
    with pytest.raises(LocalConfigError) as info:
        parse(text)
    return str(info.value)


def only_match(text: str) -> Match:
    """The single match entry of a policy whose match is `text` (YAML flow mapping)."""
    cfg = parse(
        f"""
        policies:
          - {{name: p, namespace: ns, scope: Global, action: Allow, dryRun: false, rules: [[[{text}]]]}}
        """
    )
    return cfg.policies[0].rules[0][0][0]


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


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("workloads: [", "config.yaml: line 1, column 13: invalid YAML: expected the node content"),
        ("a: 1\na: 2\n", "config.yaml: line 2, column 1: invalid YAML: duplicate key 'a'"),
        ("- 1\n", "config.yaml: expected a mapping with keys workloads, services, policies, got a list"),
        (
            "workload: []\n",
            "config.yaml: workload: unknown key (expected one of: workloads, services, policies)",
        ),
        ("workloads: {}\n", "config.yaml: workloads: expected a list, got a mapping"),
        # workloads
        ("workloads: [{workloadIps: []}]", "config.yaml: workloads[0].namespace: missing required key"),
        ("workloads: [{namespace: x}]", "config.yaml: workloads[0].workloadIps: missing required key"),
        (
            "workloads: [{namespace: x, workloadIps: []}, {namespace: x, workloadIps: [abc]}]",
            "config.yaml: workloads[1].workloadIps[0]: invalid IP address 'abc'",
        ),
        (
            "workloads: [{namespace: x, workloadIps: [1]}]",
            "config.yaml: workloads[0].workloadIps[0]: expected an IP address, got the number 1",
        ),
        (
            "workloads: [{namespace: x, workloadIps: [], protocol: UDP}]",
            "config.yaml: workloads[0].protocol: invalid value the string 'UDP' (expected one of: TCP, HBONE)",
        ),
        (
            "workloads: [{namespace: x, workloadIps: [], status: healthy}]",
            "config.yaml: workloads[0].status: invalid value the string 'healthy' (expected one of: Healthy, Unhealthy)",
        ),
        (
            "workloads: [{namespace: x, workloadIps: [], networkMode: Host}]",
            "config.yaml: workloads[0].networkMode: invalid value the string 'Host' (expected one of: Standard, HostNetwork)",
        ),
        (
            "workloads: [{namespace: x, workloadIps: [], services: {svc.example: {80: 8080}}}]",
            "config.yaml: workloads[0].services[\"svc.example\"]: invalid service key 'svc.example' "
            "(expected '<namespace>/<hostname>')",
        ),
        (
            "workloads: [{namespace: x, workloadIps: [], services: {ns/svc: {80: 70000}}}]",
            'config.yaml: workloads[0].services["ns/svc"][80]: invalid port 70000 (expected 0..65535)',
        ),
        (
            "workloads: [{namespace: x, workloadIps: [], applicationTunnel: {protocol: PROXY, port: -1}}]",
            "config.yaml: workloads[0].applicationTunnel.port: invalid port -1 (expected 0..65535)",
        ),
        (
            "workloads: [{namespace: x, workloadIps: [], waypoint: {destination: nowhere}}]",
            "config.yaml: workloads[0].waypoint.destination: invalid destination 'nowhere' "
            "(expected '<network>/<ip>' or '<namespace>/<hostname>')",
        ),
        (
            "workloads: [{namespace: x, workloadIps: [], waypoint: {hboneMtlsPort: 15008}}]",
            "config.yaml: workloads[0].waypoint.destination: missing required key",
        ),
        (
            "workloads: [{namespace: x, workloadIps: [], nativeTunnel: yes}]",
            "config.yaml: workloads[0].nativeTunnel: expected true or false, got the string 'yes'",
        ),
        (
            "workloads: [{namespace: x, workloadIps: [], capacity: 4294967296}]",
            "config.yaml: workloads[0].capacity: invalid unsigned 32-bit integer 4294967296 (expected 0..4294967295)",
        ),
        (
            "workloads: [{namespace: [x], workloadIps: []}]",
            "config.yaml: workloads[0].namespace: expected a string, got a list",
        ),
        # services
        (
            "services: [{namespace: n, hostname: h, vips: [], ports: {}}]",
            "config.yaml: services[0].name: missing required key",
        ),
        (
            "services: [{name: s, hostname: h, vips: [], ports: {}}]",
            "config.yaml: services[0].namespace: missing required key",
        ),
        (
            "services: [{name: s, namespace: n, vips: [], ports: {}}]",
            "config.yaml: services[0].hostname: missing required key",
        ),
        (
            "services: [{name: s, namespace: n, hostname: h, ports: {}}]",
            "config.yaml: services[0].vips: missing required key",
        ),
        (
            "services: [{name: s, namespace: n, hostname: h, vips: []}]",
            "config.yaml: services[0].ports: missing required key",
        ),
        (
            "services: [{name: s, namespace: n, hostname: h, vips: [10.0.0.1], ports: {}}]",
            "config.yaml: services[0].vips[0]: invalid address '10.0.0.1' (expected '<network>/<ip>')",
        ),
        (
            "services: [{name: s, namespace: n, hostname: h, vips: [/10.0.0.300], ports: {}}]",
            "config.yaml: services[0].vips[0]: invalid address '/10.0.0.300': invalid IP address '10.0.0.300'",
        ),
        (
            "services: [{name: s, namespace: n, hostname: h, vips: [], ports: {http: 80}}]",
            "config.yaml: services[0].ports[\"http\"]: expected port, got the string 'http'",
        ),
        (
            "services: [{name: s, namespace: n, hostname: h, vips: [], ports: {80: true}}]",
            "config.yaml: services[0].ports[80]: expected port, got the boolean true",
        ),
        (
            "services: [{name: s, namespace: n, hostname: h, vips: [], ports: {}, cidrVips: [{cidr: 10.0.0.0/33}]}]",
            "config.yaml: services[0].cidrVips[0].cidr: invalid CIDR '10.0.0.0/33'",
        ),
        (
            "services: [{name: s, namespace: n, hostname: h, vips: [], ports: {}, color: red}]",
            "config.yaml: services[0].color: unknown key (expected one of: name, namespace, hostname, vips, ports, "
            "cidrVips, endpoints, subjectAltNames, waypoint, weightedWaypoints, loadBalancer, ipFamilies, "
            "canonical, visibility)",
        ),
        (
            "services: [{name: s, namespace: n, hostname: h, vips: [], ports: {}, loadBalancer: {mode: Random}}]",
            "config.yaml: services[0].loadBalancer.mode: invalid value the string 'Random' "
            "(expected one of: Standard, Strict, Failover, Passthrough)",
        ),
        (
            "services: [{name: s, namespace: n, hostname: h, vips: [], ports: {}, "
            "loadBalancer: {routingPreferences: [Zone, Rack]}}]",
            "config.yaml: services[0].loadBalancer.routingPreferences[1]: invalid value the string 'Rack' "
            "(expected one of: Region, Zone, Subzone, Node, Cluster, Network)",
        ),
        (
            "services: [{name: s, namespace: n, hostname: h, vips: [], ports: {}, loadBalancer: {weight: 1}}]",
            "config.yaml: services[0].loadBalancer.weight: unknown key "
            "(expected one of: routingPreferences, mode, healthPolicy)",
        ),
        (
            "services: [{name: s, namespace: n, hostname: h, vips: [], ports: {}, ipFamilies: IPv5}]",
            "config.yaml: services[0].ipFamilies: invalid value the string 'IPv5' (expected one of: Dual, IPv4, IPv6)",
        ),
        (
            "services: [{name: s, namespace: n, hostname: h, vips: [], ports: {}, visibility: Private}]",
            "config.yaml: services[0].visibility: invalid value the string 'Private' (expected one of: Public, Namespace)",
        ),
        (
            "services: [{name: s, namespace: n, hostname: h, vips: [], ports: {}, endpoints: {u1: {status: Dead}}}]",
            "config.yaml: services[0].endpoints[\"u1\"].status: invalid value the string 'Dead' "
            "(expected one of: Healthy, Unhealthy)",
        ),
        # policies
        (
            "policies: [{namespace: n, scope: Global, action: Allow, rules: [], dryRun: false}]",
            "config.yaml: policies[0].name: missing required key",
        ),
        (
            "policies: [{name: p, namespace: n, scope: Global, action: Allow, rules: []}]",
            "config.yaml: policies[0].dryRun: missing required key",
        ),
        (
            "policies: [{name: p, namespace: n, action: Allow, rules: [], dryRun: false}]",
            "config.yaml: policies[0].scope: missing required key",
        ),
        (
            "policies: [{name: p, namespace: n, scope: Global, rules: [], dryRun: false}]",
            "config.yaml: policies[0].action: missing required key",
        ),
        (
            "policies: [{name: p, namespace: n, scope: Global, action: Allow, dryRun: false}]",
            "config.yaml: policies[0].rules: missing required key",
        ),
        (
            "policies: [{name: p, namespace: n, scope: Cluster, action: Allow, rules: [], dryRun: false}]",
            "config.yaml: policies[0].scope: invalid value the string 'Cluster' "
            "(expected one of: Global, Namespace, WorkloadSelector)",
        ),
        (
            "policies: [{name: p, namespace: n, scope: Global, action: Audit, rules: [], dryRun: false}]",
            "config.yaml: policies[0].action: invalid value the string 'Audit' (expected one of: Allow, Deny)",
        ),
        (
            "policies: [{name: p, namespace: n, scope: Global, action: Allow, rules: [], dryRun: false, x: 1}]",
            "config.yaml: policies[0].x: unknown key (expected one of: name, namespace, scope, action, rules, dryRun)",
        ),
        (
            "policies: [{name: p, namespace: n, scope: Global, action: Allow, dryRun: false, "
            "rules: [[[{principals: [!Regex x]}]]]}]",
            "config.yaml: policies[0].rules[0][0][0].principals[0]: unknown string match tag '!Regex' "
            "(expected !Exact, !Prefix, !Suffix or !Presence)",
        ),
        (
            "policies: [{name: p, namespace: n, scope: Global, action: Allow, dryRun: false, "
            "rules: [[[{principals: [{Regex: x}]}]]]}]",
            "config.yaml: policies[0].rules[0][0][0].principals[0]: unknown string match kind the string 'Regex' "
            "(expected !Exact, !Prefix, !Suffix or !Presence)",
        ),
        (
            "policies: [{name: p, namespace: n, scope: Global, action: Allow, dryRun: false, "
            "rules: [[[{principals: [cluster.local/ns/a/sa/b]}]]]}]",
            "config.yaml: policies[0].rules[0][0][0].principals[0]: expected a string match "
            "(!Exact, !Prefix, !Suffix or !Presence), got the string 'cluster.local/ns/a/sa/b'",
        ),
        (
            "policies: [{name: p, namespace: n, scope: Global, action: Allow, dryRun: false, "
            "rules: [[[{namespaces: [!Presence x]}]]]}]",
            "config.yaml: policies[0].rules[0][0][0].namespaces[0]: !Presence takes no value ([] or null), "
            "got the string 'x'",
        ),
        (
            "policies: [{name: p, namespace: n, scope: Global, action: Allow, dryRun: false, "
            "rules: [[[{}], [{sourceIps: [10.0.0.0/8, 10.0.0.0/40]}]]]}]",
            "config.yaml: policies[0].rules[0][1][0].sourceIps[1]: invalid CIDR '10.0.0.0/40'",
        ),
        (
            "policies: [{name: p, namespace: n, scope: Global, action: Allow, dryRun: false, "
            "rules: [[[{destinationPorts: [65536]}]]]}]",
            "config.yaml: policies[0].rules[0][0][0].destinationPorts[0]: invalid port 65536 (expected 0..65535)",
        ),
        (
            "policies: [{name: p, namespace: n, scope: Global, action: Allow, dryRun: false, "
            "rules: [[[{sourceIP: [10.0.0.1]}]]]}]",
            "config.yaml: policies[0].rules[0][0][0].sourceIP: unknown key (expected one of: namespaces, "
            "notNamespaces, principals, notPrincipals, sourceIps, notSourceIps, destinationIps, "
            "notDestinationIps, destinationPorts, notDestinationPorts, serviceAccounts, notServiceAccounts)",
        ),
        (
            "policies: [{name: p, namespace: n, scope: Global, action: Allow, dryRun: false, "
            "rules: [[[{serviceAccounts: [{namespace: a}]}]]]}]",
            "config.yaml: policies[0].rules[0][0][0].serviceAccounts[0].serviceAccount: missing required key",
        ),
        (
            "policies: [{name: p, namespace: n, scope: Global, action: Allow, dryRun: false, rules: [[{}]]}]",
            "config.yaml: policies[0].rules[0][0]: expected a list, got a mapping",
        ),
        (
            "policies: [{name: !Exact p, namespace: n, scope: Global, action: Allow, dryRun: false, rules: []}]",
            "config.yaml: policies[0].name: expected a string, got a value tagged !Exact",
        ),
    ],
)
def test_errors_name_the_key_path(text: str, message: str) -> None:
    assert error_of(text).startswith(message), error_of(text)


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


def test_string_match_tags_and_map_form() -> None:
    tags = only_match("{principals: [!Exact a, !Prefix b, !Suffix c, !Presence []]}")
    maps = only_match("{principals: [{Exact: a}, {Prefix: b}, {Suffix: c}, {Presence: []}]}")
    expected = (
        StringMatch(StringMatchKind.EXACT, "a"),
        StringMatch(StringMatchKind.PREFIX, "b"),
        StringMatch(StringMatchKind.SUFFIX, "c"),
        StringMatch(StringMatchKind.PRESENCE),
    )
    assert tags.principals == expected
    assert maps.principals == expected


# In a flow sequence a bare tag needs a space before `]`: libyaml, like PyYAML, reads `]` as part of a tag.
@pytest.mark.parametrize(
    "presence",
    ["!Presence []", "!Presence ", "!Presence null", "!Presence ''", "{Presence: []}", "{Presence: null}"],
)
def test_presence_forms(presence: str) -> None:
    assert only_match(f"{{notPrincipals: [{presence}]}}").not_principals == (
        StringMatch(StringMatchKind.PRESENCE),
    )


def test_tagged_scalars_stay_text() -> None:
    assert only_match("{namespaces: [!Exact 123, !Exact true]}").namespaces == (
        StringMatch(StringMatchKind.EXACT, "123"),
        StringMatch(StringMatchKind.EXACT, "true"),
    )


def test_every_match_key() -> None:
    m = only_match(
        """{namespaces: [!Exact a], notNamespaces: [!Prefix b], principals: [!Suffix /sa/c],
            notPrincipals: [!Presence []], sourceIps: [10.0.0.1, 10.0.0.0/8], notSourceIps: ["fd00::1"],
            destinationIps: [192.168.1.7/24], notDestinationIps: ["::/0"], destinationPorts: [80],
            notDestinationPorts: [0, 65535], serviceAccounts: [{namespace: a, serviceAccount: b}],
            notServiceAccounts: [{namespace: c, serviceAccount: d}]}"""
    )
    assert m == Match(
        namespaces=(StringMatch(StringMatchKind.EXACT, "a"),),
        not_namespaces=(StringMatch(StringMatchKind.PREFIX, "b"),),
        principals=(StringMatch(StringMatchKind.SUFFIX, "/sa/c"),),
        not_principals=(StringMatch(StringMatchKind.PRESENCE),),
        source_ips=(net("10.0.0.1/32"), net("10.0.0.0/8")),
        not_source_ips=(net("fd00::1/128"),),
        destination_ips=(net("192.168.1.0/24"),),
        not_destination_ips=(net("::/0"),),
        destination_ports=(80,),
        not_destination_ports=(0, 65535),
        service_accounts=(ServiceAccountMatch("a", "b"),),
        not_service_accounts=(ServiceAccountMatch("c", "d"),),
    )


def test_rules_nesting_and_flags() -> None:
    cfg = parse(
        """
        policies:
          - name: p
            namespace: ns
            scope: WorkloadSelector
            action: Deny
            dryRun: true
            rules:
              - - - {destinationPorts: [1]}
                  - {destinationPorts: [2]}
                - - {destinationPorts: [3]}
              - []
        """
    )
    (p,) = cfg.policies
    assert (p.scope, p.action, p.dry_run, p.key) == (Scope.WORKLOAD_SELECTOR, Action.DENY, True, "ns/p")
    assert p.rules == (
        (
            (Match(destination_ports=(1,)), Match(destination_ports=(2,))),
            (Match(destination_ports=(3,)),),
        ),
        (),
    )


def test_yaml_1_2_scalars() -> None:
    # YAML 1.1 would read `no` as false and `010` as eight.
    (w,) = parse(
        "workloads: [{namespace: no, workloadIps: [], capacity: 010, services: {a/b: {0x50: 0o17}}}]"
    ).workloads
    assert w.namespace == "no"
    assert w.capacity == 10
    assert w.services == (("a/b", ((80, 15),)),)


def test_string_fields_take_plain_scalars_as_written() -> None:
    (w,) = parse(
        "workloads: [{namespace: true, workloadIps: [], canonicalRevision: 1.10, name: 010}]"
    ).workloads
    assert (w.namespace, w.canonical_revision, w.name) == ("true", "1.10", "010")


def test_port_map_accepts_string_keys_as_json_writes_them() -> None:
    cfg = parse(
        'services: [{"name": "s", "namespace": "n", "hostname": "h", "vips": [], "ports": {"80": 8080}}]'
    )
    assert cfg.services[0].ports == ((80, 8080),)


def test_dump_format_parses_back_to_equal_values() -> None:
    cfg = parse_local_config(SPEC_EXAMPLE)
    rich = parse(
        """
        workloads:
          - {uid: u, namespace: ns, workloadIps: ["fd00::1"], applicationTunnel: {protocol: PROXY, port: 1},
             waypoint: {destination: ns/wp}, locality: {zone: z}, services: {ns/h: {80: 0}}}
        services:
          - {name: s, namespace: ns, hostname: h, vips: [net/10.0.0.1], ports: {80: 0},
             cidrVips: [{cidr: 10.1.0.0/16}], loadBalancer: {routingPreferences: [Zone]}, ipFamilies: IPv6,
             weightedWaypoints: [{destination: {destination: /10.0.0.2}, weight: 2}],
             endpoints: {u: {workloadUid: u, port: {80: 81}, status: Unhealthy}}}
        policies:
          - {name: p, namespace: ns, scope: Global, action: Allow, dryRun: true,
             rules: [[[{notPrincipals: [!Presence []], sourceIps: [10.0.0.0/8],
                        serviceAccounts: [{namespace: a, serviceAccount: b}]}]], []]}
        """
    )
    for original in (cfg, rich):
        dumped = {
            "workloads": [workload_to_dict(w) for w in original.workloads],
            "services": [service_to_dict(s) for s in original.services],
            "policies": [policy_to_dict(p) for p in original.policies],
        }
        assert parse_local_config(json.dumps(dumped)) == original


def test_policy_dump_renders_string_matches_in_map_form() -> None:
    (p,) = parse(
        "policies: [{name: p, namespace: n, scope: Global, action: Deny, dryRun: false, "
        "rules: [[[{notPrincipals: [!Presence []], namespaces: [!Exact x]}]]]}]"
    ).policies
    entry = policy_to_dict(p)["rules"][0][0][0]
    assert entry["notPrincipals"] == [{"Presence": []}]
    assert entry["namespaces"] == [{"Exact": "x"}]
