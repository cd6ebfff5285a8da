"""The statistics of routing's weighted choices (capacity, weighted waypoints) under a fixed seed."""

from __future__ import annotations

import collections
import random

import pytest

from mesh.localconfig import parse_local_config
from tests.route_mesh import (
    addr,
    state_fixture,  # noqa: F401 (a fixture)
)
from ztunnel.decisions.route import (
    Route,
    route,
)
from ztunnel.state.store import ProxyState

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
        r = route(state, client, addr(dst), rng=rng)
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

    from mesh.model import Workload

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
