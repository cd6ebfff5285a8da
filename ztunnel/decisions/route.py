"""Destination resolution: where a connection goes, by which protocol.

`route(state, source, destination)` is a pure function of a state snapshot: it returns a `Route` (next
hop, protocol, HBONE authority, expected server identities, and for double HBONE the inner tunnel's
identities and authority) or a `NoRoute` naming why. The outbound and SOCKS5 listeners call it and act
on the answer. Randomness (load balancing, weighted waypoints) comes from the `rng` argument.

The order of the decisions is the reference's:

1. a service VIP with a waypoint goes to the waypoint (HBONE, authority = the original destination);
2. a service VIP is load balanced to an endpoint (STRICT/FAILOVER preferences, capacity weights) and
   its port translated; a PASSTHROUGH service and an unknown IP go to the address as dialled, in TCP;
3. an endpoint on another network is reached by double HBONE through its network gateway;
4. a workload addressed directly goes to its own waypoint, unless the source is that waypoint;
5. otherwise straight to the workload: HBONE to `<ip>:15008`, or TCP to `<ip>:<port>`.

The inbound side asks two questions of the same snapshot: `is_waypoint_for` (may this proxy accept
a CONNECT for an address that is not its own?) and `hostname_target` (which port a hostname
authority means).
"""

from __future__ import annotations

import enum
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol as TypingProtocol

from hbone.address import format_addr
from mesh.model import (
    Endpoint,
    GatewayAddress,
    IPAddress,
    IPFamilies,
    LoadBalancingMode,
    LoadBalancingScope,
    NamespacedHostname,
    NetworkAddress,
    Service,
    TunnelProtocol,
    Workload,
)
from ztunnel.config.settings import HBONE_PORT

# Used when the caller passes no generator; connections need no reproducible choices.
_RNG = random.Random()

RECURSIVE_CALL = "attempted recursive call to ourselves"


class Protocol(enum.Enum):
    TCP = "TCP"
    HBONE = "HBONE"
    DOUBLE_HBONE = "DOUBLE_HBONE"


@dataclass(frozen=True, slots=True)
class Route:
    protocol: Protocol
    # Where to connect. A str host is a workload hostname still to be resolved by DNS (`needs_dns`).
    next_hop: tuple[IPAddress | str, int]
    authority: str | None = None  # the (outer) CONNECT :authority, for HBONE and DOUBLE_HBONE
    expected_identities: tuple[str, ...] = ()  # SPIFFE URIs the next hop may present
    workload: Workload | None = None  # who terminates our tunnel: endpoint, waypoint (None: passthrough)
    service: Service | None = None  # the service the app addressed, if any
    waypoint: bool = False  # the next hop is the destination's waypoint
    final_identities: tuple[str, ...] = ()  # DOUBLE_HBONE: SPIFFE URIs the inner TLS server may present
    inner_authority: str | None = None  # DOUBLE_HBONE: the inner CONNECT :authority

    @property
    def needs_dns(self) -> bool:
        return isinstance(self.next_hop[0], str)

    def resolved(self, ip: IPAddress) -> Route:
        """This route with its hostname next hop replaced by an address DNS returned for it."""
        if not self.needs_dns:
            return self
        authority = self.authority
        if self.protocol is Protocol.HBONE and authority is not None:
            # Direct HBONE: the authority names the workload's address and the target port.
            authority = format_addr(ip, int(authority.rpartition(":")[2]))
        return replace(self, next_hop=(ip, self.next_hop[1]), authority=authority)


@dataclass(frozen=True, slots=True)
class NoRoute:
    reason: str


class State(TypingProtocol):
    """What routing reads of the store (ztunnel.state.store.ProxyState provides it)."""

    def workload_by_addr(self, network: str, ip: IPAddress) -> Workload | None: ...
    def workload_by_uid(self, uid: str) -> Workload | None: ...
    def workload_by_hostname(self, namespace: str, hostname: str) -> Workload | None: ...
    def services_by_vip(self, network: str, ip: IPAddress) -> list[Service]: ...
    def service_for_vip(
        self, network: str, ip: IPAddress, client_namespace: str | None
    ) -> Service | None: ...
    def service_by_key(self, key: str) -> Service | None: ...
    def service_by_hostname(
        self, hostname: str, client_namespace: str | None, preferred_namespace: str | None = None
    ) -> Service | None: ...
    def endpoints(self, service_key: str) -> list[Endpoint]: ...


