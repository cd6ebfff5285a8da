"""The records of a state image (`ztunnel.state.image`): each workload, service and service's
memberships as a tuple of plain values (str, int, bytes, None, tuples) that `marshal` writes, and
back. Field by field, in the model's order (tests/test_state_image.py checks that every field is
here)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from mesh.model import (
    ApplicationTunnel,
    AppTunnelProtocol,
    CidrVip,
    Endpoint,
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
    cidr_from_bytes,
    ip_from_bytes,
)

# Bumped whenever a record is written otherwise with the same model (an enum by another value, a
# field in another shape): `layout()` follows the model's fields by itself.
FORMAT = 1


def layout() -> str:
    """The records' layout, spelled out: `FORMAT` and the fields (names and types, in order) of every
    class of the model a record writes. An image names it (by its crc32), so a process of another
    build never reads another layout's records as its own."""
    classes: tuple[type, ...] = (Workload, Service, Endpoint, GatewayAddress, NetworkAddress)
    classes += (NamespacedHostname, ApplicationTunnel, Locality, CidrVip, WeightedWaypoint, LoadBalancer)
    fields = [(c.__name__, [(f.name, str(f.type)) for f in dataclasses.fields(c)]) for c in classes]
    return repr((FORMAT, fields))


def _gateway(g: GatewayAddress | None) -> tuple[Any, ...] | None:
    if g is None:
        return None
    d = g.destination
    if isinstance(d, NetworkAddress):
        return (0, d.network, d.address.packed, g.hbone_mtls_port)
    return (1, d.namespace, d.hostname, g.hbone_mtls_port)


def _gateway_of(t: tuple[Any, ...] | None) -> GatewayAddress | None:
    if t is None:
        return None
    kind, a, b, port = t
    dest = NetworkAddress(a, ip_from_bytes(b)) if kind == 0 else NamespacedHostname(a, b)
    return GatewayAddress(dest, port)


def _endpoint(e: Endpoint) -> tuple[Any, ...]:
    return (e.workload_uid, e.port, int(e.status))


def _endpoint_of(t: tuple[Any, ...]) -> Endpoint:
    return Endpoint(t[0], t[1], WorkloadStatus(t[2]))


def workload_record(w: Workload) -> tuple[Any, ...]:
    app = w.application_tunnel
    loc = w.locality
    return (
        w.uid, w.name, w.namespace, tuple(ip.packed for ip in w.addresses), w.hostname, w.network,
        int(w.tunnel_protocol), w.trust_domain, w.service_account, _gateway(w.waypoint),
        _gateway(w.network_gateway), w.node, w.canonical_name, w.canonical_revision, w.workload_type,
        w.workload_name, w.native_tunnel, None if app is None else (int(app.protocol), app.port),
        w.services, w.authorization_policies, int(w.status), w.cluster_id,
        (loc.region, loc.zone, loc.subzone), int(w.network_mode), w.capacity,
    )  # fmt: skip


def workload_of(t: tuple[Any, ...]) -> Workload:
    (uid, name, namespace, addresses, hostname, network, tunnel, trust_domain, service_account, waypoint,
     gateway, node, canonical_name, canonical_revision, workload_type, workload_name, native_tunnel, app,
     services, policies, status, cluster_id, locality, network_mode, capacity) = t  # fmt: skip
    return Workload(
        uid, name, namespace, tuple(ip_from_bytes(a) for a in addresses), hostname, network,
        TunnelProtocol(tunnel), trust_domain, service_account, _gateway_of(waypoint), _gateway_of(gateway),
        node, canonical_name, canonical_revision, workload_type, workload_name, native_tunnel,
        None if app is None else ApplicationTunnel(AppTunnelProtocol(app[0]), app[1]), services, policies,
        WorkloadStatus(status), cluster_id, Locality(*locality), NetworkMode(network_mode), capacity,
    )  # fmt: skip


def service_record(s: Service) -> tuple[Any, ...]:
    lb = s.load_balancer
    return (
        s.name, s.namespace, s.hostname, tuple((v.network, v.address.packed) for v in s.vips),
        tuple((c.network, c.cidr.network_address.packed, c.cidr.prefixlen) for c in s.cidr_vips), s.ports,
        s.subject_alt_names, _gateway(s.waypoint),
        tuple((_gateway(w.destination), w.weight) for w in s.weighted_waypoints),
        None if lb is None else (tuple(int(p) for p in lb.routing_preferences), int(lb.mode), int(lb.health_policy)),
        int(s.ip_families), s.canonical, int(s.visibility), tuple(_endpoint(e) for e in s.endpoints),
        s.ingress_use_waypoint,
    )  # fmt: skip


def service_of(t: tuple[Any, ...]) -> Service:
    (name, namespace, hostname, vips, cidr_vips, ports, sans, waypoint, weighted, lb, ip_families,
     canonical, visibility, endpoints, ingress_use_waypoint) = t  # fmt: skip
    return Service(
        name, namespace, hostname, tuple(NetworkAddress(n, ip_from_bytes(a)) for n, a in vips),
        tuple(CidrVip(n, cidr_from_bytes(a, length)) for n, a, length in cidr_vips), ports, sans,
        _gateway_of(waypoint), tuple(WeightedWaypoint(_gateway_of(g), w) for g, w in weighted),  # type: ignore[arg-type]
        None if lb is None else LoadBalancer(
            tuple(LoadBalancingScope(p) for p in lb[0]), LoadBalancingMode(lb[1]), HealthPolicy(lb[2])
        ),
        IPFamilies(ip_families), canonical, Visibility(visibility), tuple(_endpoint_of(e) for e in endpoints),
        ingress_use_waypoint,
    )  # fmt: skip


def members_record(key: str, endpoints: Iterable[Endpoint]) -> tuple[Any, ...]:
    return (key, tuple(_endpoint(e) for e in endpoints))


def members_of(t: tuple[Any, ...]) -> tuple[str, tuple[Endpoint, ...]]:
    return t[0], tuple(_endpoint_of(e) for e in t[1])
