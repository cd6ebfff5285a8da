"""Every invalid local config is refused with the file, the key path and the reason."""

from __future__ import annotations

import pytest

from tests.localdocs import (
    error_of,
)


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
        # what the proxies would NACK: a gateway that could never be reached
        (
            "workloads: [{namespace: x, workloadIps: [], waypoint: {destination: ns/wp, hboneMtlsPort: 0}}]",
            "config.yaml: workloads[0].waypoint.hboneMtlsPort: port 0: the gateway could never be reached",
        ),
        (
            "workloads: [{namespace: x, workloadIps: [], networkGateway: {destination: /10.0.0.9, hboneMtlsPort: 0}}]",
            "config.yaml: workloads[0].networkGateway.hboneMtlsPort: port 0: the gateway could never be reached",
        ),
        (
            "workloads: [{namespace: x, workloadIps: [], waypoint: {destination: /wp.ns.svc}}]",
            "config.yaml: workloads[0].waypoint.destination: invalid destination '/wp.ns.svc': "
            "a hostname without its namespace",
        ),
        (
            "services: [{name: s, namespace: n, hostname: h, vips: [], ports: {}, "
            "waypoint: {destination: n/wp, hboneMtlsPort: 0}}]",
            "config.yaml: services[0].waypoint.hboneMtlsPort: port 0: the gateway could never be reached",
        ),
        (
            "services: [{name: s, namespace: n, hostname: h, vips: [], ports: {}, "
            "weightedWaypoints: [{destination: {destination: n/wp, hboneMtlsPort: 0}}]}]",
            "config.yaml: services[0].weightedWaypoints[0].destination.hboneMtlsPort: "
            "port 0: the gateway could never be reached",
        ),
        # ... and a service or policy without a name, namespace or hostname
        (
            'services: [{name: s, namespace: "", hostname: h, vips: [], ports: {}}]',
            "config.yaml: services[0].namespace: empty (the proxies refuse a resource without it)",
        ),
        (
            'services: [{name: "", namespace: n, hostname: h, vips: [], ports: {}}]',
            "config.yaml: services[0].name: empty (the proxies refuse a resource without it)",
        ),
        (
            'services: [{name: s, namespace: n, hostname: "", vips: [], ports: {}}]',
            "config.yaml: services[0].hostname: empty (the proxies refuse a resource without it)",
        ),
        (
            'policies: [{name: "", namespace: n, scope: Global, action: Allow, dryRun: false, rules: []}]',
            "config.yaml: policies[0].name: empty (the proxies refuse a resource without it)",
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
