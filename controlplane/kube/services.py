"""Services and ServiceEntries to the services a proxy receives, as istiod's ambient index builds them.

A Service becomes one service named `<name>.<namespace>.svc.<domain>`: its cluster IPs as VIPs on the
cluster's network (none when headless), its ports with their numeric target ports (0 for a named one,
resolved per endpoint), `canonical`. `internalTrafficPolicy: Local` is strict node-local balancing;
otherwise `trafficDistribution` (or the `networking.istio.io/traffic-distribution` annotation, on the
Service then its namespace) `PreferClose`/`PreferSameZone` is failover by network, region, zone, and
`PreferSameNode` adds subzone and node. `publishNotReadyAddresses` lets unhealthy endpoints serve.
An `ExternalName` Service is not sent, as by istiod.

A ServiceEntry becomes one service per host: its `addresses` (IPs or CIDRs), its ports (target port
defaulting to the port), its subject alt names; `resolution: NONE` is passthrough to any endpoint; the
visibility the mesh config gives it (`meshconfig.py`).

Where a Service and ServiceEntries share a hostname in one namespace, the Service wins, else the
oldest ServiceEntry; the one marked `canonical` across namespaces is the Service, else the oldest
ServiceEntry visible to every namespace.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from controlplane.kube.cluster import (
    TRAFFIC_DISTRIBUTION_ANNOTATION,
    Cluster,
    integer,
    ip,
    ip_or_cidr,
    items,
    mapping,
    string_map,
    strings,
    text,
)
from controlplane.kube.manifests import Obj, refuse
from controlplane.kube.waypoints import Waypoint
from mesh.model import (
    CidrVip,
    HealthPolicy,
    IPFamilies,
    LoadBalancer,
    LoadBalancingMode,
    LoadBalancingScope,
    NetworkAddress,
    Service,
    Visibility,
    WeightedWaypoint,
)

PREFER_SAME_ZONE = LoadBalancer(
    (LoadBalancingScope.NETWORK, LoadBalancingScope.REGION, LoadBalancingScope.ZONE),
    LoadBalancingMode.FAILOVER,
)
PREFER_SAME_NODE = LoadBalancer(
    (
        LoadBalancingScope.NETWORK,
        LoadBalancingScope.REGION,
        LoadBalancingScope.ZONE,
        LoadBalancingScope.SUBZONE,
        LoadBalancingScope.NODE,
    ),
    LoadBalancingMode.FAILOVER,
)
NODE_LOCAL = LoadBalancer((LoadBalancingScope.NODE,), LoadBalancingMode.STRICT)
PASSTHROUGH = LoadBalancer((), LoadBalancingMode.PASSTHROUGH, HealthPolicy.ALLOW_ALL)


@dataclass(frozen=True, slots=True)
class PortName:
    name: str
    target_name: str = ""  # a Service's named targetPort


@dataclass(frozen=True)
class ServiceInfo:
    """A service with what selecting its endpoints needs: the selector and the port names."""

    service: Service
    source: Obj
    selector: Mapping[str, str]  # empty: selects nothing
    port_names: Mapping[int, PortName] = field(default_factory=dict)

    @property
    def from_service(self) -> bool:
        return self.source.kind == "Service"


def _traffic_distribution(
    spec_value: object, annotations: Mapping[str, str], ns: Mapping[str, str]
) -> LoadBalancer | None:
    if spec_value in ("PreferClose", "PreferSameZone"):
        return PREFER_SAME_ZONE
    if spec_value == "PreferSameNode":
        return PREFER_SAME_NODE
    for source in (annotations, ns):
        value = source.get(TRAFFIC_DISTRIBUTION_ANNOTATION, "").lower()
        if value in ("preferclose", "prefersamezone"):
            return PREFER_SAME_ZONE
        if value == "prefersamenode":
            return PREFER_SAME_NODE
        if value:
            return None  # an unknown value: any endpoint (istiod warns likewise)
    return None


def _service_ports(spec: Mapping[str, object]) -> tuple[tuple[tuple[int, int], ...], dict[int, PortName]]:
    ports: list[tuple[int, int]] = []
    names: dict[int, PortName] = {}
    for i, raw in enumerate(items(spec.get("ports"), "spec.ports")):
        where = f"spec.ports[{i}]"
        port_spec = mapping(raw, where)
        port = integer(port_spec.get("port"), f"{where}.port", 1)
        target = port_spec.get("targetPort", port)  # the API server's default
        if isinstance(target, str) and not target.isdigit():
            names[port] = PortName(text(port_spec.get("name"), f"{where}.name"), target)
            ports.append((port, 0))
        else:
            target_port = integer(
                int(target) if isinstance(target, str) else target, f"{where}.targetPort", 1
            )
            names[port] = PortName(text(port_spec.get("name"), f"{where}.name"))
            ports.append((port, target_port))
    return tuple(ports), names


def service_of(
    obj: Obj,
    cluster: Cluster,
    waypoint: Waypoint | None,
    weighted: tuple[WeightedWaypoint, ...] = (),
    ingress_use_waypoint: bool = False,
) -> ServiceInfo | None:
    """A Service's service; None for an ExternalName Service (not sent, as by istiod)."""
    spec = obj.spec
    if spec.get("type") == "ExternalName":
        return None
    ports, names = _service_ports(spec)
    cluster_ips = strings(spec.get("clusterIPs"), "spec.clusterIPs") or [
        text(spec.get("clusterIP"), "spec.clusterIP")
    ]
    vips = tuple(
        NetworkAddress(cluster.network, ip(v, "spec.clusterIPs")) for v in cluster_ips if v and v != "None"
    )
    balancer: LoadBalancer | None
    if spec.get("internalTrafficPolicy") == "Local":
        balancer = NODE_LOCAL
    else:
        balancer = _traffic_distribution(
            spec.get("trafficDistribution"), obj.annotations, cluster.namespace_annotations(obj.namespace)
        )
    if spec.get("publishNotReadyAddresses") is True:
        balancer = replace(balancer or LoadBalancer(), health_policy=HealthPolicy.ALLOW_ALL)
    families = strings(spec.get("ipFamilies"), "spec.ipFamilies")
    ip_families = IPFamilies.AUTOMATIC
    if len(families) == 2:
        ip_families = IPFamilies.DUAL
    elif len(families) == 1:
        ip_families = IPFamilies.IPV4_ONLY if families[0] == "IPv4" else IPFamilies.IPV6_ONLY
    service = Service(
        name=obj.name,
        namespace=obj.namespace,
        hostname=cluster.service_hostname(obj.name, obj.namespace),
        vips=vips,
        ports=ports,
        waypoint=waypoint.address if waypoint is not None else None,
        weighted_waypoints=weighted,
        load_balancer=balancer,
        ip_families=ip_families,
        canonical=True,
        ingress_use_waypoint=ingress_use_waypoint,
    )
    return ServiceInfo(service, obj, string_map(spec.get("selector"), "spec.selector"), names)


