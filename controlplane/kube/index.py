"""The ambient index: a cluster's objects to the workloads, services and policies istiod would send.

`build` converts every object it reads in the order istiod's collections depend on each other:
the mesh config, waypoints (Gateways), services (Services and ServiceEntries, the latter scoped by
the mesh config's visibility, then one per hostname), policies
(AuthorizationPolicies, PeerAuthentications), then workloads (Pods, WorkloadEntries, ServiceEntry
and EndpointSlice endpoints), which name the services that select them and the policies that apply
to them. An object that cannot be converted is refused, with its kind, namespace, name and reason,
and left out; everything else is served.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import TypeVar

from controlplane.kube.cluster import Cluster, Options, SelectorIndex
from controlplane.kube.endpointslices import slice_workloads
from controlplane.kube.manifests import Obj, Refusal, Refused
from controlplane.kube.meshconfig import MESH_CONFIG_MAP, MeshConfig, SEVisibility, mesh_config
from controlplane.kube.policies import (
    authorization_policy,
    oldest,
    peer_authentication,
    static_strict,
    workload_peer_keys,
)
from controlplane.kube.services import ServiceInfo, select_services, service_entries_of, service_of
from controlplane.kube.warnings import pod_warnings
from controlplane.kube.waypoints import Waypoints, is_waypoint_gateway, waypoint_of
from controlplane.kube.workloads import (
    Context,
    pod_workload,
    service_entry_workloads,
    service_index,
    workload_entry_workload,
)
from mesh.localconfig import LocalConfig
from mesh.model import Service, Visibility, Workload
from policy.model import Authorization
from xds.convert import address_to_wire, authorization_to_wire

T = TypeVar("T")


@dataclass
class Index:
    """What the objects amount to: the config served, the objects refused, the warnings."""

    config: LocalConfig = field(default_factory=LocalConfig)
    refusals: list[Refusal] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


class _Build:
    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.result = Index(refusals=list(cluster.refusals))
        self._refused: set[int] = set()

    def attempt(self, obj: Obj, convert: Callable[..., T], *args: object) -> T | None:
        """`convert(obj, *args)`, or None with the object refused."""
        try:
            return convert(obj, *args)
        except Refused as e:
            self.refuse(obj, e.reason)
        except (TypeError, ValueError, AttributeError, LookupError) as e:
            # A shape no reader expected (a list where a mapping goes, deep down): still this object only.
            self.refuse(obj, f"cannot be read: {type(e).__name__}: {e}")
        return None

    def refuse(self, obj: Obj, reason: str) -> None:
        if id(obj) not in self._refused:
            self._refused.add(id(obj))
            self.result.refusals.append(obj.refusal(reason))

    def sendable(self, obj: Obj, item: Workload | Service | Authorization) -> bool:
        """Whether the wire can carry what `obj` became (protobuf refuses, say, an unpaired surrogate)."""
        try:
            authorization_to_wire(item) if isinstance(item, Authorization) else address_to_wire(item)
        except ValueError as e:
            self.refuse(obj, f"cannot be sent over xDS: {e}")
            return False
        return True

    def warn(self, obj: Obj, message: str) -> None:
        self.result.warnings.append(f"{obj.kind} {obj.key}: {message}")


def _policies(build: _Build) -> tuple[list[Authorization], list[tuple[Authorization, Mapping[str, str]]]]:
    cluster, root = build.cluster, build.cluster.options.root_namespace
    policies: list[Authorization] = []
    selecting: list[tuple[Authorization, Mapping[str, str]]] = []
    for obj in cluster.of("AuthorizationPolicy"):
        converted = build.attempt(obj, authorization_policy, root)
        if converted is None:
            continue
        if converted.warning:
            build.warn(obj, converted.warning)
        if converted.policy is not None and build.sendable(obj, converted.policy):
            policies.append(converted.policy)
            if converted.selector is not None:
                selecting.append((converted.policy, converted.selector))
    peer = cluster.of("PeerAuthentication")
    namespace_wide: dict[str, list[Obj]] = {}
    for pa in peer:
        if pa.spec.get("selector") is None:
            namespace_wide.setdefault(pa.namespace, []).append(pa)
    for pa in peer:
        derived = build.attempt(
            pa,
            peer_authentication,
            root,
            oldest(namespace_wide.get(pa.namespace, [])),
            oldest(namespace_wide.get(root, [])),
        )
        if derived is not None and build.sendable(pa, derived):
            policies.append(derived)
    if peer:
        policies.append(static_strict(root))
    return policies, selecting


def _policy_lookup(
    cluster: Cluster, selecting: list[tuple[Authorization, Mapping[str, str]]]
) -> Callable[[str, Mapping[str, str]], tuple[str, ...]]:
    root = cluster.options.root_namespace
    peer = cluster.of("PeerAuthentication")

    by_selector = SelectorIndex((p.namespace, selector, p) for p, selector in selecting)

    def policies_for(namespace: str, labels: Mapping[str, str]) -> tuple[str, ...]:
        keys = sorted({p.key for p in by_selector.select({root, namespace}, labels)})
        applicable = [
            pa
            for pa in peer
            if (pa.namespace == namespace and _pa_selects(pa, labels))
            or (namespace != root and pa.namespace == root and pa.spec.get("selector") is None)
        ]
        return (*keys, *workload_peer_keys(applicable, root))

    return policies_for


def _pa_selects(pa: Obj, labels: Mapping[str, str]) -> bool:
    selector = pa.spec.get("selector")
    if selector is None:
        return True
    match = selector.get("matchLabels") if isinstance(selector, dict) else None
    return isinstance(match, dict) and all(labels.get(k) == v for k, v in match.items())


def _mesh_config(build: _Build) -> MeshConfig:
    """The mesh config of the system namespace's `istio` ConfigMap; the defaults without one."""
    cluster = build.cluster
    config_map = cluster.get("ConfigMap", f"{cluster.options.system_namespace}/{MESH_CONFIG_MAP}")
    found = build.attempt(config_map, mesh_config) if config_map is not None else None
    return found or MeshConfig()