# --- the outbound decision ---------------------------------------------------------------------


def is_self_call(ip: IPAddress, port: int, illegal_ports: frozenset[int], *, ours: bool) -> bool:
    """A connection to one of the proxy's own ports, which would loop back into it: refused before
    routing (outbound) and by admission (inbound). `ours`: the address is known to be this
    workload's (inbound); otherwise only loopback counts (outbound)."""
    return port in illegal_ports and (ours or ip.is_loopback)


def route(
    state: State,
    source: Workload,
    destination: tuple[IPAddress, int],
    *,
    network: str = "",
    rng: random.Random | None = None,
    source_ip: IPAddress | None = None,
) -> Route | NoRoute:
    """Resolve where a connection from `source` to `destination` goes.

    `network` is the proxy's own network (NETWORK), in which addresses are looked up. `source_ip` is
    the client's address: with it, a waypoint's own traffic to a workload it serves skips that
    waypoint only when it comes from the waypoint's IP (without it, the identity alone decides).
    """
    rng = rng or _RNG
    ip, port = destination
    dst = destination
    # A: a workload's IP first; an address no workload has may be a service VIP.
    workload = state.workload_by_addr(network, ip)
    service = None if workload is not None else state.service_for_vip(network, ip, source.namespace)
    target_port = port
    if service is not None:
        waypoint = pick_waypoint(service, rng)
        if waypoint is not None:
            return _via_waypoint(state, source, waypoint, dst, service, rng)
        lb = service.load_balancer
        if lb is not None and lb.mode is LoadBalancingMode.PASSTHROUGH:
            return Route(Protocol.TCP, dst, service=service)
        picked = pick_endpoint(state, source, service, port, rng)
        if picked is None:
            return NoRoute(f"no healthy upstream: {format_addr(ip, port)}")
        upstream, target_port = picked
    elif workload is not None:
        upstream = workload
    else:
        return Route(Protocol.TCP, dst)  # C: unknown address, passed through as dialled
    # D: an endpoint on another network is only reachable through that network's gateway.
    if upstream.network != source.network:
        if service is None:
            return NoRoute(f"no service for target address: {format_addr(ip, port)}")
        return _via_gateway(state, source, upstream, dst, service, service.subject_alt_names, rng)
    # E: workload addressing honours the workload's waypoint, except for the waypoint's own traffic.
    if (
        service is None
        and upstream.waypoint is not None
        and not _is_source_waypoint(state, source, source_ip, upstream.waypoint)
    ):
        return _via_waypoint(state, source, upstream.waypoint, dst, None, rng)
    # F: straight to the workload.
    addr: IPAddress | str | None = pick_ip(upstream, ip, service)
    if addr is None:
        if not upstream.hostname:
            return NoRoute(f"no valid routing destination for workload: {upstream.uid}")
        addr = upstream.hostname  # B: resolved by DNS when the connection is made
    return _direct(upstream, addr, target_port, service)


def _direct(workload: Workload, addr: IPAddress | str, port: int, service: Service | None) -> Route:
    if workload.tunnel_protocol is TunnelProtocol.HBONE:
        sans = (*(service.subject_alt_names if service else ()), workload.identity_uri)
        return Route(
            Protocol.HBONE,
            (addr, HBONE_PORT),
            authority=format_addr(addr, port),
            expected_identities=_unique(sans),
            workload=workload,
            service=service,
        )
    return Route(Protocol.TCP, (addr, port), workload=workload, service=service)


