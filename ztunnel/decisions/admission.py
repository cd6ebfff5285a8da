"""Inbound admission: may this connection reach our workload, and how is it delivered?

`admit(state, local, request, rules)` is a pure function of a state snapshot, beside `route()` for the
outbound side. The inbound HBONE listener (15008) and the plaintext one (15006) describe what arrived
as an `InboundRequest` and act on the answer: an `Admit` carries the plan (the app's address and port,
the source to dial from, the PROXY v2 tunnel target, the authorization input, the service for
telemetry); a `Reject` carries its kind (whose HTTP status `rejection.TOLD` gives), the reason for
the log, and, when authorization said no, the plan as well, so that the denial is recorded like any
connection.

The checks and their order are the reference's (kinds, and their status codes for HBONE):

1. method not CONNECT, or `:authority` neither `ip:port` nor `host:port`: MALFORMED (400);
2. our own workload unknown: NO_LOCAL_WORKLOAD (503);
3. an IP authority that is not our address: MISADDRESSED (400, "ip mismatch"), unless the workload
   has an application tunnel (a sandwiched waypoint) or is the waypoint of that address;
4. a hostname authority (from a network gateway): the service by that hostname and its target port,
   else NO_TARGET (503);
5. the port is one of the proxy's own (a recursive call): SELF_CALL (503), the guard the outbound
   side shares (`route.is_self_call`);
6. authorization: DENIED (401).

A plaintext connection (15006) has no method or authority: its target is its original destination,
and it meets checks 2, 5 and 6.
"""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from hbone.identity import Identity, uri_of
from mesh.model import AppTunnelProtocol, IPAddress, Service, Workload
from policy import Authorization, Connection, Deny, authorize
from ztunnel.decisions.rejection import RejectionKind, http_status
from ztunnel.decisions.route import RECURSIVE_CALL, State, hostname_target, is_self_call, is_waypoint_for

UNKNOWN_LOCAL = "unknown local workload"


class AdmissionState(State, Protocol):
    """What admission reads of the store, beside what routing reads."""

    def policies_for(self, w: Workload) -> Sequence[Authorization]: ...
    def services_of_workload(self, w: Workload) -> list[Service]: ...


@dataclass(frozen=True, slots=True)
class AdmissionRules:
    """The proxy's settings that admission depends on."""

    network: str
    illegal_ports: frozenset[int]
    localhost_app_tunnel: bool = True
    # The listener can dial the app from the client's own address (IP_TRANSPARENT, in-pod).
    spoof_source: bool = False


@dataclass(frozen=True, slots=True)
class InboundRequest:
    """What arrived: for HBONE the CONNECT's method, authority and headers; for plaintext, None for
    those and `local` is the original destination."""

    peer: tuple[IPAddress, int]
    local: tuple[IPAddress, int]
    method: str | None = None
    authority: str | None = None
    identity: Identity | None = None
    headers: Mapping[str, str] | None = None

    @property
    def hbone(self) -> bool:
        return self.method is not None


@dataclass(frozen=True, slots=True)
class Delivery:
    """How an admitted connection reaches the app."""

    local: Workload
    connection: Connection  # what authorization saw; the policy tracker re-checks it
    app: tuple[str, int]  # where to dial
    source_ip: str | None  # dial from this address (the client's when spoofing, loopback for a tunnel)
    transparent: bool  # source_ip is the client's (IP_TRANSPARENT)
    proxy_header: tuple[tuple[IPAddress, int], tuple[IPAddress, int]] | None  # PROXY v2 (client, target)
    service: Service | None  # for telemetry: the service the connection was meant for
    src_workload: Workload | None  # the client's workload by address (None when via a gateway)


@dataclass(frozen=True, slots=True)
class Admit:
    plan: Delivery
    notes: tuple[str, ...] = ()  # what authorization noted (dry-run results), logged at debug


@dataclass(frozen=True, slots=True)
class Reject:
    kind: RejectionKind
    reason: str
    # Set when authorization denied: the plan it judged, so the denial is recorded like a connection.
    plan: Delivery | None = None
    notes: tuple[str, ...] = ()

    @property
    def status(self) -> int:
        """The HBONE response (400, 401, 503); a plaintext connection is closed instead."""
        return http_status(self.kind)

    @property
    def denied(self) -> bool:
        return self.plan is not None


