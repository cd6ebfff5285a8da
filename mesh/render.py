"""Model values rendered in the local config's format (`/config_dump` shows them); what they produce
parses back to equal values.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable, Mapping
from ipaddress import IPv4Address
from typing import Any, TypeVar

from mesh.localconfig import (
    ACTIONS,
    APP_TUNNEL_PROTOCOLS,
    HEALTH_POLICIES,
    IP_FAMILIES,
    LOAD_BALANCING_MODES,
    NETWORK_MODES,
    PROTOCOLS,
    ROUTING_PREFERENCES,
    SCOPES,
    STATUSES,
    VISIBILITIES,
)
from mesh.model import (
    Endpoint,
    GatewayAddress,
    IPAddress,
    IPFamilies,
    Service,
    Workload,
)
from policy.model import (
    Authorization,
    Match,
    ServiceAccountMatch,
    StringMatch,
    StringMatchKind,
)

E = TypeVar("E")


# Each table's first name of every member, made once (`/config_dump` names three enums a workload).
_first_names: dict[int, tuple[Mapping[str, Any], dict[Any, str]]] = {}


def _name(table: Mapping[str, E], value: E) -> str:
    kept = _first_names.get(id(table))
    if kept is None or kept[0] is not table:
        kept = _first_names[id(table)] = (table, {m: n for n, m in reversed(list(table.items()))})
    return kept[1][value]


def _ip_text(ip: IPAddress) -> str:
    """`str(ip)`; an IPv4 address by the C library (ipaddress spells it in Python: most of the time
    `/config_dump` takes for 100,000 workloads)."""
    return socket.inet_ntoa(ip.packed) if isinstance(ip, IPv4Address) else str(ip)


def _port_map_dict(ports: Iterable[tuple[int, int]]) -> dict[str, int]:
    # String keys: the dict is then equal to its own JSON round trip.
    return {str(svc): target for svc, target in ports}


def gateway_to_dict(gateway: GatewayAddress | None) -> dict[str, Any] | None:
    if gateway is None:
        return None
    return {"destination": str(gateway.destination), "hboneMtlsPort": gateway.hbone_mtls_port}


def endpoint_to_dict(endpoint: Endpoint) -> dict[str, Any]:
    return {
        "workloadUid": endpoint.workload_uid,
        "port": _port_map_dict(endpoint.port),
        "status": _name(STATUSES, endpoint.status),
    }


def workload_to_dict(w: Workload) -> dict[str, Any]:
    tunnel = w.application_tunnel
    return {
        "uid": w.uid,
        "name": w.name,
        "namespace": w.namespace,
        "workloadIps": [_ip_text(ip) for ip in w.addresses],
        "hostname": w.hostname,
        "network": w.network,
        "protocol": _name(PROTOCOLS, w.tunnel_protocol),
        "trustDomain": w.trust_domain,
        "serviceAccount": w.service_account,
        "waypoint": gateway_to_dict(w.waypoint),
        "networkGateway": gateway_to_dict(w.network_gateway),
        "node": w.node,
        "canonicalName": w.canonical_name,
        "canonicalRevision": w.canonical_revision,
        "workloadType": w.workload_type,
        "workloadName": w.workload_name,
        "nativeTunnel": w.native_tunnel,
        "applicationTunnel": None
        if tunnel is None
        else {"protocol": _name(APP_TUNNEL_PROTOCOLS, tunnel.protocol), "port": tunnel.port},
        "services": {key: _port_map_dict(ports) for key, ports in w.services},
        "authorizationPolicies": list(w.authorization_policies),
        "status": _name(STATUSES, w.status),
        "clusterId": w.cluster_id,
        "locality": {"region": w.locality.region, "zone": w.locality.zone, "subzone": w.locality.subzone},
        "networkMode": _name(NETWORK_MODES, w.network_mode),
        "capacity": w.capacity,
    }


def service_to_dict(s: Service, endpoints: Iterable[Endpoint] | None = None) -> dict[str, Any]:
    """`endpoints` replaces the service's own list (the store shows the endpoints it has merged)."""
    lb = s.load_balancer
    return {
        "name": s.name,
        "namespace": s.namespace,
        "hostname": s.hostname,
        "vips": [str(vip) for vip in s.vips],
        "cidrVips": [{"network": vip.network, "cidr": str(vip.cidr)} for vip in s.cidr_vips],
        "ports": _port_map_dict(s.ports),
        "endpoints": {
            ep.workload_uid: endpoint_to_dict(ep) for ep in (s.endpoints if endpoints is None else endpoints)
        },
        "subjectAltNames": list(s.subject_alt_names),
        "waypoint": gateway_to_dict(s.waypoint),
        "weightedWaypoints": [
            {"destination": gateway_to_dict(ww.destination), "weight": ww.weight}
            for ww in s.weighted_waypoints
        ],
        "loadBalancer": None
        if lb is None
        else {
            "routingPreferences": [_name(ROUTING_PREFERENCES, scope) for scope in lb.routing_preferences],
            "mode": _name(LOAD_BALANCING_MODES, lb.mode),
            "healthPolicy": _name(HEALTH_POLICIES, lb.health_policy),
        },
        "ipFamilies": None if s.ip_families is IPFamilies.AUTOMATIC else _name(IP_FAMILIES, s.ip_families),
        "canonical": s.canonical,
        "visibility": _name(VISIBILITIES, s.visibility),
    }


def string_match_to_dict(m: StringMatch) -> dict[str, Any]:
    return {m.kind.value: [] if m.kind is StringMatchKind.PRESENCE else m.value}


def match_to_dict(m: Match) -> dict[str, Any]:
    def service_accounts(items: Iterable[ServiceAccountMatch]) -> list[dict[str, str]]:
        return [{"namespace": sa.namespace, "serviceAccount": sa.service_account} for sa in items]

    return {
        "namespaces": [string_match_to_dict(x) for x in m.namespaces],
        "notNamespaces": [string_match_to_dict(x) for x in m.not_namespaces],
        "principals": [string_match_to_dict(x) for x in m.principals],
        "notPrincipals": [string_match_to_dict(x) for x in m.not_principals],
        "sourceIps": [str(net) for net in m.source_ips],
        "notSourceIps": [str(net) for net in m.not_source_ips],
        "destinationIps": [str(net) for net in m.destination_ips],
        "notDestinationIps": [str(net) for net in m.not_destination_ips],
        "destinationPorts": list(m.destination_ports),
        "notDestinationPorts": list(m.not_destination_ports),
        "serviceAccounts": service_accounts(m.service_accounts),
        "notServiceAccounts": service_accounts(m.not_service_accounts),
    }


def policy_to_dict(p: Authorization) -> dict[str, Any]:
    return {
        "name": p.name,
        "namespace": p.namespace,
        "scope": _name(SCOPES, p.scope),
        "action": _name(ACTIONS, p.action),
        "rules": [[[match_to_dict(m) for m in clause] for clause in rule] for rule in p.rules],
        "dryRun": p.dry_run,
    }
