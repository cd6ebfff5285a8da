"""The store's policies: which apply to a workload, by scope and by name, and the decisions made
with them."""

from __future__ import annotations

import pytest

from policy import Allow, Connection, Deny, authorize
from policy.model import Action, Authorization, Match, Scope, StringMatch, StringMatchKind
from tests.workloads import (
    MATCH_ALL,
    ip,
    pol,
    workload,
)
from ztunnel.state.store import ProxyState

# --- policies --------------------------------------------------------------------------------------


def keys(policies: list[Authorization]) -> set[str]:
    return {p.key for p in policies}


def test_policies_for_namespace_global_and_listed() -> None:
    state = ProxyState()
    state.upsert_policy(pol("ns-wide", "ns1", Scope.NAMESPACE))
    state.upsert_policy(pol("other-ns", "ns2", Scope.NAMESPACE))
    state.upsert_policy(pol("mesh-wide", "istio-system", Scope.GLOBAL))
    state.upsert_policy(pol("selected", "ns1", Scope.WORKLOAD_SELECTOR))
    state.upsert_policy(pol("strict", "istio-system", Scope.WORKLOAD_SELECTOR))

    plain = workload("w", namespace="ns1")
    assert keys(state.policies_for(plain)) == {"ns1/ns-wide", "istio-system/mesh-wide"}

    listed = workload(
        "w2", namespace="ns1", authorization_policies=("istio-system/strict", "ns2/other-ns", "ns1/missing")
    )
    assert keys(state.policies_for(listed)) == {
        "ns1/ns-wide",
        "istio-system/mesh-wide",
        "istio-system/strict",
        "ns2/other-ns",
    }


def test_listing_a_policy_also_implied_yields_it_once() -> None:
    state = ProxyState()
    state.upsert_policy(pol("p", "ns1", Scope.NAMESPACE))
    w = workload("w", namespace="ns1", authorization_policies=("ns1/p",))
    assert [p.key for p in state.policies_for(w)] == ["ns1/p"]


def test_case44_policy_reinserted_with_another_scope_leaves_namespace_index() -> None:
    state = ProxyState()
    state.upsert_policy(pol("p", "ns1", Scope.NAMESPACE))
    w = workload("w", namespace="ns1")
    assert keys(state.policies_for(w)) == {"ns1/p"}
    state.upsert_policy(pol("p", "ns1", Scope.WORKLOAD_SELECTOR))
    assert state.policies_for(w) == []
    state.upsert_policy(pol("p", "ns1", Scope.GLOBAL))
    assert keys(state.policies_for(workload("w3", namespace="ns9"))) == {"ns1/p"}
    state.upsert_policy(pol("p", "ns1", Scope.NAMESPACE))
    assert state.policies_for(workload("w3", namespace="ns9")) == []


def test_remove_policy() -> None:
    state = ProxyState()
    state.upsert_policy(pol("p", "ns1", Scope.NAMESPACE))
    assert state.remove_policy("ns1/p")
    assert not state.remove_policy("ns1/p")
    assert state.policies_for(workload("w", namespace="ns1")) == []
    assert state.policy("ns1/p") is None


def test_end_to_end_decisions_cases_37_to_40() -> None:
    def principal(sa: str) -> StringMatch:
        return StringMatch(StringMatchKind.EXACT, f"cluster.local/ns/default/sa/{sa}")

    state = ProxyState()
    state.upsert_policy(
        Authorization(
            "foo",
            "ns1",
            Scope.NAMESPACE,
            Action.ALLOW,
            (((Match(principals=(principal("defaultacct"),)),),),),
        )
    )
    state.upsert_policy(
        Authorization(
            "deny", "ns1", Scope.NAMESPACE, Action.DENY, (((Match(principals=(principal("denyacct"),)),),),)
        )
    )
    state.upsert_policy(Authorization("dry-run-allow", "ns1", Scope.NAMESPACE, Action.ALLOW, MATCH_ALL, True))
    state.upsert_policy(Authorization("dry-run-deny", "ns1", Scope.NAMESPACE, Action.DENY, MATCH_ALL, True))

    def decide(namespace: str, sa: str) -> Allow | Deny:
        conn = Connection(
            src_ip=ip("10.0.0.1"),
            src_port=1234,
            dst_ip=ip("10.0.0.2"),
            dst_port=8080,
            src_principal=f"spiffe://cluster.local/ns/default/sa/{sa}",
            src_namespace="default",
            src_service_account=sa,
        )
        return authorize(state.policies_for(workload("dst", "10.0.0.2", namespace=namespace)), conn)

    assert isinstance(decide("ns2", "not-defaultacct"), Allow)
    assert isinstance(decide("ns1", "defaultacct"), Allow)
    assert decide("ns1", "not-defaultacct") == Deny(
        "allow policies exist, but none allowed",
        None,
        (
            "dry-run: deny policy match policy=ns1/dry-run-deny",
            "dry-run: allow policy match policy=ns1/dry-run-allow",
        ),
    )
    assert decide("ns1", "denyacct") == Deny(
        "explicitly denied by: ns1/deny", "ns1/deny", ("dry-run: deny policy match policy=ns1/dry-run-deny",)
    )


def test_unknown_listed_policy_is_skipped_and_warned_about_once(caplog: pytest.LogCaptureFixture) -> None:
    state = ProxyState()
    w = workload("w1", "10.0.0.1", authorization_policies=("ns/not-yet",))
    state.upsert_workload(w)
    with caplog.at_level("WARNING", logger="ztunnel.state"):
        for _ in range(3):  # as for three connections
            assert state.policies_for(w) == []
    assert [r.getMessage() for r in caplog.records] == [
        "workload w1 names unknown policy ns/not-yet, skipping it"
    ]
    known = Authorization(name="not-yet", namespace="ns", scope=Scope.WORKLOAD_SELECTOR)
    state.upsert_policy(known)
    assert state.policies_for(w) == [known]
