"""The objects of one cluster, indexed, and the field readers every conversion shares.

`Options` are what istiod takes from its environment and mesh config: the cluster id, the trust
domain, the DNS domain suffix and the root namespace. The cluster's network is the
`topology.istio.io/network` label of the system namespace, as istiod reads it.
"""

from __future__ import annotations

import ipaddress
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from controlplane.kube.manifests import Obj, Refusal, refuse
from mesh.localconfig import describe_value
from mesh.model import IPAddress, IPNetwork, Locality

T = TypeVar("T")

# Label and annotation names istiod reads.
NETWORK_LABEL = "topology.istio.io/network"
REGION_LABEL = "topology.kubernetes.io/region"
ZONE_LABEL = "topology.kubernetes.io/zone"
SUBZONE_LABEL = "topology.istio.io/subzone"
DATAPLANE_MODE = "istio.io/dataplane-mode"
REDIRECTION_ANNOTATION = "ambient.istio.io/redirection"
SIDECAR_STATUS_ANNOTATION = "sidecar.istio.io/status"
TUNNEL_LABEL = "networking.istio.io/tunnel"
GATEWAY_NAME_LABEL = "gateway.networking.k8s.io/gateway-name"
GATEWAY_MANAGED_LABEL = "gateway.istio.io/managed"
USE_WAYPOINT = "istio.io/use-waypoint"
USE_WAYPOINT_NAMESPACE = "istio.io/use-waypoint-namespace"
USE_WAYPOINT_CANARY = "istio.io/use-waypoint-canary"
USE_WAYPOINT_CANARY_NAMESPACE = "istio.io/use-waypoint-canary-namespace"
CANARY_WEIGHT_ANNOTATION = "istio.io/use-waypoint-canary-weight"
INGRESS_USE_WAYPOINT = "istio.io/ingress-use-waypoint"
WAYPOINT_FOR = "istio.io/waypoint-for"
WORKLOAD_NAME_LABEL = "service.istio.io/workload-name"
TRAFFIC_DISTRIBUTION_ANNOTATION = "networking.istio.io/traffic-distribution"
DRY_RUN_ANNOTATION = "istio.io/dry-run"
INBOUND_BINDING_ANNOTATION = "ambient.istio.io/waypoint-inbound-binding"
AUTO_REGISTRATION_GROUP_ANNOTATION = "istio.io/autoRegistrationGroup"
CANONICAL_NAME_LABELS = ("service.istio.io/canonical-name", "app.kubernetes.io/name", "app")
CANONICAL_REVISION_LABELS = ("service.istio.io/canonical-revision", "app.kubernetes.io/version", "version")


@dataclass(frozen=True, slots=True)
class Options:
    cluster_id: str = "Kubernetes"
    trust_domain: str = "cluster.local"
    domain_suffix: str = "cluster.local"
    root_namespace: str = "istio-system"
    system_namespace: str = "istio-system"

    @property
    def wire_trust_domain(self) -> str:
        """istiod leaves the default trust domain out of a workload (the proxy assumes it)."""
        return "" if self.trust_domain == "cluster.local" else self.trust_domain


class Cluster:
    """Objects by kind; a second object of the same kind, namespace and name is refused."""

    def __init__(self, objects: Iterable[Obj], options: Options) -> None:
        self.options = options
        self.refusals: list[Refusal] = []
        self._by_kind: dict[str, dict[str, Obj]] = defaultdict(dict)
        for obj in objects:
            table = self._by_kind[obj.kind]
            if obj.key in table:
                self.refusals.append(obj.refusal(f"a duplicate of the one in {table[obj.key].where}"))
                continue
            table[obj.key] = obj
        system = self.namespace(options.system_namespace)
        self.network = system.labels.get(NETWORK_LABEL, "") if system is not None else ""

    def of(self, kind: str) -> list[Obj]:
        return list(self._by_kind.get(kind, {}).values())

    def get(self, kind: str, key: str) -> Obj | None:
        return self._by_kind.get(kind, {}).get(key)

    def namespace(self, name: str) -> Obj | None:
        return self.get("Namespace", name)

    def namespace_labels(self, name: str) -> Mapping[str, str]:
        ns = self.namespace(name)
        return ns.labels if ns is not None else {}

    def namespace_annotations(self, name: str) -> Mapping[str, str]:
        ns = self.namespace(name)
        return ns.annotations if ns is not None else {}

    def node_locality(self, node_name: str) -> Locality:
        node = self.get("Node", node_name)
        if node is None:
            return Locality()
        labels = node.labels
        return Locality(
            labels.get(REGION_LABEL, ""), labels.get(ZONE_LABEL, ""), labels.get(SUBZONE_LABEL, "")
        )

    def service_hostname(self, name: str, namespace: str) -> str:
        return f"{name}.{namespace}.svc.{self.options.domain_suffix}"


