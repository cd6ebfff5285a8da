"""Wire <-> model conversion: round trips, the reference's defaults, and the
messages the reference refuses."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import TypeVar

import pytest
from google.protobuf import wrappers_pb2
from google.protobuf.message import Message

from mesh.localconfig import load_local_config, parse_local_config
from mesh.model import (
    ApplicationTunnel,
    AppTunnelProtocol,
    CidrVip,
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
    ServiceAccountMatch,
    StringMatch,
    StringMatchKind,
)
from xds import convert
from xds.convert import ConversionError
from xds.gen.istio.security import authorization_pb2
from xds.gen.istio.workload import workload_pb2

ip = ipaddress.ip_address
net = ipaddress.ip_network

FULL_WORKLOAD = Workload(
    uid="cluster1//v1/Pod/ns1/pod-a",
    name="pod-a",
    namespace="ns1",
    addresses=(ip("10.0.0.1"), ip("fd00::1")),
    hostname="pod-a.example",
    network="net1",
    tunnel_protocol=TunnelProtocol.HBONE,
    trust_domain="example.org",
    service_account="sa1",
    waypoint=GatewayAddress(NamespacedHostname("ns1", "waypoint.ns1.svc.cluster.local"), 15009),
    network_gateway=GatewayAddress(NetworkAddress("net2", ip("192.0.2.1")), 15008),
    node="node-1",
    canonical_name="app",
    canonical_revision="v1",
    workload_type="pod",
    workload_name="pod-a-deploy",
    native_tunnel=True,
    application_tunnel=ApplicationTunnel(AppTunnelProtocol.PROXY, 15088),
    services=(
        ("ns1/a.ns1.svc.cluster.local", ((80, 8080), (443, 8443))),
        ("ns1/b.ns1.svc.cluster.local", ((90, 0),)),
    ),
    authorization_policies=("ns1/p1", "ns1/p2"),
    status=WorkloadStatus.UNHEALTHY,
    cluster_id="cluster1",
    locality=Locality("r1", "z1", "s1"),
    network_mode=NetworkMode.HOST_NETWORK,
    capacity=3,
)

FULL_SERVICE = Service(
    name="a",
    namespace="ns1",
    hostname="a.ns1.svc.cluster.local",
    vips=(NetworkAddress("", ip("10.96.0.1")), NetworkAddress("net1", ip("fd00::10"))),
    cidr_vips=(CidrVip("", net("10.97.0.0/16")),),
    ports=((80, 8080), (90, 0)),
    subject_alt_names=("spiffe://example.org/ns/ns1/sa/other",),
    waypoint=GatewayAddress(NetworkAddress("", ip("10.0.0.9")), 15008),
    weighted_waypoints=(
        WeightedWaypoint(GatewayAddress(NamespacedHostname("ns1", "wp1"), 15008), 30),
        WeightedWaypoint(GatewayAddress(NamespacedHostname("ns1", "wp2"), 15008), 70),
    ),
    load_balancer=LoadBalancer(
        (LoadBalancingScope.NETWORK, LoadBalancingScope.ZONE),
        LoadBalancingMode.FAILOVER,
        HealthPolicy.ALLOW_ALL,
    ),
    ip_families=IPFamilies.DUAL,
    canonical=True,
    visibility=Visibility.NAMESPACE,
    ingress_use_waypoint=True,
)

FULL_POLICY = Authorization(
    name="p1",
    namespace="ns1",
    scope=Scope.WORKLOAD_SELECTOR,
    action=Action.DENY,
    rules=(
        (
            (
                Match(
                    namespaces=(StringMatch(StringMatchKind.EXACT, "ns2"),),
                    not_namespaces=(StringMatch(StringMatchKind.PREFIX, "kube-"),),
                    principals=(StringMatch(StringMatchKind.SUFFIX, "/sa/admin"),),
                    not_principals=(StringMatch(StringMatchKind.PRESENCE),),
                    source_ips=(net("10.0.0.0/8"), net("fd00::/16")),
                    not_source_ips=(net("10.1.2.3/32"),),
                    destination_ips=(net("0.0.0.0/0"),),
                    not_destination_ips=(net("::1/128"),),
                    destination_ports=(80, 443),
                    not_destination_ports=(9999,),
                    service_accounts=(ServiceAccountMatch("ns2", "sa2"),),
                    not_service_accounts=(ServiceAccountMatch("ns3", "sa3"),),
                ),
                Match(destination_ports=(8080,)),
            ),
            (Match(namespaces=(StringMatch(StringMatchKind.EXACT, "x"),)),),
        ),
        (),
    ),
    dry_run=True,
)


M = TypeVar("M", bound=Message)


def over_the_wire(message: M) -> M:
    """Serialize and parse, so the test sees what the peer would."""
    return type(message).FromString(message.SerializeToString())


def test_workload_round_trips_through_the_wire() -> None:
    pb = over_the_wire(convert.workload_to_wire(FULL_WORKLOAD))
    assert convert.workload_from_wire(pb) == FULL_WORKLOAD


def test_service_round_trips_through_the_wire() -> None:
    pb = over_the_wire(convert.service_to_wire(FULL_SERVICE))
    assert convert.service_from_wire(pb) == FULL_SERVICE


def test_authorization_round_trips_through_the_wire() -> None:
    pb = over_the_wire(convert.authorization_to_wire(FULL_POLICY))
    assert convert.authorization_from_wire(pb) == FULL_POLICY


def test_address_wraps_workloads_and_services() -> None:
    for item in (FULL_WORKLOAD, FULL_SERVICE):
        pb = over_the_wire(convert.address_to_wire(item))
        assert convert.address_from_wire(pb) == item
    assert convert.address_resource_name(FULL_WORKLOAD) == "cluster1//v1/Pod/ns1/pod-a"
    assert convert.address_resource_name(FULL_SERVICE) == "ns1/a.ns1.svc.cluster.local"
    with pytest.raises(ConversionError, match="neither workload nor service"):
        convert.address_from_wire(workload_pb2.Address())


def test_wire_field_numbers_carry_the_values() -> None:
    """What another implementation reads: the fields by number, not our names for them."""
    pb = convert.workload_to_wire(FULL_WORKLOAD)
    fields = {f.number: v for f, v in pb.ListFields()}
    assert fields[20] == "cluster1//v1/Pod/ns1/pod-a"
    assert fields[3] == [bytes([10, 0, 0, 1]), ipaddress.IPv6Address("fd00::1").packed]
    assert fields[5] == workload_pb2.HBONE
    assert fields[12] == workload_pb2.POD
    assert fields[27].value == 3
    policy = convert.authorization_to_wire(FULL_POLICY)
    match = policy.rules[0].clauses[0].matches[0]
    assert match.not_principals[0].WhichOneof("match_type") == "presence"
    assert (match.source_ips[0].address, match.source_ips[0].length) == (bytes([10, 0, 0, 0]), 8)


def test_local_config_example_serves_over_the_wire_unchanged() -> None:
    """The development control plane serves a local-config file: what the proxy decodes equals it,
    up to the defaults the reference applies to wire workloads."""
    cfg = load_local_config(Path(__file__).parent.parent / "examples" / "localhost.yaml")
    for w in cfg.workloads:
        back = convert.workload_from_wire(over_the_wire(convert.workload_to_wire(w)))
        assert back == w.__class__(
            **{
                **{f: getattr(w, f) for f in w.__dataclass_fields__},
                "workload_type": "deployment",
                "cluster_id": "Kubernetes",
            }
        )
    for s in cfg.services:
        assert convert.service_from_wire(over_the_wire(convert.service_to_wire(s))) == s
    for p in cfg.policies:
        assert convert.authorization_from_wire(over_the_wire(convert.authorization_to_wire(p))) == p


def test_empty_workload_takes_the_reference_defaults() -> None:
    w = convert.workload_from_wire(workload_pb2.Workload(uid="u"))
    assert (w.trust_domain, w.service_account, w.cluster_id, w.capacity) == (
        "cluster.local",
        "default",
        "Kubernetes",
        1,
    )
    assert w.workload_type == "deployment"
    assert w.application_tunnel is None
    assert w.waypoint is None and w.network_gateway is None
    assert w.identity_uri == "spiffe://cluster.local/ns//sa/default"


def test_capacity_zero_is_kept_when_present() -> None:
    pb = workload_pb2.Workload(uid="u", capacity=wrappers_pb2.UInt32Value(value=0))
    assert convert.workload_from_wire(pb).capacity == 0


def test_application_tunnel_port_zero_keeps_the_port() -> None:
    pb = workload_pb2.Workload(
        uid="u",
        application_tunnel=workload_pb2.ApplicationTunnel(protocol=workload_pb2.ApplicationTunnel.PROXY),
    )
    assert convert.workload_from_wire(pb).application_tunnel == ApplicationTunnel(
        AppTunnelProtocol.PROXY, None
    )


@pytest.mark.parametrize(("name", "number"), [("DEPLOYMENT", 0), ("CRONJOB", 1), ("POD", 2), ("JOB", 3)])
def test_workload_type_is_its_lowercased_name(name: str, number: int) -> None:
    pb = workload_pb2.Workload(uid="u", workload_type=number)  # type: ignore[arg-type]
    assert convert.workload_from_wire(pb).workload_type == name.lower()


def _workload(**fields: object) -> workload_pb2.Workload:
    pb = workload_pb2.Workload(uid="u")
    for key, value in fields.items():
        setattr(pb, key, value)
    return pb


def test_unknown_enum_numbers_are_refused() -> None:
    cases: list[tuple[object, str]] = [
        (_workload(tunnel_protocol=7), "unknown tunnel_protocol value 7"),
        (_workload(status=5), "unknown status value 5"),
        (_workload(network_mode=9), "unknown network_mode value 9"),
        (_workload(workload_type=8), "unknown workload_type value 8"),
        (authorization_pb2.Authorization(name="p", scope=4), "unknown scope value 4"),  # type: ignore[arg-type]
        (authorization_pb2.Authorization(name="p", action=2), "unknown action value 2"),  # type: ignore[arg-type]
        (
            workload_pb2.Service(name="s", namespace="ns", hostname="s.ns", ip_families=11),
            "unknown ip_families value 11",
        ),  # type: ignore[arg-type]
    ]
    for pb, reason in cases:
        with pytest.raises(ConversionError) as err:
            if isinstance(pb, workload_pb2.Workload):
                convert.workload_from_wire(pb)
            elif isinstance(pb, workload_pb2.Service):
                convert.service_from_wire(pb)
            else:
                assert isinstance(pb, authorization_pb2.Authorization)
                convert.authorization_from_wire(pb)
        assert err.value.reason == reason


def test_workload_refusals() -> None:
    with pytest.raises(ConversionError, match=r"invalid IP address: 3 bytes \(expected 4 or 16\)"):
        convert.workload_from_wire(workload_pb2.Workload(uid="u", addresses=[b"\x0a\x00\x00"]))
    pb = workload_pb2.Workload(uid="u")
    pb.services["no-slash"].ports.add(service_port=80, target_port=8080)
    with pytest.raises(ConversionError, match="invalid service key 'no-slash'"):
        convert.workload_from_wire(pb)
    with pytest.raises(ConversionError, match="LEGACY_ISTIO_MTLS"):
        convert.workload_from_wire(_workload(tunnel_protocol=workload_pb2.LEGACY_ISTIO_MTLS))
    pb = workload_pb2.Workload(uid="u")
    pb.waypoint.hbone_mtls_port = 15008  # a waypoint without destination
    with pytest.raises(ConversionError, match="gateway address has no destination"):
        convert.workload_from_wire(pb)


def test_service_refusals() -> None:
    lb = workload_pb2.LoadBalancing(routing_preference=["ZONE", "UNSPECIFIED_SCOPE"])
    with pytest.raises(ConversionError, match="UNSPECIFIED_SCOPE"):
        convert.service_from_wire(
            workload_pb2.Service(name="s", namespace="ns", hostname="s.ns", load_balancing=lb)
        )
    with pytest.raises(ConversionError, match="5 bytes"):
        convert.service_from_wire(
            workload_pb2.Service(
                name="s",
                namespace="ns",
                hostname="s.ns",
                addresses=[workload_pb2.NetworkAddress(address=b"12345")],
            )
        )
    with pytest.raises(ConversionError, match="weighted waypoint has no destination"):
        convert.service_from_wire(
            workload_pb2.Service(
                name="s",
                namespace="ns",
                hostname="s.ns",
                weighted_waypoints=[workload_pb2.WeightedWaypoint(weight=1)],
            )
        )


def test_unknown_visibility_is_public() -> None:
    pb = workload_pb2.Service(name="s", namespace="ns", hostname="s.ns")
    pb.visibility = 7  # type: ignore[assignment]
    assert convert.service_from_wire(pb).visibility is Visibility.PUBLIC


def test_full_length_vip_is_a_plain_vip() -> None:
    addr = workload_pb2.NetworkAddress(address=bytes([10, 96, 0, 1]), length=32)
    s = convert.service_from_wire(
        workload_pb2.Service(name="s", namespace="ns", hostname="s.ns", addresses=[addr])
    )
    assert s.vips == (NetworkAddress("", ip("10.96.0.1")),) and s.cidr_vips == ()


def test_policy_details_of_the_reference() -> None:
    pb = authorization_pb2.Authorization(name="p", namespace="ns")
    match = pb.rules.add().clauses.add().matches.add()
    match.principals.add()  # no oneof set: dropped
    match.principals.add(exact="cluster.local/ns/a/sa/b")
    match.destination_ports.extend([65535, 80])
    match.source_ips.add(address=bytes([192, 168, 1, 7]), length=0)  # /0, literally
    match.destination_ips.add(address=bytes([192, 168, 1, 7]), length=24)  # host bits allowed
    policy = convert.authorization_from_wire(pb)
    m = policy.rules[0][0][0]
    assert m.principals == (StringMatch(StringMatchKind.EXACT, "cluster.local/ns/a/sa/b"),)
    assert m.destination_ports == (65535, 80)
    assert m.source_ips == (net("0.0.0.0/0"),)
    assert m.destination_ips == (net("192.168.1.0/24"),)
    assert (policy.scope, policy.action) == (Scope.GLOBAL, Action.ALLOW)


def test_policy_refusals() -> None:
    pb = authorization_pb2.Authorization(name="p")
    pb.rules.add().clauses.add().matches.add().source_ips.add(address=b"\x01\x02\x03", length=8)
    with pytest.raises(ConversionError, match="3 bytes"):
        convert.authorization_from_wire(pb)
    pb = authorization_pb2.Authorization(name="p")
    pb.rules.add().clauses.add().matches.add().source_ips.add(address=bytes(4), length=33)
    with pytest.raises(ConversionError, match="invalid prefix length 33"):
        convert.authorization_from_wire(pb)


def test_local_config_shares_the_service_key_rule() -> None:
    text = """
workloads:
  - uid: u
    namespace: ns
    workloadIps: ["10.0.0.1"]
    services:
      nokey: {80: 8080}
"""
    with pytest.raises(
        ValueError, match=r"invalid service key 'nokey' \(expected '<namespace>/<hostname>'\)"
    ):
        parse_local_config(text)
