"""xDS conversion fed valid messages, then mutated: any field set to any value of its wire type
(out-of-range enums and ports, IPs of the wrong length, empty names), repeated fields cleared or
grown to thousands of entries, the encoding truncated or a byte flipped.

Each mutated resource goes to the real client (`XdsClient.handle_response`) beside a valid sibling:
the reply is an ACK, or a NACK that names the mutated resource only; the sibling is always applied;
what is applied keeps the model's rules. Then the findings of the first round, one test each.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable

import pytest
from google.protobuf import any_pb2
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError, Message
from hypothesis import given
from hypothesis import strategies as st

from mesh.model import ConversionError, GatewayAddress, NamespacedHostname, Service, Workload
from xds import convert
from xds.channel import node_from
from xds.client import XdsClient
from xds.gen.envoy.service.discovery.v3 import discovery_pb2
from xds.gen.istio.security import authorization_pb2
from xds.gen.istio.workload import workload_pb2
from ztunnel.state.store import ProxyState

TEXT = st.text(st.characters(codec="utf-8"), max_size=6)
NAME = st.text("abcz-./", min_size=1, max_size=6)
IP = st.one_of(st.binary(min_size=4, max_size=4), st.binary(min_size=16, max_size=16))
PORT = st.integers(0, 65535)


def _gateway(draw: st.DrawFn) -> workload_pb2.GatewayAddress:
    g = workload_pb2.GatewayAddress(hbone_mtls_port=draw(PORT))
    if draw(st.booleans()):
        g.address.network = draw(TEXT)
        g.address.address = draw(IP)
    else:
        g.hostname.namespace = draw(NAME)
        g.hostname.hostname = draw(NAME)
    return g


@st.composite
def workloads(draw: st.DrawFn) -> workload_pb2.Address:
    w = workload_pb2.Workload(
        uid=draw(NAME),
        name=draw(TEXT),
        namespace=draw(TEXT),
        addresses=draw(st.lists(IP, max_size=2)),
        hostname=draw(TEXT),
        tunnel_protocol=draw(st.sampled_from([0, 1])),  # type: ignore[arg-type]
        trust_domain=draw(TEXT),
        service_account=draw(TEXT),
        workload_type=draw(st.sampled_from([0, 1, 2, 3])),  # type: ignore[arg-type]
        status=draw(st.sampled_from([0, 1])),  # type: ignore[arg-type]
        network_mode=draw(st.sampled_from([0, 1])),  # type: ignore[arg-type]
        authorization_policies=draw(st.lists(NAME, max_size=2)),
    )
    if draw(st.booleans()):
        w.waypoint.CopyFrom(_gateway(draw))
    if draw(st.booleans()):
        w.application_tunnel.protocol = draw(st.sampled_from([0, 1]))  # type: ignore[assignment]
        w.application_tunnel.port = draw(PORT)
    for _ in range(draw(st.integers(0, 2))):
        w.services[f"{draw(NAME)}/{draw(NAME)}"].ports.add(service_port=draw(PORT), target_port=draw(PORT))
    return workload_pb2.Address(workload=w)


@st.composite
def services(draw: st.DrawFn) -> workload_pb2.Address:
    s = workload_pb2.Service(
        name=draw(NAME),
        namespace=draw(TEXT),
        hostname=draw(NAME),
        ports=[workload_pb2.Port(service_port=draw(PORT), target_port=draw(PORT))],
        subject_alt_names=draw(st.lists(TEXT, max_size=2)),
        ip_families=draw(st.sampled_from([0, 1, 2, 3])),  # type: ignore[arg-type]
    )
    for _ in range(draw(st.integers(0, 2))):
        ip = draw(IP)
        vip = s.addresses.add(network=draw(TEXT), address=ip)
        if draw(st.booleans()):
            vip.length = draw(st.integers(0, 8 * len(ip)))
    if draw(st.booleans()):
        s.load_balancing.routing_preference.extend(draw(st.lists(st.integers(1, 6), max_size=3)))
        s.load_balancing.mode = draw(st.sampled_from([0, 1, 2, 3]))  # type: ignore[assignment]
    if draw(st.booleans()):
        s.weighted_waypoints.add(destination=_gateway(draw), weight=draw(st.integers(0, 100)))
    return workload_pb2.Address(service=s)


@st.composite
def authorizations(draw: st.DrawFn) -> authorization_pb2.Authorization:
    p = authorization_pb2.Authorization(
        name=draw(NAME),
        namespace=draw(TEXT),
        scope=draw(st.sampled_from([0, 1, 2])),  # type: ignore[arg-type]
        action=draw(st.sampled_from([0, 1])),  # type: ignore[arg-type]
        dry_run=draw(st.booleans()),
    )
    for _ in range(draw(st.integers(0, 2))):
        m = p.rules.add().clauses.add().matches.add()
        m.principals.add(exact=draw(TEXT))
        m.not_namespaces.add(prefix=draw(TEXT))
        ip = draw(IP)
        m.source_ips.add(address=ip, length=draw(st.integers(0, 8 * len(ip))))
        m.destination_ports.extend(draw(st.lists(PORT, max_size=2)))
        m.service_accounts.add(namespace=draw(TEXT), serviceAccount=draw(TEXT))
    return p


# -- mutations ------------------------------------------------------------------------------------


def _is_map(f: FieldDescriptor) -> bool:
    return f.message_type is not None and f.message_type.GetOptions().map_entry


def _fields(msg: Message) -> list[tuple[Message, FieldDescriptor]]:
    """Every field of the message and of its present sub-messages (map entries included)."""
    out: list[tuple[Message, FieldDescriptor]] = []
    for f in msg.DESCRIPTOR.fields:
        out.append((msg, f))
        if f.type != FieldDescriptor.TYPE_MESSAGE:
            continue
        value = getattr(msg, f.name)
        if f.is_repeated:
            if not _is_map(f):
                items = list(value)
            elif f.message_type.fields_by_name["value"].type == FieldDescriptor.TYPE_MESSAGE:
                items = list(value.values())
            else:
                items = []
            for item in items:
                out.extend(_fields(item))
        elif msg.HasField(f.name):
            out.extend(_fields(value))
    return out


def _scalar(draw: st.DrawFn, f: FieldDescriptor) -> object:
    t = f.type
    if t == FieldDescriptor.TYPE_STRING:
        return draw(st.one_of(st.just(""), TEXT))
    if t == FieldDescriptor.TYPE_BYTES:
        return draw(st.binary(max_size=20))
    if t == FieldDescriptor.TYPE_BOOL:
        return draw(st.booleans())
    if t == FieldDescriptor.TYPE_ENUM:
        return draw(st.one_of(st.integers(-3, 12), st.integers(-(2**31), 2**31 - 1)))
    if t in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32):
        return draw(st.one_of(st.integers(65530, 65620), st.integers(0, 2**32 - 1)))
    if t in (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_SINT32, FieldDescriptor.TYPE_SFIXED32):
        return draw(st.integers(-(2**31), 2**31 - 1))
    if t in (FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64):
        return draw(st.integers(0, 2**64 - 1))
    return draw(st.integers(-(2**63), 2**63 - 1))


def _mutate_field(draw: st.DrawFn, msg: Message) -> None:
    holder, f = draw(st.sampled_from(_fields(msg)))
    value = getattr(holder, f.name)
    if f.is_repeated:
        if _is_map(f):
            holder.ClearField(f.name)
            return
        action = draw(st.sampled_from(["clear", "grow", "add"]))
        if action == "clear" or (action == "grow" and not value):
            holder.ClearField(f.name)
        elif action == "grow":  # huge repeated fields
            first = value[0]
            n = draw(st.integers(100, 3000))
            if f.type == FieldDescriptor.TYPE_MESSAGE:
                for _ in range(n):
                    value.add().CopyFrom(first)
            else:
                value.extend([first] * n)
        elif f.type == FieldDescriptor.TYPE_MESSAGE:
            value.add()
        else:
            value.append(_scalar(draw, f))
    elif f.type == FieldDescriptor.TYPE_MESSAGE:
        if draw(st.booleans()):
            holder.ClearField(f.name)
        else:
            value.SetInParent()
    else:
        setattr(holder, f.name, _scalar(draw, f))


@st.composite
def mutated(draw: st.DrawFn, valid: st.SearchStrategy[Message]) -> bytes:
    msg = draw(valid)
    for _ in range(draw(st.integers(1, 3))):
        _mutate_field(draw, msg)
    data = msg.SerializeToString()
    how = draw(st.sampled_from(["as is", "truncated", "flipped"]))
    if how == "truncated" and data:
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif how == "flipped" and data:
        i = draw(st.integers(0, len(data) - 1))
        data = data[:i] + bytes([data[i] ^ draw(st.integers(1, 255))]) + data[i + 1 :]
    return data


# -- the target -----------------------------------------------------------------------------------


SIBLING_WORKLOAD = workload_pb2.Address(
    workload=workload_pb2.Workload(uid="good-sibling", name="w", addresses=[bytes([10, 9, 9, 9])])
)
SIBLING_POLICY = authorization_pb2.Authorization(name="good-sibling", namespace="ns")


def _resource(name: str, message_or_bytes: Message | bytes, type_url: str) -> discovery_pb2.Resource:
    value = message_or_bytes if isinstance(message_or_bytes, bytes) else message_or_bytes.SerializeToString()
    return discovery_pb2.Resource(
        name=name, version="1", resource=any_pb2.Any(type_url=type_url, value=value)
    )


def _push(
    type_url: str, payload: bytes, sibling: Message
) -> tuple[ProxyState, discovery_pb2.DeltaDiscoveryRequest]:
    state = ProxyState()
    client = XdsClient("http://127.0.0.1:1", state, node_from())
    response = discovery_pb2.DeltaDiscoveryResponse(
        type_url=type_url,
        nonce="n",
        resources=[_resource("fuzzed", payload, type_url), _resource("good-sibling", sibling, type_url)],
    )
    reply = client.handle_response(response)
    assert reply.response_nonce == "n" and reply.type_url == type_url
    if reply.HasField("error_detail"):
        message = reply.error_detail.message
        assert message.startswith("fuzzed: ") and "good-sibling:" not in message, message
    return state, reply


def _check_workload(w: Workload) -> None:
    assert w.uid
    assert all(0 <= port <= 65535 for _, ports in w.services for pair in ports for port in pair)
    assert all(len(ip.packed) in (4, 16) for ip in w.addresses)
    if w.application_tunnel is not None and w.application_tunnel.port is not None:
        assert 0 < w.application_tunnel.port <= 65535
    for gateway in (w.waypoint, w.network_gateway):
        assert gateway is None or _reachable(gateway)


def _reachable(gateway: GatewayAddress) -> bool:
    """A gateway that routing could ever reach: a port, and a full name when it is named by one."""
    named = gateway.destination
    full = not isinstance(named, NamespacedHostname) or bool(named.namespace and named.hostname)
    return 0 < gateway.hbone_mtls_port <= 65535 and full


def _check_service(s: Service) -> None:
    assert s.name and s.namespace and s.hostname
    assert s.waypoint is None or _reachable(s.waypoint)
    assert all(_reachable(w.destination) for w in s.weighted_waypoints)
    assert all(0 <= port <= 65535 for pair in s.ports for port in pair)
    assert all(vip.cidr.prefixlen < vip.cidr.max_prefixlen for vip in s.cidr_vips)


@given(mutated(st.one_of(workloads(), services())))
def test_mutated_addresses_are_applied_or_nacked_by_name(payload: bytes) -> None:
    state, reply = _push(convert.ADDRESS_TYPE_URL, payload, SIBLING_WORKLOAD)
    assert state.workload_by_uid("good-sibling") is not None
    others = [w for w in state.workloads() if w.uid != "good-sibling"]
    if reply.HasField("error_detail"):
        assert not others and not state.services()
    for w in state.workloads():
        _check_workload(w)
    for s in state.services():
        _check_service(s)


@given(mutated(authorizations()))
def test_mutated_authorizations_are_applied_or_nacked_by_name(payload: bytes) -> None:
    state, reply = _push(convert.AUTHORIZATION_TYPE_URL, payload, SIBLING_POLICY)
    assert state.policy("ns/good-sibling") is not None
    if reply.HasField("error_detail"):
        assert len(state.policies()) == 1
    for p in state.policies():
        assert p.name
        for rule in p.rules:
            for clause in rule:
                for m in clause:
                    assert all(0 <= port <= 65535 for port in m.destination_ports + m.not_destination_ports)


@given(mutated(st.one_of(workloads(), services())))
def test_conversion_raises_only_its_own_errors(payload: bytes) -> None:
    try:
        convert.address_from_wire(workload_pb2.Address.FromString(payload))
    except (DecodeError, ConversionError):
        pass


# -- findings of the first round ------------------------------------------------------------------


def _workload(**fields: object) -> workload_pb2.Workload:
    base: dict[str, object] = {
        "uid": "u",
        "name": "w",
        "namespace": "ns",
        "addresses": [bytes([10, 0, 0, 1])],
    }
    return workload_pb2.Workload(**{**base, **fields})  # type: ignore[arg-type]


def _service(**fields: object) -> workload_pb2.Service:
    base: dict[str, object] = {"name": "s", "namespace": "ns", "hostname": "s.ns"}
    return workload_pb2.Service(**{**base, **fields})  # type: ignore[arg-type]


PORT_CASES: list[tuple[str, Callable[[], object]]] = [
    (
        "invalid service_port 65616",
        lambda: convert.service_from_wire(
            _service(ports=[workload_pb2.Port(service_port=65616, target_port=80)])
        ),
    ),
    (
        "invalid target_port 65616",
        lambda: convert.service_from_wire(
            _service(ports=[workload_pb2.Port(service_port=80, target_port=65616)])
        ),
    ),
    (
        "invalid application_tunnel.port 65616",
        lambda: convert.workload_from_wire(
            _workload(application_tunnel=workload_pb2.ApplicationTunnel(protocol=1, port=65616))  # type: ignore[arg-type]
        ),
    ),
    (
        "invalid gateway hbone_mtls_port 65616",
        lambda: convert.workload_from_wire(
            _workload(
                waypoint=workload_pb2.GatewayAddress(
                    address=workload_pb2.NetworkAddress(address=bytes([10, 0, 0, 9])), hbone_mtls_port=65616
                )
            )
        ),
    ),
]


@pytest.mark.parametrize(("reason", "convert_it"), PORT_CASES, ids=[c[0] for c in PORT_CASES])
def test_ports_above_65535_are_refused_not_wrapped(reason: str, convert_it: Callable[[], object]) -> None:
    with pytest.raises(ConversionError, match=f"^{reason} \\(expected 0..65535\\)$"):
        convert_it()


def test_a_workload_service_port_above_65535_is_refused() -> None:
    w = _workload()
    w.services["ns/s.ns"].ports.add(service_port=65616, target_port=80)
    with pytest.raises(ConversionError, match="service_port 65616"):
        convert.workload_from_wire(w)


def test_policy_ports_above_65535_are_refused() -> None:
    pb = authorization_pb2.Authorization(name="p", namespace="ns")
    pb.rules.add().clauses.add().matches.add().not_destination_ports.append(65616)
    with pytest.raises(ConversionError, match="not_destination_ports 65616"):
        convert.authorization_from_wire(pb)


def test_a_vip_prefix_longer_than_its_address_is_refused() -> None:
    pb = _service(addresses=[workload_pb2.NetworkAddress(address=bytes([10, 96, 0, 1]), length=33)])
    with pytest.raises(ConversionError, match=r"invalid prefix length 33 for 10\.96\.0\.1"):
        convert.service_from_wire(pb)
    full = convert.service_from_wire(
        _service(addresses=[workload_pb2.NetworkAddress(address=bytes([10, 96, 0, 1]), length=32)])
    )
    assert [vip.address for vip in full.vips] == [ipaddress.ip_address("10.96.0.1")] and not full.cidr_vips


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        (workload_pb2.Address(workload=_workload(uid="")), "workload uid is empty"),
        (workload_pb2.Address(service=_service(name="")), "service name is empty"),
        (workload_pb2.Address(service=_service(hostname="")), "service hostname is empty"),
        (workload_pb2.Address(service=_service(namespace="")), "service namespace is empty"),
    ],
)
def test_empty_keys_are_refused(message: workload_pb2.Address, reason: str) -> None:
    with pytest.raises(ConversionError, match=f"^{reason}$"):
        convert.address_from_wire(message)
    with pytest.raises(ConversionError, match=r"^authorization name is empty$"):
        convert.authorization_from_wire(authorization_pb2.Authorization(namespace="ns"))


def test_refusals_are_nacks_naming_the_resource_while_siblings_apply() -> None:
    state = ProxyState()
    client = XdsClient("http://127.0.0.1:1", state, node_from())
    wrapped = _service(ports=[workload_pb2.Port(service_port=65616, target_port=80)])
    long_vip = _service(
        hostname="long.ns", addresses=[workload_pb2.NetworkAddress(address=bytes([10, 96, 0, 1]), length=40)]
    )
    good = _service(hostname="good.ns", ports=[workload_pb2.Port(service_port=80, target_port=8080)])
    url = convert.ADDRESS_TYPE_URL
    reply = client.handle_response(
        discovery_pb2.DeltaDiscoveryResponse(
            type_url=url,
            nonce="n1",
            resources=[
                _resource("ns/s.ns", workload_pb2.Address(service=wrapped), url),
                _resource("no-uid", workload_pb2.Address(workload=_workload(uid="")), url),
                _resource("ns/long.ns", workload_pb2.Address(service=long_vip), url),
                _resource("ns/good.ns", workload_pb2.Address(service=good), url),
            ],
        )
    )
    assert reply.error_detail.message.split("; ") == [
        "ns/s.ns: invalid service_port 65616 (expected 0..65535)",
        "no-uid: workload uid is empty",
        "ns/long.ns: invalid prefix length 40 for 10.96.0.1 (expected 0..32)",
    ]
    assert [s.key for s in state.services()] == ["ns/good.ns"] and not state.workloads()
    assert state.services()[0].ports == ((80, 8080),)


def _waypoint(
    port: int = 15008, *, namespace: str = "ns", hostname: str = "wp.ns"
) -> workload_pb2.GatewayAddress:
    named = workload_pb2.NamespacedHostname(namespace=namespace, hostname=hostname)
    return workload_pb2.GatewayAddress(hostname=named, hbone_mtls_port=port)


def test_what_could_never_be_routed_to_is_nacked_by_name_while_siblings_apply() -> None:
    """A waypoint or network gateway on port 0, or named by a hostname without its name or
    namespace, and a service without a namespace: each NACKed with why, the valid ones applied."""
    state = ProxyState()
    client = XdsClient("http://127.0.0.1:1", state, node_from())
    url = convert.ADDRESS_TYPE_URL
    by_ip = workload_pb2.GatewayAddress(address=workload_pb2.NetworkAddress(address=bytes([10, 0, 0, 9])))
    weighted = workload_pb2.WeightedWaypoint(destination=_waypoint(0), weight=1)
    bad = {
        "w-port-0": workload_pb2.Address(workload=_workload(uid="w-port-0", waypoint=_waypoint(0))),
        "w-gateway-port-0": workload_pb2.Address(
            workload=_workload(uid="w-gateway-port-0", network_gateway=by_ip)
        ),
        "w-no-namespace": workload_pb2.Address(
            workload=_workload(uid="w-no-namespace", waypoint=_waypoint(namespace=""))
        ),
        "w-no-hostname": workload_pb2.Address(
            workload=_workload(uid="w-no-hostname", waypoint=_waypoint(hostname=""))
        ),
        "/s.ns": workload_pb2.Address(service=_service(namespace="")),
        "ns/port-0.ns": workload_pb2.Address(service=_service(hostname="port-0.ns", waypoint=_waypoint(0))),
        "ns/weighted.ns": workload_pb2.Address(
            service=_service(hostname="weighted.ns", weighted_waypoints=[weighted])
        ),
    }
    good = {
        "w-good": workload_pb2.Address(workload=_workload(uid="w-good", waypoint=_waypoint())),
        "ns/good.ns": workload_pb2.Address(service=_service(hostname="good.ns", waypoint=_waypoint())),
    }
    reply = client.handle_response(
        discovery_pb2.DeltaDiscoveryResponse(
            type_url=url,
            nonce="n1",
            resources=[_resource(name, message, url) for name, message in {**bad, **good}.items()],
        )
    )
    port_0 = "gateway hbone_mtls_port is 0: the gateway can never be reached"
    assert reply.error_detail.message.split("; ") == [
        f"w-port-0: {port_0}",
        f"w-gateway-port-0: {port_0}",
        "w-no-namespace: gateway hostname's namespace is empty",
        "w-no-hostname: gateway hostname is empty",
        "/s.ns: service namespace is empty",
        f"ns/port-0.ns: {port_0}",
        f"ns/weighted.ns: {port_0}",
    ]
    assert [w.uid for w in state.workloads()] == ["w-good"]
    assert [s.key for s in state.services()] == ["ns/good.ns"]
