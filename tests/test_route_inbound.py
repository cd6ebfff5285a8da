"""The questions routing answers for the inbound side and for locality: `is_waypoint_for`,
`hostname_target`, `locality_rank`."""

from __future__ import annotations

import pytest

from tests.route_mesh import (
    IP,
    state_fixture,  # noqa: F401 (a fixture)
)
from ztunnel.decisions.route import (
    hostname_target,
    is_waypoint_for,
    locality_rank,
)
from ztunnel.state.store import ProxyState

# --- locality rank -------------------------------------------------------------------------------


def test_network_first_rank_puts_every_same_network_endpoint_first(state: ProxyState) -> None:
    from mesh.model import LoadBalancingScope as S
    from mesh.model import Locality, Workload

    src = Workload("s", network="n1", locality=Locality("r1", "z1"))
    prefs = (S.NETWORK, S.REGION, S.ZONE)
    same_net_far = Workload("a", network="n1", locality=Locality("r9", "z9"))
    other_net_near = Workload("b", network="n2", locality=Locality("r1", "z1"))
    assert locality_rank(prefs, src, same_net_far) > locality_rank(prefs, src, other_net_near)
    assert locality_rank(prefs, src, other_net_near) == 2
    # Without NETWORK first a mismatch stops the count.
    assert locality_rank((S.REGION, S.NETWORK, S.ZONE), src, other_net_near) == 1


# --- the inbound questions --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("local_uid", "local_ip", "target", "expected"),
    [
        ("c//Pod/demo/waypoint", "10.0.9.1", "10.96.3.1", True),  # service waypoint by address
        ("c//Pod/demo/waypoint", "10.0.9.1", "10.96.3.2", True),  # by the waypoint's VIP
        ("c//Pod/demo/waypoint", "10.0.9.1", "10.96.3.3", True),  # by hostname
        ("c//Pod/demo/waypoint", "10.0.9.1", "10.0.4.1", True),  # workload waypoint
        ("c//Pod/demo/waypoint", "10.0.9.1", "10.96.3.7", True),  # one of weighted waypoints (weight 0)
        ("c//Pod/demo/waypoint2", "10.0.9.2", "10.96.3.7", True),
        ("c//Pod/demo/waypoint2", "10.0.9.2", "10.0.4.1", False),  # another workload's waypoint
        ("c//Pod/demo/waypoint", "10.0.9.1", "10.96.0.1", False),  # a service without waypoint
        ("c//Pod/demo/waypoint", "10.0.9.1", "10.0.0.2", False),  # a workload without waypoint
        ("c//Pod/demo/mesh-a", "10.0.0.2", "10.96.3.1", False),  # not the waypoint
        ("c//Pod/demo/waypoint", "10.0.9.1", "192.0.2.1", False),  # unknown address
    ],
)
def test_is_waypoint_for(
    state: ProxyState, local_uid: str, local_ip: str, target: str, expected: bool
) -> None:
    local = state.workload_by_uid(local_uid)
    assert local is not None
    assert is_waypoint_for(state, local, IP(local_ip), IP(target), "") is expected


def test_hostname_target(state: ProxyState) -> None:
    named = state.workload_by_uid("c//Pod/demo/named-a")
    plain = state.workload_by_uid("c//Pod/demo/mesh-a")
    assert named is not None and plain is not None
    found = hostname_target(state, named, "named.example", 80)
    assert found is not None and (found[0].name, found[1]) == ("named", 9001)  # our endpoint's mapping
    found = hostname_target(state, plain, "web.demo.svc.cluster.local", 80)
    assert found is not None and found[1] == 8080  # the service's target port
    assert hostname_target(state, plain, "web.demo.svc.cluster.local", 81) is None  # port not listed
    assert hostname_target(state, plain, "unnamed.example", 80) is None  # target port 0, no mapping
    assert hostname_target(state, plain, "nosuch.example", 80) is None
