"""The store and the local config: applied as a whole, dumped as JSON that parses back."""

from __future__ import annotations

import json

from mesh.localconfig import LocalConfig, parse_local_config
from policy.model import Scope
from tests.workloads import (
    VIP,
    cidr_service,
    ip,
    pol,
    service,
    uids,
    workload,
)
from ztunnel.state.store import ProxyState

# --- the local config ------------------------------------------------------------------------------

LOCAL = """
workloads:
  - uid: c//v1/Pod/demo/server
    name: server
    namespace: demo
    serviceAccount: server-sa
    workloadIps: ["127.0.0.2"]
    protocol: HBONE
    services:
      "demo/server.demo.svc.cluster.local": {80: 8080}
      "demo/not-yet.demo.svc.cluster.local": {80: 8080}
services:
  - name: server
    namespace: demo
    hostname: server.demo.svc.cluster.local
    vips: ["/10.96.1.1"]
    ports: {80: 8080}
policies:
  - name: only-client
    namespace: demo
    scope: Namespace
    action: Allow
    dryRun: false
    rules:
      - - - principals: [!Exact "cluster.local/ns/demo/sa/client-sa"]
"""


def test_apply_local_config_replaces_everything() -> None:
    state = ProxyState()
    state.upsert_workload(workload("old", "10.0.0.9", services={"old/old.example": {1: 1}}))
    state.upsert_service(service("old", "old"))
    state.upsert_policy(pol("old", "demo", Scope.NAMESPACE))
    policy_changes: list[str] = []
    state.subscribe_policies(lambda: policy_changes.append("policy"))

    state.apply_local_config(parse_local_config(LOCAL))
    assert [w.uid for w in state.workloads()] == ["c//v1/Pod/demo/server"]
    assert state.workload_by_addr("", ip("10.0.0.9")) is None
    assert [s.key for s in state.services()] == ["demo/server.demo.svc.cluster.local"]
    assert state.services_by_vip("", VIP) == []
    assert [p.key for p in state.policies()] == ["demo/only-client"]
    assert uids(state.endpoints("demo/server.demo.svc.cluster.local")) == ["c//v1/Pod/demo/server"]
    assert list(state.dump()["stagedServices"]) == ["demo/not-yet.demo.svc.cluster.local"]
    assert policy_changes == ["policy"]

    state.apply_local_config(LocalConfig())
    assert (state.workloads(), state.services(), state.policies()) == ([], [], [])
    assert state.dump() == {"workloads": [], "services": [], "policies": [], "stagedServices": {}}


def test_dump_is_json_and_parses_back_as_a_local_config() -> None:
    state = ProxyState()
    cfg = parse_local_config(LOCAL)
    state.apply_local_config(cfg)
    state.upsert_service(cidr_service("cidr", "demo", "10.0.0.0/8"))
    dump = state.dump()
    assert json.loads(json.dumps(dump)) == dump

    (w,) = dump["workloads"]
    assert w["uid"] == "c//v1/Pod/demo/server"
    assert w["workloadIps"] == ["127.0.0.2"]
    assert w["protocol"] == "HBONE"
    assert w["trustDomain"] == ""
    assert dump["services"][0]["endpoints"] == {
        "c//v1/Pod/demo/server": {
            "workloadUid": "c//v1/Pod/demo/server",
            "port": {"80": 8080},
            "status": "Healthy",
        }
    }
    assert dump["services"][1]["cidrVips"] == [{"network": "", "cidr": "10.0.0.0/8"}]
    assert dump["policies"][0]["rules"][0][0][0]["principals"] == [
        {"Exact": "cluster.local/ns/demo/sa/client-sa"}
    ]

    staged = dump.pop("stagedServices")
    assert list(staged) == ["demo/not-yet.demo.svc.cluster.local"]
    again = parse_local_config(json.dumps(dump))
    assert again.workloads == cfg.workloads
    assert again.policies == cfg.policies