def _via_waypoint(
    state: State,
    source: Workload,
    waypoint: GatewayAddress,
    dst: tuple[IPAddress, int],
    service: Service | None,
    rng: random.Random,
) -> Route | NoRoute:
    """HBONE to the waypoint, authority = the original destination."""
    found = resolve_gateway(state, source, waypoint, dst[0], rng, waypoint_mode=True)
    if found is None:
        return NoRoute(f"unknown waypoint: {waypoint.destination}")
    wp, wp_ip, wp_port, wp_service = found
    wp_sans = wp_service.subject_alt_names if wp_service else ()
    if wp.network != source.network:
        # A waypoint in another network: double HBONE through its gateway; the inner TLS expects the
        # waypoint service's identities (remote workloads are opaque).
        if service is None:
            return NoRoute(f"no service for target address: {format_addr(*dst)}")
        return _via_gateway(state, source, wp, dst, service, wp_sans, rng, waypoint=True)
    if wp_ip is None:
        return NoRoute(f"unknown waypoint: {waypoint.destination} has no address")
    return Route(
        Protocol.HBONE,
        (wp_ip, wp_port),
        authority=format_addr(*dst),
        expected_identities=_unique((*wp_sans, wp.identity_uri)),
        workload=wp,
        service=service,
        waypoint=True,
    )


def _via_gateway(
    state: State,
    source: Workload,
    target: Workload,
    dst: tuple[IPAddress, int],
    service: Service,
    final_sans: tuple[str, ...],
    rng: random.Random,
    *,
    waypoint: bool = False,
) -> Route | NoRoute:
    """Double HBONE through `target`'s network gateway."""
    gateway = target.network_gateway
    if gateway is None:
        return NoRoute(f"no network gateway for workload {target.uid} in network {target.network!r}")
    found = resolve_gateway(state, source, gateway, dst[0], rng, waypoint_mode=False)
    if found is None:
        return NoRoute(f"unknown network gateway: {gateway.destination}")
    gw, gw_ip, gw_port, gw_service = found
    if gw_ip is None:
        return NoRoute(f"unknown network gateway: {gateway.destination} has no address")
    authority = f"{service.hostname}:{dst[1]}"
    return Route(
        Protocol.DOUBLE_HBONE,
        (gw_ip, gw_port),
        authority=authority,
        expected_identities=_unique((gw.identity_uri, *(gw_service.subject_alt_names if gw_service else ()))),
        workload=target,
        service=service,
        waypoint=waypoint,
        final_identities=final_sans,
        inner_authority=authority,
    )


# --- waypoints and gateways ----------------------------------------------------------------------


def pick_waypoint(service: Service, rng: random.Random) -> GatewayAddress | None:
    """The service's waypoint for one connection: weighted waypoints by weight (zero never), else the
    single waypoint; an all-zero weighted set falls back too."""
    weighted = [w for w in service.weighted_waypoints if w.weight > 0]
    if weighted:
        return rng.choices(weighted, weights=[w.weight for w in weighted])[0].destination
    return service.waypoint


def resolve_gateway(
    state: State,
    source: Workload,
    gateway: GatewayAddress,
    family_of: IPAddress,
    rng: random.Random,
    *,
    waypoint_mode: bool,
) -> tuple[Workload, IPAddress | None, int, Service | None] | None:
    """The workload, address, port and service (when reached through one) of a waypoint or network
    gateway. The address is None for a workload without any (one in another network)."""
    dest = gateway.destination
    port = gateway.hbone_mtls_port
    target = _gateway_target(state, dest, source.namespace)
    if target is None:
        return None
    if isinstance(dest, NetworkAddress):
        family_of = dest.address  # the family of the address given
    if isinstance(target, Workload):
        ip = dest.address if isinstance(dest, NetworkAddress) else pick_ip(target, family_of, None)
        return target, ip, port, None
    service = target
    picked = pick_endpoint(state, source, service, port, rng, waypoint_mode=waypoint_mode)
    if picked is None:
        return None
    w, target_port = picked
    return w, pick_ip(w, family_of, service), target_port, service


