"""The in-memory model of what a control plane sends: workloads and services.

These are immutable values. `mesh.localconfig` builds them from the reference's YAML format and the
xDS client from `istio.workload.Address` messages; `ztunnel.state.store` indexes them. Field names follow
the proto's (snake_case); enums are Python enums whose values are the proto numbers.
"""

from __future__ import annotations

import enum
import ipaddress
from dataclasses import dataclass, field

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class TunnelProtocol(enum.IntEnum):
    NONE = 0  # plain TCP ("TCP" in the local config)
    HBONE = 1
    LEGACY_ISTIO_MTLS = 2  # rejected at ingest


class WorkloadStatus(enum.IntEnum):
    HEALTHY = 0
    UNHEALTHY = 1


class NetworkMode(enum.IntEnum):
    STANDARD = 0
    HOST_NETWORK = 1


class AppTunnelProtocol(enum.IntEnum):
    NONE = 0
    PROXY = 1


class IPFamilies(enum.IntEnum):
    AUTOMATIC = 0
    IPV4_ONLY = 1
    IPV6_ONLY = 2
    DUAL = 3


class Visibility(enum.IntEnum):
    PUBLIC = 0
    NAMESPACE = 1


class LoadBalancingScope(enum.IntEnum):
    UNSPECIFIED_SCOPE = 0
    REGION = 1
    ZONE = 2
    SUBZONE = 3
    NODE = 4
    CLUSTER = 5
    NETWORK = 6


class LoadBalancingMode(enum.IntEnum):
    UNSPECIFIED_MODE = 0  # "Standard" in the local config
    STRICT = 1
    FAILOVER = 2
    PASSTHROUGH = 3


class HealthPolicy(enum.IntEnum):
    ONLY_HEALTHY = 0
    ALLOW_ALL = 1


@dataclass(frozen=True, slots=True)
class NetworkAddress:
    """An IP in a network (`"<network>/<ip>"` in the local config; network may be empty)."""

    network: str
    address: IPAddress

    def __str__(self) -> str:
        return f"{self.network}/{self.address}"


@dataclass(frozen=True, slots=True)
class NamespacedHostname:
    namespace: str
    hostname: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.hostname}"


@dataclass(frozen=True, slots=True)
class GatewayAddress:
    """A waypoint or network gateway: an address or a namespaced hostname, plus its HBONE port."""

    destination: NetworkAddress | NamespacedHostname
    hbone_mtls_port: int = 15008


@dataclass(frozen=True, slots=True)
class WeightedWaypoint:
    destination: GatewayAddress
    weight: int


@dataclass(frozen=True, slots=True)
class ApplicationTunnel:
    protocol: AppTunnelProtocol = AppTunnelProtocol.NONE
    port: int | None = None  # None: keep the resolved port


@dataclass(frozen=True, slots=True)
class Locality:
    region: str = ""
    zone: str = ""
    subzone: str = ""


# Not `frozen`: a frozen dataclass's generated `__init__` sets each of its 25 fields through
# `object.__setattr__`, four times the cost of plain slot stores, and a cluster's first push makes
# 100,000 of them (a worker makes one per decoded image record). Nothing assigns to a Workload once
# it is made (`dataclasses.replace` makes a new one); `unsafe_hash` hashes it by its fields, as
# frozen would.
@dataclass(slots=True, unsafe_hash=True)
class Workload:
    uid: str
    name: str = ""
    namespace: str = ""
    addresses: tuple[IPAddress, ...] = ()
    hostname: str = ""
    network: str = ""
    tunnel_protocol: TunnelProtocol = TunnelProtocol.NONE
    trust_domain: str = ""
    service_account: str = ""
    waypoint: GatewayAddress | None = None
    network_gateway: GatewayAddress | None = None
    node: str = ""
    canonical_name: str = ""
    canonical_revision: str = ""
    workload_type: str = ""  # lowercased: deployment | cronjob | pod | job (free string locally)
    workload_name: str = ""
    native_tunnel: bool = False
    application_tunnel: ApplicationTunnel | None = None
    # "namespace/hostname" -> {service port: target port}
    services: tuple[tuple[str, tuple[tuple[int, int], ...]], ...] = ()
    authorization_policies: tuple[str, ...] = ()
    status: WorkloadStatus = WorkloadStatus.HEALTHY
    cluster_id: str = ""
    locality: Locality = field(default_factory=Locality)
    network_mode: NetworkMode = NetworkMode.STANDARD
    capacity: int = 1

    @property
    def identity_uri(self) -> str:
        """The SPIFFE URI of the workload (`spiffe://td/ns/ns/sa/sa`)."""
        return f"spiffe://{self.trust_domain}/ns/{self.namespace}/sa/{self.service_account}"


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A workload's membership in a service: its port mapping (service port -> target port) and health."""

    workload_uid: str
    port: tuple[tuple[int, int], ...] = ()
    status: WorkloadStatus = WorkloadStatus.HEALTHY

    def target_port(self, service_port: int) -> int | None:
        for svc, target in self.port:
            if svc == service_port:
                return target
        return None


