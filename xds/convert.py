"""Conversion between the wire messages of a control plane and the in-memory model.

Wire to model: `address_from_wire` (an `istio.workload.Address`), `workload_from_wire`,
`service_from_wire` and `authorization_from_wire`. They apply the reference's defaults (empty trust
domain `cluster.local`, empty service account `default`, empty cluster id `Kubernetes`, absent capacity
1, application tunnel port 0 as "keep the port", workload type as its lowercased name) and raise
`ConversionError(reason)` for what the reference rejects: an unknown enum number, an IP that is not
4 or 16 bytes, a `services` key without `/`, `LEGACY_ISTIO_MTLS`, a gateway without destination,
`UNSPECIFIED_SCOPE` among the routing preferences. Ours, stricter: a port above 65535 (the reference
truncates it to 16 bits, so 65616 would become 80, also in a policy), a prefix length longer than its
address (a VIP too), an empty key (workload uid, service name, namespace or hostname, policy name),
and what could never be routed to: a gateway (waypoint or network gateway) on port 0 or named by a
hostname without its name or namespace. The xDS client turns that into a NACK of the one resource.

Model to wire: `workload_to_wire`, `service_to_wire`, `address_to_wire`, `authorization_to_wire`, for
the development control plane that serves a local-config file over xDS.

The few rules both this module and the local-config loader (`mesh.localconfig`) enforce live once, in
`mesh.model`: `ip_from_bytes`, `cidr`, `check_service_key`, `app_tunnel_port`. The model's enums carry
the proto numbers, so an enum converts with `Enum(number)` and nothing else.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from enum import IntEnum
from typing import Any, TypeVar

from google.protobuf import empty_pb2, wrappers_pb2

from mesh.model import (
    ApplicationTunnel,
    AppTunnelProtocol,
    CidrVip,
    ConversionError,
    GatewayAddress,
    HealthPolicy,
    IPFamilies,
    IPNetwork,
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
    app_tunnel_port,
    check_service_key,
    cidr,
    cidr_from_bytes,
    ip_from_bytes,
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
from xds.gen.istio.security import authorization_pb2
from xds.gen.istio.workload import workload_pb2

ADDRESS_TYPE_URL = "type.googleapis.com/istio.workload.Address"
AUTHORIZATION_TYPE_URL = "type.googleapis.com/istio.security.Authorization"

DEFAULT_TRUST_DOMAIN = "cluster.local"
DEFAULT_SERVICE_ACCOUNT = "default"
DEFAULT_CLUSTER_ID = "Kubernetes"
DEFAULT_CAPACITY = 1

_U16 = 0xFFFF

E = TypeVar("E", bound=IntEnum)
T = TypeVar("T")


# --- wire to model ------------------------------------------------------------------------------


def _port(value: int, field: str) -> int:
    """A port from a uint32 field: above 65535 it is an error, never wrapped (65616 is not 80)."""
    if value > _U16:
        raise ConversionError(f"invalid {field} {value} (expected 0..65535)")
    return value


def _required(value: str, field: str) -> str:
    if not value:
        raise ConversionError(f"{field} is empty")
    return value


# Each enum's members by number: a dictionary lookup, where `Kind(number)` costs a microsecond (three
# enums a workload, 100,000 workloads in a cluster's first push).
_MEMBERS: dict[type[IntEnum], dict[int, IntEnum]] = {}


def _enum(kind: type[E], value: int, field: str) -> E:
    members = _MEMBERS.get(kind)
    if members is None:
        members = _MEMBERS[kind] = {int(m): m for m in kind}
    member = members.get(value)
    if member is None:
        raise ConversionError(f"unknown {field} value {value}")
    return member  # type: ignore[return-value]


def address_from_wire(pb: workload_pb2.Address) -> Workload | Service:
    which = pb.WhichOneof("type")
    if which == "workload":
        return workload_from_wire(pb.workload)
    if which == "service":
        return service_from_wire(pb.service)
    raise ConversionError("address has neither workload nor service")


def _network_address(pb: workload_pb2.NetworkAddress) -> NetworkAddress:
    return NetworkAddress(pb.network, ip_from_bytes(pb.address))


def _gateway(pb: workload_pb2.GatewayAddress) -> GatewayAddress:
    """A waypoint or network gateway; one that can never be reached (port 0, a hostname without
    its name or namespace) is refused rather than routed to."""
    which = pb.WhichOneof("destination")
    destination: NetworkAddress | NamespacedHostname
    if which == "hostname":
        destination = NamespacedHostname(
            _required(pb.hostname.namespace, "gateway hostname's namespace"),
            _required(pb.hostname.hostname, "gateway hostname"),
        )
    elif which == "address":
        destination = _network_address(pb.address)
    else:
        raise ConversionError("gateway address has no destination")
    port = _port(pb.hbone_mtls_port, "gateway hbone_mtls_port")
    if port == 0:
        raise ConversionError("gateway hbone_mtls_port is 0: the gateway can never be reached")
    return GatewayAddress(destination=destination, hbone_mtls_port=port)


def _optional_gateway(holder: object, field: str) -> GatewayAddress | None:
    # HasField: an absent waypoint is no waypoint; a present one without destination is an error.
    if not holder.HasField(field):  # type: ignore[attr-defined]
        return None
    return _gateway(getattr(holder, field))


def _ports(ports: object) -> tuple[tuple[int, int], ...]:
    return tuple(
        (_port(p.service_port, "service_port"), _port(p.target_port, "target_port"))
        for p in ports  # type: ignore[attr-defined]
    )


# A cluster's workloads repeat the same few strings (namespaces, service accounts, nodes, the trust
# domain, service keys) and port maps: each converted message would hold its own copies, some 700
# bytes a workload. Strings are interned (the interpreter drops them with their last user); port
# maps and localities are shared through a table emptied whenever it fills.
_intern = sys.intern
_SHARED_KEPT = 4096
_shared: dict[object, Any] = {}


def _share(value: T) -> T:
    kept = _shared.get(value)
    if kept is not None:
        return kept  # type: ignore[no-any-return]
    if len(_shared) >= _SHARED_KEPT:
        _shared.clear()
    _shared[value] = value
    return value


# The port maps already converted, by their wire bytes: a cluster's workloads repeat a few (every
# endpoint of a service has the same), and a lookup is cheaper than reading the ports again.
_port_maps: dict[bytes, tuple[tuple[int, int], ...]] = {}


def _port_map(port_list: workload_pb2.PortList) -> tuple[tuple[int, int], ...]:
    wire = port_list.SerializeToString()
    kept = _port_maps.get(wire)
    if kept is None:
        kept = _share(_ports(port_list.ports))
        if len(_port_maps) >= _SHARED_KEPT:
            _port_maps.clear()
        _port_maps[wire] = kept
    return kept


def _key(item: tuple[str, object]) -> str:
    return item[0]


def _memberships(pb: workload_pb2.Workload) -> tuple[tuple[str, tuple[tuple[int, int], ...]], ...]:
    services = pb.services
    if not services:
        return ()
    # A protobuf map has no order; sorted, the same message always gives an equal Workload.
    return tuple(
        (_intern(check_service_key(key)), _port_map(ports))
        for key, ports in sorted(services.items(), key=_key)
    )


# `WorkloadType` numbers to the model's lowercased names.
_WORKLOAD_TYPE_NAMES = {number: _intern(name.lower()) for name, number in workload_pb2.WorkloadType.items()}
_NO_LOCALITY = Locality()


def _locality(pb: workload_pb2.Workload) -> Locality:
    if not pb.HasField("locality"):
        return _NO_LOCALITY
    loc = pb.locality
    return _share(Locality(loc.region, loc.zone, loc.subzone))


def workload_from_wire(pb: workload_pb2.Workload) -> Workload:
    tunnel_protocol = _enum(TunnelProtocol, pb.tunnel_protocol, "tunnel_protocol")
    if tunnel_protocol is TunnelProtocol.LEGACY_ISTIO_MTLS:
        raise ConversionError("unsupported tunnel protocol LEGACY_ISTIO_MTLS")
    workload_type = _WORKLOAD_TYPE_NAMES.get(pb.workload_type)
    if workload_type is None:
        raise ConversionError(f"unknown workload_type value {pb.workload_type}")
    application_tunnel = None
    if pb.HasField("application_tunnel"):
        tunnel = pb.application_tunnel
        application_tunnel = ApplicationTunnel(
            protocol=_enum(AppTunnelProtocol, tunnel.protocol, "application_tunnel.protocol"),
            port=app_tunnel_port(_port(tunnel.port, "application_tunnel.port")),
        )
    return Workload(
        uid=_required(pb.uid, "workload uid"),
        name=pb.name,
        namespace=_intern(pb.namespace),
        addresses=tuple(map(ip_from_bytes, pb.addresses)),
        hostname=pb.hostname,
        network=_intern(pb.network),
        tunnel_protocol=tunnel_protocol,
        trust_domain=_intern(pb.trust_domain or DEFAULT_TRUST_DOMAIN),
        service_account=_intern(pb.service_account or DEFAULT_SERVICE_ACCOUNT),
        waypoint=_optional_gateway(pb, "waypoint"),
        network_gateway=_optional_gateway(pb, "network_gateway"),
        node=_intern(pb.node),
        canonical_name=_intern(pb.canonical_name),
        canonical_revision=_intern(pb.canonical_revision),
        workload_type=workload_type,
        workload_name=_intern(pb.workload_name),
        native_tunnel=pb.native_tunnel,
        application_tunnel=application_tunnel,
        services=_memberships(pb),
        authorization_policies=tuple(_intern(p) for p in pb.authorization_policies),
        status=_enum(WorkloadStatus, pb.status, "status"),
        cluster_id=_intern(pb.cluster_id or DEFAULT_CLUSTER_ID),
        locality=_locality(pb),
        network_mode=_enum(NetworkMode, pb.network_mode, "network_mode"),
        capacity=pb.capacity.value if pb.HasField("capacity") else DEFAULT_CAPACITY,
    )


def _load_balancer(pb: workload_pb2.LoadBalancing) -> LoadBalancer:
    preferences = []
    for number in pb.routing_preference:
        scope = _enum(LoadBalancingScope, number, "load_balancing.routing_preference")
        if scope is LoadBalancingScope.UNSPECIFIED_SCOPE:
            raise ConversionError("load_balancing.routing_preference contains UNSPECIFIED_SCOPE")
        preferences.append(scope)
    return LoadBalancer(
        routing_preferences=tuple(preferences),
        mode=_enum(LoadBalancingMode, pb.mode, "load_balancing.mode"),
        health_policy=_enum(HealthPolicy, pb.health_policy, "load_balancing.health_policy"),
    )


def _weighted_waypoint(pb: workload_pb2.WeightedWaypoint) -> WeightedWaypoint:
    if not pb.HasField("destination"):
        raise ConversionError("weighted waypoint has no destination")
    return WeightedWaypoint(destination=_gateway(pb.destination), weight=pb.weight)


def service_from_wire(pb: workload_pb2.Service) -> Service:
    vips: list[NetworkAddress] = []
    cidr_vips: list[CidrVip] = []
    for addr in pb.addresses:
        ip = ip_from_bytes(addr.address)
        # A VIP with a prefix shorter than the full address is a CIDR range of VIPs; a longer one is
        # an error (`cidr` says so), not a plain VIP.
        if addr.HasField("length") and addr.length != ip.max_prefixlen:
            cidr_vips.append(CidrVip(addr.network, cidr(ip, addr.length)))
        else:
            vips.append(NetworkAddress(addr.network, ip))
    try:
        visibility = Visibility(pb.visibility)
    except ValueError:
        visibility = Visibility.PUBLIC  # as the reference: an unknown visibility is public
    return Service(
        name=_required(pb.name, "service name"),
        namespace=_required(pb.namespace, "service namespace"),
        hostname=_required(pb.hostname, "service hostname"),
        vips=tuple(vips),
        cidr_vips=tuple(cidr_vips),
        ports=_ports(pb.ports),
        subject_alt_names=tuple(pb.subject_alt_names),
        waypoint=_optional_gateway(pb, "waypoint"),
        weighted_waypoints=tuple(_weighted_waypoint(w) for w in pb.weighted_waypoints),
        load_balancer=_load_balancer(pb.load_balancing) if pb.HasField("load_balancing") else None,
        ip_families=_enum(IPFamilies, pb.ip_families, "ip_families"),
        canonical=pb.canonical,
        visibility=visibility,
        ingress_use_waypoint=pb.ingress_use_waypoint,
    )


_STRING_MATCH_KINDS = {
    "exact": StringMatchKind.EXACT,
    "prefix": StringMatchKind.PREFIX,
    "suffix": StringMatchKind.SUFFIX,
    "presence": StringMatchKind.PRESENCE,
}


def _string_matches(items: object) -> tuple[StringMatch, ...]:
    out = []
    for m in items:  # type: ignore[attr-defined]
        which = m.WhichOneof("match_type")
        if which is None:
            continue  # as the reference: a match with nothing set is dropped
        kind = _STRING_MATCH_KINDS[which]
        out.append(
            StringMatch(kind) if kind is StringMatchKind.PRESENCE else StringMatch(kind, getattr(m, which))
        )
    return tuple(out)


def _cidrs(items: object) -> tuple[IPNetwork, ...]:
    return tuple(cidr_from_bytes(a.address, a.length) for a in items)  # type: ignore[attr-defined]


def _service_accounts(items: object) -> tuple[ServiceAccountMatch, ...]:
    return tuple(ServiceAccountMatch(sa.namespace, sa.serviceAccount) for sa in items)  # type: ignore[attr-defined]


def _ports_of(field: str) -> Callable[[object], tuple[int, ...]]:
    def read(items: object) -> tuple[int, ...]:
        return tuple(_port(p, field) for p in items)  # type: ignore[attr-defined]

    return read


_MATCH_FIELDS: dict[str, Callable[[object], tuple[object, ...]]] = {
    "namespaces": _string_matches,
    "not_namespaces": _string_matches,
    "principals": _string_matches,
    "not_principals": _string_matches,
    "source_ips": _cidrs,
    "not_source_ips": _cidrs,
    "destination_ips": _cidrs,
    "not_destination_ips": _cidrs,
    "destination_ports": _ports_of("destination_ports"),
    "not_destination_ports": _ports_of("not_destination_ports"),
    "service_accounts": _service_accounts,
    "not_service_accounts": _service_accounts,
}


def _match(pb: authorization_pb2.Match) -> Match:
    # Only the fields present (`ListFields`): a big policy is mostly entries with one field set,
    # and reading all twelve of each costs more than converting the one. Extensions are ignored.
    fields = {}
    for descriptor, value in pb.ListFields():
        read = _MATCH_FIELDS.get(descriptor.name)
        if read is not None:
            fields[descriptor.name] = read(value)
    return Match(**fields)  # type: ignore[arg-type]


def authorization_from_wire(pb: authorization_pb2.Authorization) -> Authorization:
    return Authorization(
        name=_required(pb.name, "authorization name"),
        namespace=pb.namespace,
        scope=_enum(Scope, pb.scope, "scope"),
        action=_enum(Action, pb.action, "action"),
        rules=tuple(
            tuple(tuple(_match(m) for m in clause.matches) for clause in rule.clauses) for rule in pb.rules
        ),
        dry_run=pb.dry_run,
    )


# --- model to wire ------------------------------------------------------------------------------


def _network_address_to_wire(addr: NetworkAddress) -> workload_pb2.NetworkAddress:
    return workload_pb2.NetworkAddress(network=addr.network, address=addr.address.packed)


def _gateway_to_wire(gateway: GatewayAddress) -> workload_pb2.GatewayAddress:
    pb = workload_pb2.GatewayAddress(hbone_mtls_port=gateway.hbone_mtls_port)
    destination = gateway.destination
    if isinstance(destination, NamespacedHostname):
        pb.hostname.namespace = destination.namespace
        pb.hostname.hostname = destination.hostname
    else:
        pb.address.CopyFrom(_network_address_to_wire(destination))
    return pb


def _ports_to_wire(ports: tuple[tuple[int, int], ...]) -> list[workload_pb2.Port]:
    return [workload_pb2.Port(service_port=svc, target_port=target) for svc, target in ports]


_WORKLOAD_TYPES = {name.lower(): number for name, number in workload_pb2.WorkloadType.items()}


def workload_to_wire(w: Workload) -> workload_pb2.Workload:
    """The wire form of a workload. A workload type the proto has no name for (the local config
    takes any string) goes out as DEPLOYMENT, the proto's default."""
    pb = workload_pb2.Workload(
        uid=w.uid,
        name=w.name,
        namespace=w.namespace,
        addresses=[ip.packed for ip in w.addresses],
        hostname=w.hostname,
        network=w.network,
        tunnel_protocol=w.tunnel_protocol.name,
        trust_domain=w.trust_domain,
        service_account=w.service_account,
        node=w.node,
        canonical_name=w.canonical_name,
        canonical_revision=w.canonical_revision,
        workload_type=_WORKLOAD_TYPES.get(w.workload_type.lower(), workload_pb2.DEPLOYMENT),
        workload_name=w.workload_name,
        native_tunnel=w.native_tunnel,
        authorization_policies=list(w.authorization_policies),
        status=w.status.name,
        cluster_id=w.cluster_id,
        network_mode=w.network_mode.name,
        capacity=wrappers_pb2.UInt32Value(value=w.capacity),
    )
    if w.waypoint is not None:
        pb.waypoint.CopyFrom(_gateway_to_wire(w.waypoint))
    if w.network_gateway is not None:
        pb.network_gateway.CopyFrom(_gateway_to_wire(w.network_gateway))
    if w.application_tunnel is not None:
        pb.application_tunnel.CopyFrom(
            workload_pb2.ApplicationTunnel(
                protocol=w.application_tunnel.protocol.name, port=w.application_tunnel.port or 0
            )
        )
    for key, ports in w.services:
        pb.services[key].ports.extend(_ports_to_wire(ports))
    if w.locality != Locality():
        pb.locality.region = w.locality.region
        pb.locality.zone = w.locality.zone
        pb.locality.subzone = w.locality.subzone
    return pb