def gateway_workloads(state: State, gateway: GatewayAddress, client_namespace: str | None) -> list[Workload]:
    """Every workload that makes up a waypoint or gateway (its service's endpoints, or the workload)."""
    target = _gateway_target(state, gateway.destination, client_namespace)
    if target is None or isinstance(target, Workload):
        return [] if target is None else [target]
    workloads = (state.workload_by_uid(ep.workload_uid) for ep in state.endpoints(target.key))
    return [w for w in workloads if w is not None]


def _gateway_target(
    state: State, dest: NetworkAddress | NamespacedHostname, client_namespace: str | None
) -> Workload | Service | None:
    """What a waypoint or gateway address names: by address a workload, else a service VIP; by
    hostname a service, else a workload with that hostname."""
    if isinstance(dest, NetworkAddress):
        w = state.workload_by_addr(dest.network, dest.address)
        return w if w is not None else state.service_for_vip(dest.network, dest.address, client_namespace)
    service = state.service_by_key(f"{dest.namespace}/{dest.hostname}")
    return service if service is not None else state.workload_by_hostname(dest.namespace, dest.hostname)


def _is_source_waypoint(
    state: State, source: Workload, source_ip: IPAddress | None, waypoint: GatewayAddress
) -> bool:
    """The source is one of the workloads making up this waypoint: same identity, and (when known)
    the connection comes from that workload's IP."""
    for w in gateway_workloads(state, waypoint, source.namespace):
        if w.identity_uri == source.identity_uri and (source_ip is None or source_ip in w.addresses):
            return True
    return False


def _waypoints_of(service: Service) -> Iterable[GatewayAddress]:
    if service.waypoint is not None:
        yield service.waypoint
    for weighted in service.weighted_waypoints:
        yield weighted.destination


def is_waypoint_for(
    state: State, local: Workload, local_ip: IPAddress, target: IPAddress, network: str
) -> bool:
    """Inbound: a CONNECT whose authority is not our address is accepted when we
    are its destination's waypoint: a service waypoint whose endpoints include us, or a workload
    waypoint whose IPs include the address the connection arrived on."""
    workload = state.workload_by_addr(network, target)
    if workload is not None:
        if workload.waypoint is None:
            return False
        return any(local_ip in w.addresses for w in gateway_workloads(state, workload.waypoint, None))
    services = state.services_by_vip(network, target)
    if not services:
        cidr = state.service_for_vip(network, target, local.namespace)
        services = [cidr] if cidr is not None else []
    for service in services:
        for waypoint in _waypoints_of(service):
            if any(w.uid == local.uid for w in gateway_workloads(state, waypoint, local.namespace)):
                return True
    return False


def hostname_target(state: State, local: Workload, hostname: str, port: int) -> tuple[Service, int] | None:
    """Inbound: the service a hostname authority names (ours by namespace first)
    and the target port on this workload: our endpoint's mapping, else the service's target port."""
    service = state.service_by_hostname(hostname, local.namespace)
    if service is None:
        return None
    mapped = dict(local.services).get(service.key)
    target = dict(mapped).get(port) if mapped else None
    if not target:
        target = service.target_port(port)
    if not target:
        return None
    return service, target


# --- load balancing ------------------------------------------------------------------------------


def pick_endpoint(
    state: State,
    source: Workload,
    service: Service,
    port: int,
    rng: random.Random,
    *,
    waypoint_mode: bool = False,
) -> tuple[Workload, int] | None:
    """An endpoint of `service` for `port` and its target port, or None."""
    candidates = endpoint_candidates(state, source, service, port, waypoint_mode=waypoint_mode)
    candidates = apply_preferences(service, source, candidates)
    weights = [max(w.capacity, 0) for w, _ in candidates]
    if not candidates or sum(weights) <= 0:
        return None
    return rng.choices(candidates, weights=weights)[0]


