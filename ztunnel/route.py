"""Destination resolution: where an outbound connection goes, by which protocol (SPEC §3.2).

`route(state, source, destination)` is a pure function of a state snapshot: it returns a `Route` (next
hop, protocol, HBONE authority, expected server identities) or a `NoRoute` naming why. The outbound
and SOCKS5 listeners call it and act on the answer.

First cut: workload IPs (HBONE or TCP), service VIPs with port translation to a random healthy
endpoint, and passthrough for everything unknown. Load-balancing modes, waypoints and gateways
extend this module.
"""

from __future__ import annotations

import enum
import ipaddress
import random
from dataclasses import dataclass
from typing import Protocol as TypingProtocol

from xds.model import Endpoint, IPAddress, LoadBalancingMode, Service, TunnelProtocol, Workload

HBONE_PORT = 15008


class Protocol(enum.Enum):
    TCP = "TCP"
    HBONE = "HBONE"


@dataclass(frozen=True, slots=True)
class Route:
    protocol: Protocol
    next_hop: tuple[IPAddress, int]
    authority: str | None = None  # the CONNECT :authority, for HBONE
    expected_identities: tuple[str, ...] = ()  # SPIFFE URIs the server may present
    workload: Workload | None = None  # the workload connected to (None for passthrough)
    service: Service | None = None  # the service the app addressed, if any

    @property
    def passthrough(self) -> bool:
        return self.workload is None and self.protocol is Protocol.TCP


@dataclass(frozen=True, slots=True)
class NoRoute:
    reason: str


class State(TypingProtocol):
    """What routing reads of the store (ztunnel.state.ProxyState provides it)."""

    def workload_by_addr(self, network: str, ip: IPAddress) -> Workload | None: ...
    def workload_by_uid(self, uid: str) -> Workload | None: ...
    def service_for_vip(self, network: str, ip: IPAddress, client_namespace: str) -> Service | None: ...
    def endpoints(self, service_key: str) -> list[Endpoint]: ...


def format_addr(ip: IPAddress, port: int) -> str:
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def _pick_ip(workload: Workload, wanted: IPAddress) -> IPAddress | None:
    if wanted in workload.addresses:
        return wanted
    same_family = [ip for ip in workload.addresses if ip.version == wanted.version]
    candidates = same_family or list(workload.addresses)
    return candidates[0] if candidates else None


def _pick_endpoint(
    state: State, service: Service, port: int, rng: random.Random
) -> tuple[Workload, int] | None:
    target = service.target_port(port)
    if target is None:
        return None
    candidates: list[tuple[Workload, int]] = []
    for ep in state.endpoints(service.key):
        w = state.workload_by_uid(ep.workload_uid)
        if w is None or not w.addresses:
            continue
        ep_port = ep.target_port(port)
        chosen = ep_port if ep_port else target
        if not chosen:
            continue  # named port the endpoint does not expose
        candidates.append((w, chosen))
    if not candidates:
        return None
    weights = [max(w.capacity, 0) for w, _ in candidates]
    if sum(weights) <= 0:
        return None
    return rng.choices(candidates, weights=weights)[0]


def _direct(workload: Workload, ip: IPAddress, port: int, service: Service | None) -> Route:
    if workload.tunnel_protocol is TunnelProtocol.HBONE:
        sans = (*(service.subject_alt_names if service else ()), workload.identity_uri)
        return Route(
            Protocol.HBONE,
            (ip, HBONE_PORT),
            authority=format_addr(ip, port),
            expected_identities=tuple(dict.fromkeys(sans)),
            workload=workload,
            service=service,
        )
    return Route(Protocol.TCP, (ip, port), workload=workload, service=service)


def route(
    state: State,
    source: Workload,
    destination: tuple[IPAddress, int],
    *,
    network: str = "",
    rng: random.Random | None = None,
) -> Route | NoRoute:
    """Resolve where a connection from `source` to `destination` goes (SPEC §3.2, first cut)."""
    rng = rng or random.Random()
    ip, port = destination
    ip = ipaddress.ip_address(ip)
    workload = state.workload_by_addr(network, ip)
    if workload is not None:
        return _direct(workload, ip, port, None)
    service = state.service_for_vip(network, ip, source.namespace)
    if service is not None:
        lb = service.load_balancer
        if lb is not None and lb.mode is LoadBalancingMode.PASSTHROUGH:
            return Route(Protocol.TCP, (ip, port), service=service)
        picked = _pick_endpoint(state, service, port, rng)
        if picked is None:
            return NoRoute(f"no healthy upstream: {format_addr(ip, port)}")
        endpoint, target_port = picked
        endpoint_ip = _pick_ip(endpoint, ip)
        if endpoint_ip is None:
            return NoRoute(f"no healthy upstream: {format_addr(ip, port)}")
        return _direct(endpoint, endpoint_ip, target_port, service)
    return Route(Protocol.TCP, (ip, port))
