"""The store a worker rebuilds from the parent's messages equals the parent's, change after change:
a local file, xDS-like upserts and removals, policies, a service removed by name, a batch, and a
whole snapshot for a worker that starts late (the messages go through pickle as on the socket pair)."""

from __future__ import annotations

import pickle

from xds.localconfig import parse_local_config
from ztunnel.state.store import ProxyState
from ztunnel.workers.messages import StateChanges
from ztunnel.workers.replication import ReplicatedState, apply_changes, demand_arrived

FILE = """
workloads:
  - uid: c//v1/Pod/ns/a
    name: a
    namespace: ns
    serviceAccount: sa
    workloadIps: ["10.0.0.1"]
    services: {"ns/svc.ns.svc.cluster.local": {"80": 8080}}
  - uid: c//v1/Pod/ns/b
    name: b
    namespace: ns
    serviceAccount: sb
    workloadIps: ["10.0.0.2"]
services:
  - name: svc
    namespace: ns
    hostname: svc.ns.svc.cluster.local
    vips: ["/10.96.0.1"]
    ports: {"80": 8080}
policies:
  - name: deny-b
    namespace: ns
    scope: Namespace
    action: Deny
    dryRun: false
    rules:
      - - - principals: [!Exact "cluster.local/ns/ns/sa/sb"]
"""


def test_a_worker_store_follows_the_parent_change_by_change() -> None:
    sent: list[StateChanges] = []
    parent = ReplicatedState(lambda changes: sent.append(pickle.loads(pickle.dumps(changes))))
    worker = ProxyState()
    notified: list[int] = []
    worker.subscribe(lambda: notified.append(len(sent)))

    def replay() -> None:
        while sent:
            apply_changes(worker, sent.pop(0))
        assert worker.dump() == parent.dump()

    config = parse_local_config(FILE)
    parent.apply_local_config(config)
    assert len(sent) == 1  # one file, one message
    replay()
    assert len(worker.workloads()) == 2 and len(worker.policies()) == 1

    b = config.workloads[1]
    with parent.batch():  # one xDS response: one message, one notification in the worker
        parent.remove(b.uid)
        parent.upsert_workload(b)
        parent.remove_policy(config.policies[0].key)
    assert len(sent) == 1
    before = len(notified)
    replay()
    assert len(notified) == before + 1
    assert worker.policies() == []

    assert parent.remove("ns/svc.ns.svc.cluster.local")  # a service removed by its xDS name
    replay()
    assert worker.services() == []
    assert "ns/svc.ns.svc.cluster.local" in worker.dump()["stagedServices"]  # a's membership stays

    parent.upsert_policy(config.policies[0])
    late = ProxyState()  # a worker started now gets the whole store at once
    apply_changes(late, pickle.loads(pickle.dumps(parent.snapshot())))
    assert late.dump() == parent.dump()
    replay()
    assert worker.dump() == late.dump()


def test_the_parent_tells_when_an_on_demand_key_has_arrived() -> None:
    state = ProxyState()
    by_ip, by_vip = demand_arrived(state, "/10.0.0.2"), demand_arrived(state, "/10.96.0.1")
    by_name = demand_arrived(state, "ns/svc.ns.svc.cluster.local")
    assert not (by_ip() or by_vip() or by_name())
    state.apply_local_config(parse_local_config(FILE))
    assert by_ip() and by_vip() and by_name()
    assert not demand_arrived(state, "/10.0.0.9")()
    assert not demand_arrived(state, "other/10.0.0.2")()  # another network