def endpoint_candidates(
    state: State, source: Workload, service: Service, port: int, *, waypoint_mode: bool = False
) -> list[tuple[Workload, int]]:
    """The service's usable endpoints for `port`, each with its target port (health filtering is the
    store's). Only waypoint resolution accepts a port the service does not list, for app tunnels."""
    service_target = service.target_port(port)
    if service_target is None and not waypoint_mode:
        return []
    out: list[tuple[Workload, int]] = []
    for ep in state.endpoints(service.key):
        w = state.workload_by_uid(ep.workload_uid)
        if w is None:
            continue
        # Only a remote endpoint behind a gateway may have no address of its own.
        remote = w.network != source.network and w.network_gateway is not None
        if not w.addresses and not w.hostname and not remote:
            continue
        target = ep.target_port(port) or service_target
        if not target and w.application_tunnel is not None:
            target = port  # the app tunnel's listener takes the service port itself
        if not target:
            continue  # a named port this endpoint does not expose
        out.append((w, target))
    return out


def apply_preferences(
    service: Service, source: Workload, candidates: list[tuple[Workload, int]]
) -> list[tuple[Workload, int]]:
    """STRICT keeps the endpoints matching every routing preference; FAILOVER those of the best rank."""
    lb = service.load_balancer
    if lb is None or lb.mode not in (LoadBalancingMode.STRICT, LoadBalancingMode.FAILOVER):
        return candidates
    prefs = lb.routing_preferences
    if lb.mode is LoadBalancingMode.STRICT:
        return [c for c in candidates if all(_scope_matches(s, source, c[0]) for s in prefs)]
    ranked = [(locality_rank(prefs, source, w), (w, port)) for w, port in candidates]
    if not ranked:
        return []
    best = max(rank for rank, _ in ranked)
    return [c for rank, c in ranked if rank == best]


def locality_rank(prefs: tuple[LoadBalancingScope, ...], source: Workload, w: Workload) -> int:
    """How many leading preferences `w` shares with the source, stopping at the first mismatch. When
    NETWORK comes first, a mismatch there does not stop the count and a match is worth len(prefs),
    so a same-network endpoint always outranks a cross-network one."""
    rank = 0
    scopes = prefs
    if prefs and prefs[0] is LoadBalancingScope.NETWORK:
        if w.network == source.network:
            rank += len(prefs)
        scopes = prefs[1:]
    for scope in scopes:
        if not _scope_matches(scope, source, w):
            break
        rank += 1
    return rank


def _scope_matches(scope: LoadBalancingScope, a: Workload, b: Workload) -> bool:
    if scope is LoadBalancingScope.REGION:
        return a.locality.region == b.locality.region
    if scope is LoadBalancingScope.ZONE:
        return a.locality.zone == b.locality.zone
    if scope is LoadBalancingScope.SUBZONE:
        return a.locality.subzone == b.locality.subzone
    if scope is LoadBalancingScope.NODE:
        return a.node == b.node
    if scope is LoadBalancingScope.CLUSTER:
        return a.cluster_id == b.cluster_id
    if scope is LoadBalancingScope.NETWORK:
        return a.network == b.network
    return True


def pick_ip(workload: Workload, wanted: IPAddress, service: Service | None) -> IPAddress | None:
    """The dialled IP if it is the workload's; else its first IP the service's `ip_families` allow,
    of the dialled family first."""
    if wanted in workload.addresses:
        return wanted
    families = service.ip_families if service is not None else IPFamilies.AUTOMATIC
    allowed = [
        ip
        for ip in workload.addresses
        if not (families is IPFamilies.IPV4_ONLY and ip.version != 4)
        and not (families is IPFamilies.IPV6_ONLY and ip.version != 6)
    ]
    same = [ip for ip in allowed if ip.version == wanted.version]
    candidates = same or allowed
    return candidates[0] if candidates else None


def pick_resolved(
    addresses: Sequence[IPAddress], version: int, rng: random.Random | None = None
) -> IPAddress | None:
    """One of a workload hostname's DNS answers at random, of the dialled IP version if any is."""
    same = [a for a in addresses if a.version == version]
    candidates = same or list(addresses)
    return (rng or _RNG).choice(candidates) if candidates else None


def _unique(items: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(items))
