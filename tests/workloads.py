"""Workloads, services and policies as the store's tests build them."""

from __future__ import annotations

import ipaddress
from dataclasses import replace
from typing import Any

from mesh.model import (
    CidrVip,
    Endpoint,
    NetworkAddress,
    Service,
    Workload,
    WorkloadStatus,
)
from policy.model import Authorization, Scope

SVC = "ns/svc.example"


def ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    return ipaddress.ip_address(text)


def workload(
    uid: str,
    *ips: str,
    services: dict[str, dict[int, int]] | None = None,
    status: WorkloadStatus = WorkloadStatus.HEALTHY,
    namespace: str = "ns",
    **kwargs: Any,
) -> Workload:
    memberships = tuple((key, tuple(ports.items())) for key, ports in (services or {}).items())
    base = Workload(
        uid=uid, namespace=namespace, addresses=tuple(ip(a) for a in ips), services=memberships, status=status
    )
    return replace(base, **kwargs)


def service(
    name: str = "svc",
    namespace: str = "ns",
    vips: tuple[str, ...] = ("10.96.0.1",),
    hostname: str | None = None,
    **kwargs: Any,
) -> Service:
    base = Service(
        name=name,
        namespace=namespace,
        hostname=hostname or f"{name}.example",
        vips=tuple(NetworkAddress("", ip(v)) for v in vips),
        ports=((80, 8080),),
    )
    return replace(base, **kwargs)


def cidr_service(name: str, namespace: str, cidr: str, canonical: bool = False) -> Service:
    return service(
        name,
        namespace,
        vips=(),
        hostname=f"{name}.{namespace}.example",
        cidr_vips=(CidrVip("", ipaddress.ip_network(cidr)),),
        canonical=canonical,
    )


def uids(endpoints: list[Endpoint]) -> list[str]:
    return [ep.workload_uid for ep in endpoints]


VIP = ip("10.96.0.1")
MATCH_ALL = (((),),)


def pol(name: str, namespace: str, scope: Scope) -> Authorization:
    return Authorization(name=name, namespace=namespace, scope=scope, rules=MATCH_ALL)