def admit(
    state: AdmissionState, local: Workload | None, request: InboundRequest, rules: AdmissionRules
) -> Admit | Reject:
    local_ip, dst_port = request.local
    headers = request.headers or {}
    if request.hbone:
        if request.method != "CONNECT":
            return Reject(RejectionKind.MALFORMED, f"invalid method: {request.method}")
        target = parse_authority(request.authority or "")
        if target is None:
            return Reject(RejectionKind.MALFORMED, f"invalid authority: {request.authority!r}")
    else:
        target = request.local
        if is_self_call(local_ip, dst_port, rules.illegal_ports, ours=True):
            return Reject(RejectionKind.SELF_CALL, RECURSIVE_CALL)
    if local is None:
        return Reject(RejectionKind.NO_LOCAL_WORKLOAD, UNKNOWN_LOCAL)
    host, port = target
    tunnel = local.application_tunnel if request.hbone else None
    service: Service | None = None
    tunnel_target: tuple[IPAddress, int]
    if isinstance(host, str):
        # A hostname authority (the inner tunnel through a network gateway): always valid, delivered
        # to our address on the service's target port.
        found = hostname_target(state, local, host, port)
        if found is None:
            return Reject(RejectionKind.NO_TARGET, f"unknown service or port: {request.authority}")
        service, resolved_port = found
        tunnel_target = (_service_vip(service, rules.network) or local_ip, port)
        port = resolved_port
    elif (
        host != local_ip
        and tunnel is None
        and not is_waypoint_for(state, local, local_ip, host, rules.network)
    ):
        return Reject(RejectionKind.MISADDRESSED, f"ip mismatch: {local_ip} != {host}")
    else:
        tunnel_target = (host, port)
    if request.hbone and is_self_call(local_ip, port, rules.illegal_ports, ours=True):
        return Reject(RejectionKind.SELF_CALL, f"illegal port: {port}")
    # A sandwiched waypoint's app listens on its tunnel port whatever the destination was.
    forward_port = tunnel.port if tunnel is not None and tunnel.port else port
    peer_ip, peer_port = request.peer
    forwarded_network = (headers.get("x-forwarded-network") or "").lower()
    via_gateway = forwarded_network not in ("", rules.network.lower())
    identity = request.identity
    conn = Connection(
        src_ip=peer_ip,
        src_port=peer_port,
        dst_ip=local_ip,
        dst_port=forward_port if request.hbone else dst_port,
        src_principal=uri_of(identity) if identity else None,
        src_namespace=identity.namespace if identity else None,
        src_service_account=identity.service_account if identity else None,
        dst_network=rules.network,
    )
    proxy_tunnel = tunnel is not None and tunnel.protocol is AppTunnelProtocol.PROXY
    app_host, source_ip, spoof = str(local_ip), None, rules.spoof_source
    if proxy_tunnel and rules.localhost_app_tunnel:
        loopback = "::1" if local_ip.version == 6 else "127.0.0.1"
        app_host, source_ip, spoof = loopback, loopback, False
    elif spoof:
        source_ip = str(peer_ip)
    plan = Delivery(
        local=local,
        connection=conn,
        app=(app_host, forward_port),
        source_ip=source_ip,
        transparent=spoof,
        proxy_header=((peer_ip, peer_port), tunnel_target) if proxy_tunnel else None,
        service=service or inbound_service(state, local, port, headers.get("forwarded")),
        src_workload=None if via_gateway else state.workload_by_addr(rules.network, peer_ip),
    )
    decision = authorize(state.policies_for(local), conn)
    if isinstance(decision, Deny):
        return Reject(
            RejectionKind.DENIED,
            f"connection closed due to policy rejection: {decision.reason}",
            plan,
            decision.notes,
        )
    return Admit(plan, decision.notes)


def forwarded_host(forwarded: str | None) -> str | None:
    """The `host=` of a `forwarded` header (the service the client addressed), if it has one."""
    host = None
    for part in (forwarded or "").split(";"):
        k, _, v = part.strip().partition("=")
        if k.strip().lower() == "host":
            host = v.strip().strip('"') or None
    return host


def inbound_service(
    state: AdmissionState, local: Workload, port: int, forwarded: str | None
) -> Service | None:
    """The service a connection was meant for, for telemetry only: the `forwarded` header's `host=`
    among our services, else the first of ours with that target port."""
    services = state.services_of_workload(local)
    host = forwarded_host(forwarded)
    for svc in services:
        if host and svc.hostname == host:
            return svc
    for svc in services:
        if any(t == port for _, t in svc.ports):
            return svc
    return None


def _service_vip(service: Service, network: str) -> IPAddress | None:
    """The service's VIP in our network, IPv4 first: the target a hostname authority stands for."""
    vips = sorted((v.address for v in service.vips if v.network == network), key=lambda ip: ip.version)
    return vips[0] if vips else None


@functools.lru_cache(maxsize=4096)
def parse_authority(authority: str) -> tuple[IPAddress | str, int] | None:
    """`ip:port`, `[v6]:port` or `host:port`; None when it is neither (parsed once per distinct one:
    a node's CONNECTs name a few)."""
    host, sep, port_s = authority.rpartition(":")
    if not sep or not port_s.isdigit() or not host:
        return None
    port = int(port_s)
    if port > 65535:
        return None
    if host.startswith("[") and host.endswith("]"):
        try:
            return ipaddress.IPv6Address(host[1:-1]), port
        except ValueError:
            return None
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        if ":" in host or not all(c.isalnum() or c in "-._" for c in host):
            return None
        return host, port
    if ip.version == 6:
        return None  # a bare IPv6 literal must be bracketed
    return ip, port