# --- reading fields -----------------------------------------------------------------------------


def text(value: object, where: str, default: str = "") -> str:
    if value is None:
        return default
    if not isinstance(value, str):
        refuse(f"{where}: expected a string, got {describe_value(value)}")
    return value


def integer(value: object, where: str, low: int = 0, high: int = 65535) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        refuse(f"{where}: expected an integer, got {describe_value(value)}")
    if not low <= value <= high:
        refuse(f"{where}: {value} is out of range ({low}..{high})")
    return value


def items(value: object, where: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        refuse(f"{where}: expected a list, got {describe_value(value)}")
    return value


def mapping(value: object, where: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        refuse(f"{where}: expected a mapping, got {describe_value(value)}")
    return value


def strings(value: object, where: str) -> list[str]:
    return [text(v, f"{where}[{i}]") for i, v in enumerate(items(value, where))]


def string_map(value: object, where: str) -> dict[str, str]:
    return {str(k): text(v, f"{where}.{k}") for k, v in mapping(value, where).items()}


def ip(value: object, where: str) -> IPAddress:
    raw = text(value, where)
    try:
        return ipaddress.ip_address(raw)
    except ValueError:
        refuse(f"{where}: invalid IP address {raw!r}")


def ip_or_cidr(value: object, where: str) -> IPNetwork:
    raw = text(value, where)
    try:
        return ipaddress.ip_network(raw, strict=False)
    except ValueError:
        refuse(f"{where}: invalid IP address or CIDR {raw!r}")


def selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    """A label selector's `matchLabels` (or a Service's `selector`) against an object's labels."""
    return all(labels.get(k) == v for k, v in selector.items())


class SelectorIndex(Generic[T]):
    """Items that select objects by labels in a namespace, found from an object's labels without testing
    every selector: each item is filed under one of its (label, value) pairs. An empty selector
    selects every object of its namespace."""

    def __init__(self, entries: Iterable[tuple[str, Mapping[str, str], T]]) -> None:
        self._by_pair: dict[tuple[str, str, str], list[tuple[int, Mapping[str, str], T]]] = defaultdict(list)
        self._everything: dict[str, list[tuple[int, Mapping[str, str], T]]] = defaultdict(list)
        for n, (namespace, selector, item) in enumerate(entries):
            if selector:
                key, value = next(iter(selector.items()))
                self._by_pair[(namespace, key, value)].append((n, selector, item))
            else:
                self._everything[namespace].append((n, selector, item))

    def select(self, namespaces: Iterable[str], labels: Mapping[str, str]) -> list[T]:
        """The items of `namespaces` whose selector selects `labels`, in the order they were given."""
        found: list[tuple[int, Mapping[str, str], T]] = []
        for namespace in namespaces:
            found += self._everything.get(namespace, ())
            for key, value in labels.items():
                for entry in self._by_pair.get((namespace, key, value), ()):
                    if selects(entry[1], labels):
                        found.append(entry)
        return [item for _, _, item in sorted(found, key=lambda e: e[0])]


def first_label(labels: Mapping[str, str], names: Iterable[str]) -> str | None:
    for name in names:
        if name in labels:
            return labels[name]
    return None


def canonical(labels: Mapping[str, str], workload_name: str) -> tuple[str, str]:
    """istiod's canonical service name and revision: the first label present, else the workload's name
    and `latest`."""
    name = first_label(labels, CANONICAL_NAME_LABELS)
    revision = first_label(labels, CANONICAL_REVISION_LABELS)
    return (workload_name if name is None else name, "latest" if revision is None else revision)