def _auto_allocated(obj: Obj) -> dict[str, list[str]]:
    """`status.addresses` (`{value, host}`) the IP auto-allocation controller writes."""
    out: dict[str, list[str]] = {}
    for entry in obj.status.get("addresses") or []:
        if isinstance(entry, dict) and isinstance(entry.get("value"), str):
            out.setdefault(str(entry.get("host", "")), []).append(entry["value"])
    return out


def service_entries_of(
    obj: Obj,
    cluster: Cluster,
    waypoint: Waypoint | None,
    visibility: Visibility = Visibility.PUBLIC,
    weighted: tuple[WeightedWaypoint, ...] = (),
    ingress_use_waypoint: bool = False,
) -> list[ServiceInfo]:
    spec = obj.spec
    hosts = strings(spec.get("hosts"), "spec.hosts")
    if not hosts:
        refuse("spec.hosts: at least one host is required")
    vips: list[NetworkAddress] = []
    cidr_vips: list[CidrVip] = []
    for i, raw in enumerate(items(spec.get("addresses"), "spec.addresses")):
        net = ip_or_cidr(raw, f"spec.addresses[{i}]")
        if net.prefixlen == net.max_prefixlen:
            vips.append(NetworkAddress(cluster.network, net.network_address))
        else:
            cidr_vips.append(CidrVip(cluster.network, net))
    ports: list[tuple[int, int]] = []
    names: dict[int, PortName] = {}
    for i, raw in enumerate(items(spec.get("ports"), "spec.ports")):
        where = f"spec.ports[{i}]"
        port_spec = mapping(raw, where)
        number = integer(port_spec.get("number"), f"{where}.number", 1)
        target = port_spec.get("targetPort")
        ports.append((number, integer(target, f"{where}.targetPort", 1) if target is not None else number))
        names[number] = PortName(text(port_spec.get("name"), f"{where}.name"))
    resolution = spec.get("resolution", "NONE")
    if resolution == "NONE":
        balancer: LoadBalancer | None = PASSTHROUGH
    else:
        balancer = _traffic_distribution(None, obj.annotations, cluster.namespace_annotations(obj.namespace))
    selector = string_map(
        mapping(spec.get("workloadSelector"), "spec.workloadSelector").get("labels"), "labels"
    )
    allocated = _auto_allocated(obj)
    out = []
    for host in hosts:
        host_vips = tuple(vips)
        if not vips and not cidr_vips and resolution != "NONE" and not host.startswith("*"):
            host_vips = tuple(
                NetworkAddress(cluster.network, ip(a, "status.addresses")) for a in allocated.get(host, [])
            )
        service = Service(
            name=obj.name,
            namespace=obj.namespace,
            hostname=host,
            vips=host_vips,
            cidr_vips=tuple(cidr_vips),
            ports=tuple(ports),
            subject_alt_names=tuple(strings(spec.get("subjectAltNames"), "spec.subjectAltNames")),
            waypoint=waypoint.address if waypoint is not None else None,
            weighted_waypoints=weighted,
            load_balancer=balancer,
            visibility=visibility,
            ingress_use_waypoint=ingress_use_waypoint,
        )
        out.append(ServiceInfo(service, obj, selector, names))
    return out


def select_services(infos: list[ServiceInfo]) -> list[ServiceInfo]:
    """One service per hostname and namespace (the Service, else the oldest ServiceEntry), and the
    canonical mark on the Service, else on the oldest public ServiceEntry (file order breaks ties)."""
    by_host: dict[str, dict[str, ServiceInfo]] = {}
    for info in infos:
        best = by_host.setdefault(info.service.hostname, {})
        current = best.get(info.service.namespace)
        if (
            current is None
            or info.from_service
            or (not current.from_service and info.source.created < current.source.created)
        ):
            best[info.service.namespace] = info
    out: list[ServiceInfo] = []
    for per_namespace in by_host.values():
        chosen = list(per_namespace.values())
        services = [i for i in chosen if i.from_service]
        public = [i for i in chosen if i.service.visibility is Visibility.PUBLIC]
        if not services and public:
            oldest = min(public, key=lambda i: i.source.created)
            chosen = [
                replace(i, service=replace(i.service, canonical=True)) if i is oldest else i for i in chosen
            ]
        out.extend(chosen)
    return out
