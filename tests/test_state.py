"""The workload/service store and its lookups: endpoints, removal, addresses, VIPs and host names,
the proxy's own workload, the listeners of its changes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mesh.model import (
    Endpoint,
    HealthPolicy,
    LoadBalancer,
    NetworkAddress,
    NetworkMode,
    Service,
    TunnelProtocol,
    Visibility,
    Workload,
    WorkloadStatus,
)
from policy.model import Scope
from tests.workloads import (
    SVC,
    VIP,
    cidr_service,
    ip,
    pol,
    service,
    uids,
    workload,
)
from ztunnel.state.store import ProxyState

# --- endpoints -------------------------------------------------------------------------------------


def test_endpoints_of_an_unknown_service_are_staged_then_merged() -> None:
    state = ProxyState()
    state.upsert_workload(workload("w1", "10.0.0.1", services={SVC: {80: 8080}}))
    assert state.endpoints(SVC) == []
    assert list(state.dump()["stagedServices"]) == [SVC]

    state.upsert_service(service())
    assert state.endpoints(SVC) == [Endpoint("w1", ((80, 8080),), WorkloadStatus.HEALTHY)]
    assert state.dump()["stagedServices"] == {}


def test_workloads_arriving_after_the_service_join_it() -> None:
    state = ProxyState()
    state.upsert_service(service())
    state.upsert_workload(workload("w1", "10.0.0.1", services={SVC: {80: 9090}}))
    state.upsert_workload(workload("w2", "10.0.0.2", services={SVC: {80: 9091}}))
    assert [ep.target_port(80) for ep in state.endpoints(SVC)] == [9090, 9091]


def test_unhealthy_endpoints_are_excluded_unless_allow_all() -> None:
    state = ProxyState()
    state.upsert_workload(workload("up", "10.0.0.1", services={SVC: {80: 8080}}))
    state.upsert_workload(
        workload("down", "10.0.0.2", services={SVC: {80: 8080}}, status=WorkloadStatus.UNHEALTHY)
    )
    state.upsert_service(service())
    assert uids(state.endpoints(SVC)) == ["up"]

    state.upsert_service(service(load_balancer=LoadBalancer(health_policy=HealthPolicy.ALLOW_ALL)))
    assert uids(state.endpoints(SVC)) == ["up", "down"]

    state.upsert_service(service(load_balancer=LoadBalancer(health_policy=HealthPolicy.ONLY_HEALTHY)))
    assert uids(state.endpoints(SVC)) == ["up"]


def test_workload_turning_unhealthy_leaves_the_endpoints() -> None:
    state = ProxyState()
    state.upsert_service(service())
    state.upsert_workload(workload("w1", "10.0.0.1", services={SVC: {80: 8080}}))
    state.upsert_workload(
        workload("w1", "10.0.0.1", services={SVC: {80: 8080}}, status=WorkloadStatus.UNHEALTHY)
    )
    assert state.endpoints(SVC) == []


def test_service_own_endpoints_are_merged_with_memberships() -> None:
    state = ProxyState()
    own = (Endpoint("listed", ((80, 1),)), Endpoint("w1", ((80, 2),)))
    state.upsert_service(service(endpoints=own))
    state.upsert_workload(workload("w1", "10.0.0.1", services={SVC: {80: 3}}))
    assert [(ep.workload_uid, ep.target_port(80)) for ep in state.endpoints(SVC)] == [
        ("listed", 1),
        ("w1", 3),
    ]


def test_upserting_a_workload_drops_its_previous_entry() -> None:
    state = ProxyState()
    state.upsert_service(service())
    state.upsert_workload(workload("w1", "10.0.0.1", services={SVC: {80: 8080}}))
    state.upsert_workload(workload("w1", "10.0.0.2"))
    assert state.workload_by_addr("", ip("10.0.0.1")) is None
    assert state.workload_by_addr("", ip("10.0.0.2")) == state.workload_by_uid("w1")
    assert state.endpoints(SVC) == []
    assert state.dump()["stagedServices"] == {}


def test_removing_a_service_stages_its_endpoints_until_it_returns() -> None:
    state = ProxyState()
    state.upsert_service(service())
    state.upsert_workload(workload("w1", "10.0.0.1", services={SVC: {80: 8080}}))
    assert state.remove_service(SVC)
    assert state.service_for_vip("", ip("10.96.0.1"), "ns") is None
    assert state.service_by_hostname("svc.example", "ns") is None
    assert list(state.dump()["stagedServices"]) == [SVC]
    state.upsert_service(service())
    assert uids(state.endpoints(SVC)) == ["w1"]


def test_endpoints_of_unknown_service_key() -> None:
    assert ProxyState().endpoints("nope/nothing") == []


# --- removal by name -------------------------------------------------------------------------------


def test_remove_by_uid_removes_workload_and_its_endpoints() -> None:
    state = ProxyState()
    state.upsert_service(service())
    state.upsert_workload(workload("ns/svc.example", "10.0.0.1", services={SVC: {80: 8080}}))
    # The name is a uid first, even when it also reads as namespace/hostname.
    assert state.remove("ns/svc.example")
    assert state.workload_by_uid("ns/svc.example") is None
    assert state.workload_by_addr("", ip("10.0.0.1")) is None
    assert state.endpoints(SVC) == []
    assert state.service_by_key(SVC) is not None


def test_remove_by_namespaced_hostname_removes_service() -> None:
    state = ProxyState()
    state.upsert_service(service())
    assert state.remove(SVC)
    assert state.service_by_key(SVC) is None
    assert state.services_by_vip("", ip("10.96.0.1")) == []


@pytest.mark.parametrize("name", ["unknown-uid", "ns/unknown", "ns/svc.example/extra"])
def test_remove_of_nothing_changes_nothing(name: str) -> None:
    state = ProxyState()
    state.upsert_service(service())
    state.upsert_service(service("x", hostname="svc.example/extra"))
    calls: list[str] = []
    state.subscribe(lambda: calls.append("changed"))
    assert not state.remove(name)
    assert state.service_by_key(SVC) is not None
    assert state.service_by_key("ns/svc.example/extra") is not None  # a hostname with `/` is never removed
    assert calls == []


# --- workloads by address --------------------------------------------------------------------------


def test_workload_by_addr_is_per_network() -> None:
    state = ProxyState()
    state.upsert_workload(workload("a", "10.0.0.1", network="net-a"))
    state.upsert_workload(workload("b", "10.0.0.1", network="net-b"))
    found_a = state.workload_by_addr("net-a", ip("10.0.0.1"))
    found_b = state.workload_by_addr("net-b", ip("10.0.0.1"))
    assert (found_a and found_a.uid, found_b and found_b.uid) == ("a", "b")
    assert state.workload_by_addr("", ip("10.0.0.1")) is None


def test_host_network_workloads_are_not_indexed_by_ip() -> None:
    state = ProxyState()
    state.upsert_workload(workload("host", "10.0.0.1", network_mode=NetworkMode.HOST_NETWORK))
    assert state.workload_by_addr("", ip("10.0.0.1")) is None
    assert state.workload_by_uid("host") is not None


@pytest.mark.parametrize(
    ("workloads", "winner"),
    [
        (
            [workload("c1//Other/ns/a", "10.0.0.1"), workload("c1//Pod/ns/b", "10.0.0.1")],
            "c1//Pod/ns/b",
        ),
        (
            [
                workload("tcp", "10.0.0.1"),
                workload("hbone", "10.0.0.1", tunnel_protocol=TunnelProtocol.HBONE),
            ],
            "hbone",
        ),
        (
            [
                workload("c//Other/ns/hbone", "10.0.0.1", tunnel_protocol=TunnelProtocol.HBONE),
                workload("c//Pod/ns/tcp", "10.0.0.1"),
            ],
            "c//Pod/ns/tcp",
        ),
        ([workload("first", "10.0.0.1"), workload("second", "10.0.0.1")], "first"),
    ],
    ids=["pod", "hbone", "pod-before-hbone", "first-seen"],
)
def test_shared_address_preference(workloads: list[Workload], winner: str) -> None:
    state = ProxyState()
    for w in workloads:
        state.upsert_workload(w)
    found = state.workload_by_addr("", ip("10.0.0.1"))
    assert found is not None and found.uid == winner


def test_ipv6_workload_address() -> None:
    state = ProxyState()
    state.upsert_workload(workload("v6", "fd00::1", "10.0.0.1"))
    assert state.workload_by_addr("", ip("fd00::1")) == state.workload_by_addr("", ip("10.0.0.1"))


# --- services by VIP and hostname ------------------------------------------------------------------


def selected(state: ProxyState, client_namespace: str | None) -> str | None:
    found = state.service_for_vip("", VIP, client_namespace)
    return found.key if found else None


def test_vip_shared_across_namespaces_prefers_client_namespace_then_canonical_then_first_seen() -> None:
    state = ProxyState()
    state.upsert_service(service("a", "ns-a", hostname="shared.example"))
    state.upsert_service(service("b", "ns-b", hostname="shared.example"))
    state.upsert_service(service("c", "ns-c", hostname="shared.example", canonical=True))
    assert [s.key for s in state.services_by_vip("", VIP)] == [
        "ns-a/shared.example",
        "ns-b/shared.example",
        "ns-c/shared.example",
    ]
    assert selected(state, "ns-b") == "ns-b/shared.example"
    assert selected(state, "elsewhere") == "ns-c/shared.example"
    state.remove_service("ns-c/shared.example")
    assert selected(state, "elsewhere") == "ns-a/shared.example"
    assert selected(state, None) == "ns-a/shared.example"


def test_namespace_visibility_hides_service_from_other_namespaces() -> None:
    state = ProxyState()
    state.upsert_service(service("private", "ns-a", visibility=Visibility.NAMESPACE, canonical=True))
    assert selected(state, "ns-a") == "ns-a/private.example"
    assert selected(state, "ns-b") is None
    assert selected(state, None) is None
    state.upsert_service(service("public", "ns-c"))
    assert selected(state, "ns-b") == "ns-c/public.example"
    assert state.service_by_hostname("private.example", "ns-b") is None
    assert state.service_by_hostname("private.example", "ns-a") is not None


def test_updated_service_keeps_its_place_and_leaves_dropped_vips() -> None:
    state = ProxyState()
    state.upsert_service(service("a", "ns-a", hostname="shared.example"))
    state.upsert_service(service("b", "ns-b", hostname="shared.example"))
    state.upsert_service(service("a", "ns-a", hostname="shared.example", vips=("10.96.0.1", "10.96.0.2")))
    assert selected(state, "x") == "ns-a/shared.example"
    state.upsert_service(service("a", "ns-a", hostname="shared.example", vips=("10.96.0.2",)))
    assert [s.key for s in state.services_by_vip("", VIP)] == ["ns-b/shared.example"]
    assert [s.key for s in state.services_by_vip("", ip("10.96.0.2"))] == ["ns-a/shared.example"]


def test_vips_are_per_network() -> None:
    state = ProxyState()
    state.upsert_service(
        Service(
            name="s", namespace="ns", hostname="h", vips=(NetworkAddress("net1", VIP),), ports=((80, 80),)
        )
    )
    assert state.service_for_vip("", VIP, "ns") is None
    found = state.service_for_vip("net1", VIP, "ns")
    assert found is not None and found.key == "ns/h"


def test_cidr_vip_ranking() -> None:
    state = ProxyState()
    state.upsert_service(cidr_service("wide", "ns-a", "10.0.0.0/8"))
    state.upsert_service(cidr_service("narrow", "ns-b", "10.1.0.0/16"))
    state.upsert_service(cidr_service("narrow-canonical", "ns-c", "10.1.0.0/16", canonical=True))
    target = ip("10.1.2.3")

    def pick(client_namespace: str) -> str | None:
        found = state.service_for_vip("", target, client_namespace)
        return found.name if found else None

    assert pick("ns-a") == "wide"  # the client's namespace outranks a longer prefix
    assert pick("ns-b") == "narrow"  # ... and canonical
    assert pick("elsewhere") == "narrow-canonical"  # longest prefix, then canonical
    found = state.service_for_vip("", ip("10.200.0.1"), "elsewhere")
    assert found is not None and found.name == "wide"
    assert state.service_for_vip("", ip("11.0.0.1"), "elsewhere") is None
    assert state.service_for_vip("other-net", target, "ns-a") is None


def test_exact_vip_beats_cidr_vip() -> None:
    state = ProxyState()
    state.upsert_service(cidr_service("cidr", "ns", "10.96.0.0/16"))
    state.upsert_service(service("exact", "other"))
    found = state.service_for_vip("", VIP, "ns")
    assert found is not None and found.name == "exact"


def test_cidr_vip_respects_visibility_and_removal() -> None:
    state = ProxyState()
    state.upsert_service(
        replace(cidr_service("private", "ns-a", "10.0.0.0/8"), visibility=Visibility.NAMESPACE)
    )
    assert state.service_for_vip("", ip("10.0.0.1"), "ns-b") is None
    assert state.service_for_vip("", ip("10.0.0.1"), "ns-a") is not None
    state.remove_service("ns-a/private.ns-a.example")
    assert state.service_for_vip("", ip("10.0.0.1"), "ns-a") is None


def test_service_by_hostname_preferences() -> None:
    state = ProxyState()
    state.upsert_service(service("a", "ns-a", hostname="shared.example"))
    state.upsert_service(service("b", "ns-b", hostname="shared.example"))

    def pick(client: str | None, preferred: str | None = None) -> str | None:
        found = state.service_by_hostname("shared.example", client, preferred)
        return found.namespace if found else None

    assert pick("ns-b") == "ns-b"
    assert pick("elsewhere") == "ns-a"
    assert pick("elsewhere", preferred="ns-b") == "ns-b"
    state.upsert_service(service("c", "ns-c", hostname="shared.example", canonical=True))
    assert pick("elsewhere", preferred="ns-b") == "ns-c"  # canonical comes before the preferred namespace
    assert state.service_by_hostname("other.example", "ns-a") is None


def test_service_lookups_by_key_and_of_workload() -> None:
    state = ProxyState()
    state.upsert_service(service())
    w = workload("w1", "10.0.0.1", services={SVC: {80: 8080}, "ns/unknown.example": {80: 80}})
    state.upsert_workload(w)
    assert state.service_by_key(SVC) == service()
    assert state.services_of_workload(w) == [service()]


# --- the proxy's own workload ----------------------------------------------------------------------


def test_find_local_workload_only_on_this_node() -> None:
    state = ProxyState()
    state.upsert_workload(workload("elsewhere", "10.0.0.1", name="client", service_account="sa", node="n2"))
    state.upsert_workload(workload("here", "10.0.0.2", name="client", service_account="sa", node="n1"))
    found = state.find_local_workload("client", "ns", "sa", "n1")
    assert found is not None and found.uid == "here"
    assert state.find_local_workload("client", "ns", "sa", "n3") is None
    assert state.find_local_workload("client", "ns", "other-sa", "n1") is None
    for no_node in (None, ""):
        found = state.find_local_workload("client", "ns", "sa", no_node)
        assert found is not None and found.uid == "elsewhere"


# --- listeners -------------------------------------------------------------------------------------


def test_listeners() -> None:
    state = ProxyState()
    changes: list[str] = []
    policy_changes: list[str] = []
    state.subscribe(lambda: changes.append("any"))
    unsubscribe = state.subscribe_policies(lambda: policy_changes.append("policy"))

    state.upsert_workload(workload("w", "10.0.0.1", authorization_policies=("ns/p",)))
    state.upsert_service(service())
    assert (len(changes), policy_changes) == (2, [])  # workload changes alone re-evaluate nothing

    state.upsert_policy(pol("p", "ns", Scope.NAMESPACE))
    assert (len(changes), len(policy_changes)) == (3, 1)

    with state.batch():
        state.upsert_policy(pol("q", "ns", Scope.NAMESPACE))
        state.remove_policy("ns/p")
        assert len(policy_changes) == 1  # not yet: the batch is still open
    assert (len(changes), len(policy_changes)) == (4, 2)

    unsubscribe()
    state.remove_policy("ns/q")
    assert (len(changes), len(policy_changes)) == (5, 2)


def test_failing_listener_does_not_stop_the_others() -> None:
    state = ProxyState()
    calls: list[str] = []

    def broken() -> None:
        raise RuntimeError("boom")

    state.subscribe(broken)
    state.subscribe(lambda: calls.append("ok"))
    state.upsert_service(service())
    assert calls == ["ok"]
    assert state.service_by_key(SVC) is not None