@dataclass(frozen=True, slots=True)
class LoadBalancer:
    routing_preferences: tuple[LoadBalancingScope, ...] = ()
    mode: LoadBalancingMode = LoadBalancingMode.UNSPECIFIED_MODE
    health_policy: HealthPolicy = HealthPolicy.ONLY_HEALTHY


@dataclass(frozen=True, slots=True)
class CidrVip:
    network: str
    cidr: IPNetwork


@dataclass(frozen=True, slots=True)
class Service:
    name: str
    namespace: str
    hostname: str
    vips: tuple[NetworkAddress, ...] = ()
    cidr_vips: tuple[CidrVip, ...] = ()
    ports: tuple[tuple[int, int], ...] = ()  # service port -> target port (0: per endpoint)
    subject_alt_names: tuple[str, ...] = ()
    waypoint: GatewayAddress | None = None
    weighted_waypoints: tuple[WeightedWaypoint, ...] = ()
    load_balancer: LoadBalancer | None = None
    ip_families: IPFamilies = IPFamilies.AUTOMATIC
    canonical: bool = False
    visibility: Visibility = Visibility.PUBLIC
    # Endpoints listed in the service itself (local config `endpoints`); the store merges the
    # workloads' `services` memberships into its own endpoint sets.
    endpoints: tuple[Endpoint, ...] = ()
    # For ingress gateways (their traffic to go through the waypoint): kept as received, used by no
    # decision of ztunnel's.
    ingress_use_waypoint: bool = False

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.hostname}"

    def target_port(self, service_port: int) -> int | None:
        """The target port of a service port: None when the service lacks the port, 0 for per-endpoint."""
        for svc, target in self.ports:
            if svc == service_port:
                return target
        return None


# --- rules shared by every source of the model (wire conversion and the local-config loader) ----


class ConversionError(ValueError):
    """A wire message the model cannot hold; `reason` says why (it goes into the NACK)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def ip_from_bytes(raw: bytes) -> IPAddress:
    """An IP from its 4 or 16 network-order bytes (an IPv4-mapped IPv6 address stays IPv6)."""
    if len(raw) == 4:
        return ipaddress.IPv4Address(raw)
    if len(raw) == 16:
        return ipaddress.IPv6Address(raw)
    raise ConversionError(f"invalid IP address: {len(raw)} bytes (expected 4 or 16)")


def cidr(ip: IPAddress, length: int) -> IPNetwork:
    """The network of `ip/length`, host bits allowed; the length is taken literally (0 is /0)."""
    return cidr_from_bytes(ip.packed, length)


def cidr_from_bytes(raw: bytes, length: int) -> IPNetwork:
    """`cidr` of an address in its 4 or 16 network-order bytes. Built from the masked number: parsing
    `(address, length)` costs ten times as much, which a policy of 100k CIDRs pays 100k times."""
    bits = 8 * len(raw)
    if bits not in (32, 128):
        ip_from_bytes(raw)  # raises its error
    if not 0 <= length <= bits:
        ip = ip_from_bytes(raw)
        raise ConversionError(f"invalid prefix length {length} for {ip} (expected 0..{bits})")
    number = int.from_bytes(raw, "big") & ~((1 << (bits - length)) - 1)
    if bits == 32:
        return ipaddress.IPv4Network((number, length))
    return ipaddress.IPv6Network((number, length))


def check_service_key(key: str) -> str:
    """A workload's `services` key must read `<namespace>/<hostname>`."""
    if "/" not in key:
        raise ConversionError(f"invalid service key {key!r} (expected '<namespace>/<hostname>')")
    return key


def app_tunnel_port(port: int) -> int | None:
    """Nothing listens on port 0: an application tunnel's port 0 means "keep the resolved port"."""
    return port or None