def service_to_wire(s: Service) -> workload_pb2.Service:
    """The wire form of a service. The wire has no endpoint list: a service's `endpoints` (local
    config) are not sent; over xDS a workload names its services in its own `services` map."""
    pb = workload_pb2.Service(
        name=s.name,
        namespace=s.namespace,
        hostname=s.hostname,
        addresses=[_network_address_to_wire(vip) for vip in s.vips]
        + [
            workload_pb2.NetworkAddress(
                network=vip.network, address=vip.cidr.network_address.packed, length=vip.cidr.prefixlen
            )
            for vip in s.cidr_vips
        ],
        ports=_ports_to_wire(s.ports),
        subject_alt_names=list(s.subject_alt_names),
        ip_families=s.ip_families.name,
        canonical=s.canonical,
        weighted_waypoints=[
            workload_pb2.WeightedWaypoint(destination=_gateway_to_wire(w.destination), weight=w.weight)
            for w in s.weighted_waypoints
        ],
        visibility=s.visibility.name,
        ingress_use_waypoint=s.ingress_use_waypoint,
    )
    if s.waypoint is not None:
        pb.waypoint.CopyFrom(_gateway_to_wire(s.waypoint))
    lb = s.load_balancer
    if lb is not None:
        pb.load_balancing.CopyFrom(
            workload_pb2.LoadBalancing(
                routing_preference=[scope.name for scope in lb.routing_preferences],
                mode=lb.mode.name,
                health_policy=lb.health_policy.name,
            )
        )
    return pb


