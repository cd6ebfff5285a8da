"""Waypoints: Gateways of the `istio-waypoint` class, and which of them an object uses.

Any Gateway with `status.addresses` can be a waypoint, as for istiod; its address is the first
`Hostname` there, else the first `IPAddress`. Manifests usually carry no status (no controller has
run): then a Gateway of the `istio-waypoint` class (or of a GatewayClass whose controller is
`istio.io/mesh-controller`) is a waypoint at the hostname Istio's gateway controller would publish,
`<name>.<namespace>.svc.<domain>`. It serves the
traffic its `istio.io/waypoint-for` label says (on the Gateway, else its class; `service` by default).

An object uses the waypoint named by its own `istio.io/use-waypoint` label (`none` opts out), else its
namespace's; `istio.io/use-waypoint-namespace` names another namespace. The waypoint must allow
routes from the object's namespace (its HBONE 15008 listener's `allowedRoutes`; the same namespace
by default). A Service takes a waypoint for `service` or `all` traffic, a Pod or WorkloadEntry one
for `workload` or `all`.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from controlplane.kube.cluster import (
    GATEWAY_MANAGED_LABEL,
    GATEWAY_NAME_LABEL,
    INBOUND_BINDING_ANNOTATION,
    USE_WAYPOINT,
    USE_WAYPOINT_NAMESPACE,
    WAYPOINT_FOR,
    Cluster,
    mapping,
    selects,
    string_map,
)
from controlplane.kube.manifests import Obj
from mesh.model import (
    ApplicationTunnel,
    AppTunnelProtocol,
    GatewayAddress,
    NamespacedHostname,
    NetworkAddress,
)

WAYPOINT_CLASS = "istio-waypoint"
MESH_CONTROLLER = "istio.io/mesh-controller"
MANAGED_BY_MESH = "istio.io-mesh-controller"
MANAGED_BY_EAST_WEST = "istio.io-eastwest-controller"
HBONE_PORT = 15008


@dataclass(frozen=True, slots=True)
class Waypoint:
    namespace: str
    name: str
    address: GatewayAddress
    traffic_type: str  # service | workload | all | none
    binding: ApplicationTunnel | None
    allowed_from: str  # Same | All | Selector
    allowed_selector: Mapping[str, str]

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    def allows(self, namespace: str, namespace_labels: Mapping[str, str]) -> bool:
        if self.allowed_from == "All":
            return True
        if self.allowed_from == "Selector":
            return selects(self.allowed_selector, namespace_labels)
        return namespace == self.namespace


class WaypointError(Exception):
    """Why an object's waypoint label could not be honoured (a warning for the user, as istiod's status)."""


def _address(gateway: Obj, cluster: Cluster) -> GatewayAddress:
    addresses = [a for a in gateway.status.get("addresses") or [] if isinstance(a, dict)]
    for a in addresses:
        if a.get("type", "IPAddress") == "Hostname" and isinstance(a.get("value"), str):
            return GatewayAddress(NamespacedHostname(gateway.namespace, a["value"]), HBONE_PORT)
    for a in addresses:
        if a.get("type", "IPAddress") == "IPAddress":
            try:
                return GatewayAddress(
                    NetworkAddress(cluster.network, ipaddress.ip_address(str(a.get("value"))))
                )
            except ValueError:
                continue
    hostname = cluster.service_hostname(gateway.name, gateway.namespace)
    return GatewayAddress(NamespacedHostname(gateway.namespace, hostname), HBONE_PORT)


def _binding(gateway: Obj, gateway_class: Obj | None) -> ApplicationTunnel | None:
    value = gateway.annotations.get(INBOUND_BINDING_ANNOTATION)
    if value is None and gateway_class is not None:
        value = gateway_class.annotations.get(INBOUND_BINDING_ANNOTATION)
    if value is None:
        return None
    protocol, _, port = value.partition("/")
    if protocol not in ("NONE", "PROXY") or (port and not port.isdigit()):
        return None
    return ApplicationTunnel(AppTunnelProtocol[protocol], int(port) if port and int(port) else None)


def _allowed_routes(gateway: Obj) -> tuple[str, Mapping[str, str]]:
    for listener in gateway.spec.get("listeners") or []:
        if (
            isinstance(listener, dict)
            and listener.get("protocol") == "HBONE"
            and listener.get("port") == HBONE_PORT
        ):
            namespaces = mapping(
                mapping(listener.get("allowedRoutes"), "allowedRoutes").get("namespaces"), "namespaces"
            )
            selector = mapping(namespaces.get("selector"), "selector")
            return str(namespaces.get("from") or "Same"), string_map(
                selector.get("matchLabels"), "matchLabels"
            )
    return "Same", {}


def is_waypoint_gateway(gateway: Obj, cluster: Cluster) -> bool:
    """istiod takes any Gateway with `status.addresses` as a possible waypoint; without a status (no
    controller ran), only one of the waypoint class."""
    if gateway.status.get("addresses"):
        return True
    class_name = gateway.spec.get("gatewayClassName")
    if class_name == WAYPOINT_CLASS:
        return True
    gateway_class = cluster.get("GatewayClass", str(class_name))
    return gateway_class is not None and gateway_class.spec.get("controllerName") == MESH_CONTROLLER


def waypoint_of(gateway: Obj, cluster: Cluster) -> Waypoint:
    gateway_class = cluster.get("GatewayClass", str(gateway.spec.get("gatewayClassName")))
    traffic_type = "service"
    if gateway_class is not None and WAYPOINT_FOR in gateway_class.labels:
        traffic_type = gateway_class.labels[WAYPOINT_FOR]
    traffic_type = gateway.labels.get(WAYPOINT_FOR, traffic_type)
    allowed_from, selector = _allowed_routes(gateway)
    return Waypoint(
        gateway.namespace,
        gateway.name,
        _address(gateway, cluster),
        traffic_type,
        _binding(gateway, gateway_class),
        allowed_from,
        selector,
    )


def _named(labels: Mapping[str, str], default_namespace: str) -> tuple[str, str] | str | None:
    """(namespace, name) from `use-waypoint`; "none" for the opt-out; None when the label is absent."""
    value = labels.get(USE_WAYPOINT)
    if value is None:
        return None
    if value == "none":
        return "none"
    return labels.get(USE_WAYPOINT_NAMESPACE, default_namespace), value


class Waypoints:
    """The waypoints by `namespace/name`; a label that names none that can serve is a warning (as
    istiod's status condition) and no waypoint."""

    def __init__(self, cluster: Cluster, gateways: list[Waypoint]) -> None:
        self.cluster = cluster
        self.by_key = {w.key: w for w in gateways}
        self.warnings: list[str] = []

    def _warned(self, who: str, find: Callable[[], Waypoint | None]) -> Waypoint | None:
        try:
            return find()
        except WaypointError as e:
            self.warnings.append(f"{who}: {e}; no waypoint is used")
            return None

    def _lookup(self, named: tuple[str, str], namespace: str) -> Waypoint:
        key = f"{named[0]}/{named[1]}"
        waypoint = self.by_key.get(key)
        if waypoint is None:
            raise WaypointError(
                f"waypoint {key} is not found (no Gateway of class {WAYPOINT_CLASS}, nor one with status.addresses)"
            )
        if not waypoint.allows(namespace, self.cluster.namespace_labels(namespace)):
            raise WaypointError(f"waypoint {key} does not allow attachment from namespace {namespace}")
        return waypoint

    def for_target(self, namespace: str, labels: Mapping[str, str]) -> Waypoint | None:
        """The waypoint an object's or else its namespace's label names; raises WaypointError."""
        own = _named(labels, namespace)
        if own == "none":
            return None
        if isinstance(own, tuple):
            return self._lookup(own, namespace)
        ns = _named(self.cluster.namespace_labels(namespace), namespace)
        if isinstance(ns, tuple):
            return self._lookup(ns, namespace)
        return None

    def for_service(self, who: str, namespace: str, labels: Mapping[str, str]) -> Waypoint | None:
        if labels.get(GATEWAY_MANAGED_LABEL) in (MANAGED_BY_MESH, MANAGED_BY_EAST_WEST):
            return None  # the waypoint's (or an east-west gateway's) own Service

        def find() -> Waypoint | None:
            waypoint = self.for_target(namespace, labels)
            if waypoint is None or waypoint.traffic_type in ("service", "all"):
                return waypoint
            raise WaypointError(
                f"waypoint {waypoint.key} is for {waypoint.traffic_type} traffic, not service"
            )

        return self._warned(who, find)

    def for_workload(self, who: str, namespace: str, labels: Mapping[str, str]) -> Waypoint | None:
        def find() -> Waypoint | None:
            waypoint = self.for_target(namespace, labels)
            if waypoint is None or waypoint.traffic_type in ("workload", "all"):
                return waypoint
            if USE_WAYPOINT not in labels:
                return None  # a namespace's service waypoint is no workload's concern
            raise WaypointError(
                f"waypoint {waypoint.key} is for {waypoint.traffic_type} traffic, not workload"
            )

        return self._warned(who, find)

    def instance_of(self, namespace: str, labels: Mapping[str, str]) -> Waypoint | None:
        """The waypoint a pod is an instance of (`gateway.networking.k8s.io/gateway-name`)."""
        name = labels.get(GATEWAY_NAME_LABEL)
        return self.by_key.get(f"{namespace}/{name}") if name else None
