"""Model values rendered in the local config's format parse back to equal values."""

from __future__ import annotations

import json

from mesh.localconfig import (
    parse_local_config,
)
from mesh.render import (
    policy_to_dict,
    service_to_dict,
    workload_to_dict,
)
from tests.localdocs import (
    SPEC_EXAMPLE,
    parse,
)


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
