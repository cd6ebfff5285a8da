"""Waypoints: Gateways of the `istio-waypoint` class, and which of them an object uses.

Any Gateway with `status.addresses` can be a waypoint, as for istiod; its address is the first
`Hostname` there (an empty one refuses the Gateway), else the first `IPAddress`. Manifests usually
carry no status (no controller has run): then a Gateway of the `istio-waypoint` class (or of a
GatewayClass whose controller is `istio.io/mesh-controller`) is a waypoint at the hostname Istio's
gateway controller would publish, `<name>.<namespace>.svc.<domain>`. It serves the traffic its
`istio.io/waypoint-for` label says (on the Gateway, else its class; `service` by default).

An object uses the waypoint named by its own `istio.io/use-waypoint` label (`none` opts out), else its
namespace's; `istio.io/use-waypoint-namespace` names another namespace. The waypoint must allow
routes from the object's namespace (its HBONE 15008 listener's `allowedRoutes`; the same namespace
by default). A Service takes a waypoint for `service` or `all` traffic, a Pod or WorkloadEntry one
for `workload` or `all`.

A Service or ServiceEntry with a waypoint may name a canary beside it: `istio.io/use-waypoint-canary`
(`istio.io/use-waypoint-canary-namespace` for another namespace) and the share of connections it
takes, the annotation `istio.io/use-waypoint-canary-weight` (0 to 100, 0 when absent). Both come from
the level the primary waypoint came from: the object's own labels, or its namespace's when the
object names no waypoint of its own. It becomes `weighted_waypoints`: the primary at 100 - weight,
the canary at weight. A canary that is the primary, has an invalid weight, or cannot serve the
service as a primary could not is a warning, and the primary takes everything.

A Service or ServiceEntry with a waypoint carries `ingress_use_waypoint` (for ingress gateways; ztunnel
ignores it) from its `istio.io/ingress-use-waypoint` label, else its namespace's, read as Go's
`strconv.ParseBool` reads it; another value is a warning and false.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from controlplane.kube.cluster import (
    CANARY_WEIGHT_ANNOTATION,
    GATEWAY_MANAGED_LABEL,
    GATEWAY_NAME_LABEL,
    INBOUND_BINDING_ANNOTATION,
    INGRESS_USE_WAYPOINT,
    USE_WAYPOINT,
    USE_WAYPOINT_CANARY,
    USE_WAYPOINT_CANARY_NAMESPACE,
    USE_WAYPOINT_NAMESPACE,
    WAYPOINT_FOR,
    Cluster,
    mapping,
    selects,
    string_map,
)
from controlplane.kube.manifests import Obj, Refused
from mesh.model import (
    ApplicationTunnel,
    AppTunnelProtocol,
    GatewayAddress,
    NamespacedHostname,
    NetworkAddress,
    WeightedWaypoint,
)

WAYPOINT_CLASS = "istio-waypoint"
MESH_CONTROLLER = "istio.io/mesh-controller"
MANAGED_BY_MESH = "istio.io-mesh-controller"
MANAGED_BY_EAST_WEST = "istio.io-eastwest-controller"
HBONE_PORT = 15008
_WEIGHT = re.compile(r"[+-]?[0-9]+")  # what Go's strconv.Atoi reads
# What Go's strconv.ParseBool reads.
_TRUE = ("1", "t", "T", "TRUE", "true", "True")
_FALSE = ("0", "f", "F", "FALSE", "false", "False")


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
            if not a["value"]:
                # A waypoint at no hostname could never be reached: the proxies would refuse it.
                raise Refused("status.addresses: a Hostname address that is empty; not a waypoint")
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

    def for_service(
        self, who: str, namespace: str, labels: Mapping[str, str], *, namespace_only: bool = False
    ) -> Waypoint | None:
        """`namespace_only`: a ServiceEntry of NAMESPACE visibility, which no waypoint of another
        namespace may serve (that would show it to the waypoint's namespace)."""
        if labels.get(GATEWAY_MANAGED_LABEL) in (MANAGED_BY_MESH, MANAGED_BY_EAST_WEST):
            return None  # the waypoint's (or an east-west gateway's) own Service

        def find() -> Waypoint | None:
            waypoint = self.for_target(namespace, labels)
            if waypoint is None:
                return None
            if waypoint.traffic_type not in ("service", "all"):
                raise WaypointError(
                    f"waypoint {waypoint.key} is for {waypoint.traffic_type} traffic, not service"
                )
            if namespace_only and waypoint.namespace != namespace:
                raise WaypointError(
                    f"cannot bind to waypoint {waypoint.key} in another namespace: not permitted for a "
                    "ServiceEntry with NAMESPACE visibility"
                )
            return waypoint

        return self._warned(who, find)

    def canary_of(self, who: str, obj: Obj, primary: Waypoint | None) -> tuple[WeightedWaypoint, ...]:
        """A Service's or ServiceEntry's `weighted_waypoints`: none without a primary or a canary."""
        if primary is None:
            return ()
        labels, annotations = obj.labels, obj.annotations
        if USE_WAYPOINT not in labels:  # the primary is the namespace's: so is the canary
            ns = self.cluster.namespace(obj.namespace)
            ns_labels = ns.labels if ns is not None else {}
            ns_annotations = ns.annotations if ns is not None else {}
            if USE_WAYPOINT_CANARY not in labels and USE_WAYPOINT_CANARY in ns_labels:
                labels = ns_labels
            if CANARY_WEIGHT_ANNOTATION not in annotations:
                annotations = ns_annotations
        name = labels.get(USE_WAYPOINT_CANARY, "")
        if name in ("", "none"):
            return ()
        named = (labels.get(USE_WAYPOINT_CANARY_NAMESPACE, obj.namespace), name)

        def find() -> Waypoint:
            key = f"{named[0]}/{named[1]}"
            if key == primary.key:
                raise WaypointError(f"canary waypoint {key} must differ from the primary waypoint")
            raw = annotations.get(CANARY_WEIGHT_ANNOTATION, "0")
            if not _WEIGHT.fullmatch(raw) or not 0 <= int(raw) <= 100:
                raise WaypointError(
                    f"canary waypoint {key} has an invalid weight {raw!r}; must be an integer in [0,100]"
                )
            canary = self._lookup(named, obj.namespace)
            if canary.traffic_type not in ("service", "all"):
                raise WaypointError(
                    f"canary waypoint {key} is for {canary.traffic_type} traffic, not service"
                )
            return canary

        try:
            canary = find()
        except WaypointError as e:
            self.warnings.append(f"{who}: {e}; the primary waypoint takes all its traffic")
            return ()
        weight = int(annotations.get(CANARY_WEIGHT_ANNOTATION, "0"))
        return (WeightedWaypoint(primary.address, 100 - weight), WeightedWaypoint(canary.address, weight))

    def ingress_use(self, who: str, obj: Obj, waypoint: Waypoint | None) -> bool:
        """A Service's or ServiceEntry's `ingress_use_waypoint`: only with a waypoint."""
        if waypoint is None:
            return False
        value = obj.labels.get(INGRESS_USE_WAYPOINT)
        if value is None:
            value = self.cluster.namespace_labels(obj.namespace).get(INGRESS_USE_WAYPOINT)
        if value is None:
            return False
        if value not in _TRUE + _FALSE:
            self.warnings.append(
                f"{who}: invalid value for label {INGRESS_USE_WAYPOINT}: {value!r}, defaulting to false"
            )
        return value in _TRUE

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