EXPORT_TO_ANNOTATION = "networking.istio.io/exportTo"
EXPORT_TO_IGNORED = (
    "{} is not read for ztunnel (istiod's ambient index ignores it): every namespace sees it; "
    "scope a ServiceEntry with the mesh config's serviceEntryVisibility"
)


def _export_to(obj: Obj) -> str | None:
    """The `exportTo` that narrows an object's audience, which ztunnel's mesh does not honour."""
    if obj.kind == "ServiceEntry":
        value = obj.spec.get("exportTo")
        if isinstance(value, list) and value and value != ["*"]:
            return "spec.exportTo"
    elif obj.annotations.get(EXPORT_TO_ANNOTATION, "*").replace(" ", "") not in ("", "*"):
        return f"the {EXPORT_TO_ANNOTATION} annotation"
    return None


def _services(build: _Build, waypoints: Waypoints, mesh: MeshConfig) -> list[ServiceInfo]:
    infos: list[ServiceInfo] = []
    for obj in build.cluster.of("Service") + build.cluster.of("ServiceEntry"):
        export_to = _export_to(obj)
        if export_to is not None:
            build.warn(obj, EXPORT_TO_IGNORED.format(export_to))
    for obj in build.cluster.of("Service"):
        who = f"{obj.kind} {obj.key}"
        waypoint = waypoints.for_service(who, obj.namespace, obj.labels)
        info = build.attempt(
            obj,
            service_of,
            build.cluster,
            waypoint,
            waypoints.canary_of(who, obj, waypoint),
            waypoints.ingress_use(who, obj, waypoint),
        )
        if info is not None and build.sendable(obj, info.service):
            infos.append(info)
        elif obj.spec.get("type") == "ExternalName":
            build.warn(obj, "type ExternalName is not sent to ztunnel (as by istiod)")
    for obj in build.cluster.of("ServiceEntry"):
        visibility = mesh.service_entry_visibility(build.cluster.namespace_labels(obj.namespace))
        if visibility is SEVisibility.NONE:
            build.warn(obj, "the mesh config's serviceEntryVisibility is NONE for its namespace: not sent")
            continue
        local = visibility is SEVisibility.NAMESPACE
        who = f"{obj.kind} {obj.key}"
        waypoint = waypoints.for_service(who, obj.namespace, obj.labels, namespace_only=local)
        entries = (
            build.attempt(
                obj,
                service_entries_of,
                build.cluster,
                waypoint,
                Visibility.NAMESPACE if local else Visibility.PUBLIC,
                waypoints.canary_of(who, obj, waypoint),
                waypoints.ingress_use(who, obj, waypoint),
            )
            or []
        )
        if all(build.sendable(obj, e.service) for e in entries):
            infos.extend(entries)
    return select_services(infos)


def _pod_warnings(pod: Obj, cluster: Cluster) -> list[str]:
    return list(pod_warnings(pod, cluster))


def _workloads(build: _Build, ctx: Context) -> list[Workload]:
    made: list[tuple[Obj, Workload]] = []
    for pod in build.cluster.of("Pod"):
        build.result.warnings += build.attempt(pod, _pod_warnings, build.cluster) or []
        workload = build.attempt(pod, pod_workload, ctx)
        if workload is not None:
            made.append((pod, workload))
    for entry in build.cluster.of("WorkloadEntry"):
        workload = build.attempt(entry, workload_entry_workload, ctx)
        if workload is not None:
            made.append((entry, workload))
    for entry in build.cluster.of("ServiceEntry"):
        made += [(entry, w) for w in build.attempt(entry, service_entry_workloads, ctx) or []]
    for es in build.cluster.of("EndpointSlice"):
        made += [(es, w) for w in build.attempt(es, slice_workloads, ctx.services, build.cluster) or []]
    out: dict[str, Workload] = {}
    for obj, workload in made:
        if workload.uid in out:
            build.warn(
                obj, f"a second workload with uid {workload.uid} (an endpoint listed twice?); left out"
            )
        elif build.sendable(obj, workload):
            out[workload.uid] = workload
    return list(out.values())


def build(objects: Iterable[Obj], options: Options | None = None) -> Index:
    cluster = Cluster(objects, options or Options())
    b = _Build(cluster)
    mesh = _mesh_config(b)
    if mesh.trust_domain:
        cluster.options = replace(cluster.options, trust_domain=mesh.trust_domain)
    gateways = []
    for gateway in cluster.of("Gateway"):
        if is_waypoint_gateway(gateway, cluster):
            waypoint = b.attempt(gateway, waypoint_of, cluster)
            if waypoint is not None:
                gateways.append(waypoint)
    waypoints = Waypoints(cluster, gateways)
    services = _services(b, waypoints, mesh)
    policies, selecting = _policies(b)
    ctx = Context(cluster, services, waypoints, service_index(services), _policy_lookup(cluster, selecting))
    workloads = _workloads(b, ctx)
    b.result.warnings.extend(waypoints.warnings)
    b.result.config = LocalConfig(
        workloads=tuple(workloads),
        services=tuple(info.service for info in services),
        policies=tuple(policies),
    )
    return b.result