def address_to_wire(item: Workload | Service) -> workload_pb2.Address:
    if isinstance(item, Workload):
        return workload_pb2.Address(workload=workload_to_wire(item))
    return workload_pb2.Address(service=service_to_wire(item))


def address_resource_name(item: Workload | Service) -> str:
    """The xDS resource name of an Address: a workload's uid, a service's `namespace/hostname`."""
    return item.uid if isinstance(item, Workload) else item.key


def _string_match_to_wire(m: StringMatch) -> authorization_pb2.StringMatch:
    if m.kind is StringMatchKind.PRESENCE:
        return authorization_pb2.StringMatch(presence=empty_pb2.Empty())
    return authorization_pb2.StringMatch(**{m.kind.value.lower(): m.value})


def _cidr_to_wire(net: IPNetwork) -> authorization_pb2.Address:
    return authorization_pb2.Address(address=net.network_address.packed, length=net.prefixlen)


def _service_account_to_wire(sa: ServiceAccountMatch) -> authorization_pb2.ServiceAccountMatch:
    return authorization_pb2.ServiceAccountMatch(namespace=sa.namespace, serviceAccount=sa.service_account)


def _match_to_wire(m: Match) -> authorization_pb2.Match:
    return authorization_pb2.Match(
        namespaces=[_string_match_to_wire(x) for x in m.namespaces],
        not_namespaces=[_string_match_to_wire(x) for x in m.not_namespaces],
        principals=[_string_match_to_wire(x) for x in m.principals],
        not_principals=[_string_match_to_wire(x) for x in m.not_principals],
        source_ips=[_cidr_to_wire(n) for n in m.source_ips],
        not_source_ips=[_cidr_to_wire(n) for n in m.not_source_ips],
        destination_ips=[_cidr_to_wire(n) for n in m.destination_ips],
        not_destination_ips=[_cidr_to_wire(n) for n in m.not_destination_ips],
        destination_ports=list(m.destination_ports),
        not_destination_ports=list(m.not_destination_ports),
        service_accounts=[_service_account_to_wire(sa) for sa in m.service_accounts],
        not_service_accounts=[_service_account_to_wire(sa) for sa in m.not_service_accounts],
    )


def authorization_to_wire(p: Authorization) -> authorization_pb2.Authorization:
    return authorization_pb2.Authorization(
        name=p.name,
        namespace=p.namespace,
        scope=p.scope.name,
        action=p.action.name,
        rules=[
            authorization_pb2.Rule(
                clauses=[
                    authorization_pb2.Clause(matches=[_match_to_wire(m) for m in clause]) for clause in rule
                ]
            )
            for rule in p.rules
        ],
        dry_run=p.dry_run,
    )
