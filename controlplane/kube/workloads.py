"""Pods, WorkloadEntries and ServiceEntry endpoints to the workloads a proxy receives, as istiod builds them.

Every workload: its uid in istiod's form (`<cluster>//Pod/<ns>/<name>`,
`<cluster>/networking.istio.io/WorkloadEntry/<ns>/<name>`,
`<cluster>/networking.istio.io/ServiceEntry/<ns>/<name>/<address>`), the cluster id, the trust domain
(left empty when it is the default `cluster.local`), the cluster's network, the canonical name and
revision from the usual labels, workload type `pod` (as istiod sends for all three), the services that
select it with their ports resolved for it, the selector policies that select it and its
PeerAuthentication-derived policies, and its waypoint.

A Pod: its IPs from `status.podIPs`/`status.podIP` (a pod without one, or finished, is no workload),
`spec.serviceAccountName`, `spec.nodeName` and the node's locality labels, host network mode,
healthy when its Ready condition is true, and the workload name from its controller (a ReplicaSet's
Deployment, a Job's CronJob). HBONE when enrolled in ambient: istiod reads the CNI's
`ambient.istio.io/redirection: enabled` annotation; with no CNI here, a pod counts as enrolled when
the CNI would enrol it (`istio.io/dataplane-mode: ambient` on the pod or its namespace, not `none`
on the pod, no sidecar, not host network). The `networking.istio.io/tunnel: http` label marks a
native HBONE speaker (a waypoint).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from controlplane.kube.cluster import (
    AUTO_REGISTRATION_GROUP_ANNOTATION,
    DATAPLANE_MODE,
    REDIRECTION_ANNOTATION,
    SIDECAR_STATUS_ANNOTATION,
    TUNNEL_LABEL,
    WORKLOAD_NAME_LABEL,
    Cluster,
    SelectorIndex,
    canonical,
    integer,
    ip,
    items,
    mapping,
    string_map,
    text,
)
from controlplane.kube.endpointslices import pod_slice_services
from controlplane.kube.manifests import Obj, refuse
from controlplane.kube.services import ServiceInfo
from controlplane.kube.waypoints import Waypoint, Waypoints
from mesh.model import (
    ApplicationTunnel,
    IPAddress,
    Locality,
    NetworkMode,
    TunnelProtocol,
    Workload,
    WorkloadStatus,
)

_CRONJOB_NAME = re.compile(r"^(.+)-\d{8,10}$")
Ports = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Context:
    """What building a workload needs beyond its object."""

    cluster: Cluster
    services: Sequence[ServiceInfo]
    waypoints: Waypoints
    selecting: SelectorIndex[ServiceInfo]  # the services with a (non-empty) selector
    # (namespace, labels) -> the keys of the policies a workload there lists (selector and peer ones).
    policies_for: Callable[[str, Mapping[str, str]], tuple[str, ...]]


def tunnel_protocol(
    labels: Mapping[str, str], annotations: Mapping[str, str], enrolled: bool
) -> tuple[TunnelProtocol, bool]:
    """(protocol, native tunnel) as istiod sets them."""
    protocol, native = TunnelProtocol.NONE, False
    if annotations.get(REDIRECTION_ANNOTATION) == "enabled" or enrolled:
        protocol = TunnelProtocol.HBONE
    if "http" in labels.get(TUNNEL_LABEL, "").split(","):
        protocol, native = TunnelProtocol.HBONE, True
    return protocol, native


def pod_enrolled(pod: Obj, cluster: Cluster) -> bool:
    """Whether Istio's CNI would redirect the pod into ztunnel."""
    own = pod.labels.get(DATAPLANE_MODE)
    if own == "none" or SIDECAR_STATUS_ANNOTATION in pod.annotations or pod.spec.get("hostNetwork") is True:
        return False
    return own == "ambient" or cluster.namespace_labels(pod.namespace).get(DATAPLANE_MODE) == "ambient"


def pod_workload_name(pod: Obj) -> str:
    """The controller heuristic istiod uses; the `service.istio.io/workload-name` label overrides it."""
    name = pod.name
    if pod.metadata.get("generateName"):
        for ref in pod.metadata.get("ownerReferences") or []:
            if not isinstance(ref, dict) or ref.get("controller") is not True:
                continue
            owner, kind = str(ref.get("name", "")), ref.get("kind")
            name = owner
            template_hash = pod.labels.get("pod-template-hash", "")
            if kind == "ReplicaSet" and template_hash and owner.endswith(template_hash):
                name = owner.removesuffix("-" + template_hash)
            elif kind == "Job" and (m := _CRONJOB_NAME.match(owner)):
                name = m.group(1)
            break
    return pod.labels.get(WORKLOAD_NAME_LABEL, name)


def container_port(pod: Obj, name: str) -> int | None:
    containers = list(pod.spec.get("containers") or [])
    containers += [
        c
        for c in pod.spec.get("initContainers") or []
        if isinstance(c, dict) and c.get("restartPolicy") == "Always"
    ]
    for container in containers:
        for port in (container.get("ports") or []) if isinstance(container, dict) else []:
            if isinstance(port, dict) and port.get("name") == name and port.get("protocol", "TCP") == "TCP":
                value = port.get("containerPort")
                return value if isinstance(value, int) else None
    return None


def pod_memberships(pod: Obj, services: Sequence[ServiceInfo]) -> tuple[tuple[str, Ports], ...]:
    out = []
    for info in services:
        ports = []
        for service_port, target in info.service.ports:
            named = info.port_names.get(service_port)
            if named is not None and named.target_name:
                found = container_port(pod, named.target_name)
                if found is None:
                    continue  # the pod lacks the named port: the port is left out for it
                target = found
            elif named is not None and not info.from_service and named.name:
                found = container_port(pod, named.name)
                target = found if found is not None else (target or service_port)
            ports.append((service_port, target))
        out.append((info.service.key, tuple(ports)))
    return tuple(sorted(out))


def entry_memberships(
    entry_ports: Mapping[str, int], services: Sequence[ServiceInfo]
) -> tuple[tuple[str, Ports], ...]:
    """A WorkloadEntry's (or ServiceEntry endpoint's) ports, by name, for each service."""
    out = []
    for info in services:
        ports = []
        for service_port, target in info.service.ports:
            named = info.port_names.get(service_port)
            if info.from_service and named is not None:
                if named.target_name:
                    if named.target_name not in entry_ports:
                        continue
                    target = entry_ports[named.target_name]
                elif named.name in entry_ports:
                    target = entry_ports[named.name]
            elif named is not None:
                if named.name in entry_ports:
                    target = entry_ports[named.name]
                elif target == 0:
                    target = service_port
            ports.append((service_port, target))
        out.append((info.service.key, tuple(ports)))
    return tuple(sorted(out))


def _selecting(ctx: Context, namespace: str, labels: Mapping[str, str]) -> list[ServiceInfo]:
    return ctx.selecting.select((namespace,), labels)


def service_index(services: Sequence[ServiceInfo]) -> SelectorIndex[ServiceInfo]:
    """Services and ServiceEntries that select endpoints (an empty selector selects nothing)."""
    return SelectorIndex((s.service.namespace, s.selector, s) for s in services if s.selector)


def _waypoint_and_tunnel(
    ctx: Context, obj: Obj, labels: Mapping[str, str]
) -> tuple[Waypoint | None, ApplicationTunnel | None]:
    instance = ctx.waypoints.instance_of(obj.namespace, labels)
    if instance is not None:
        return None, instance.binding
    return ctx.waypoints.for_workload(f"{obj.kind} {obj.key}", obj.namespace, labels), None


def pod_ips(pod: Obj) -> list[IPAddress]:
    status = pod.status
    raw = [mapping(p, "status.podIPs").get("ip") for p in items(status.get("podIPs"), "status.podIPs")]
    if not raw and status.get("podIP"):
        raw = [status.get("podIP")]
    return [ip(v, "status.podIPs") for v in raw]


def pod_ready(pod: Obj) -> bool:
    for condition in pod.status.get("conditions") or []:
        if isinstance(condition, dict) and condition.get("type") == "Ready":
            return condition.get("status") == "True"
    return False


def pod_workload(pod: Obj, ctx: Context) -> Workload | None:
    """None for a pod istiod makes no workload of: finished, or without an IP yet."""
    if pod.status.get("phase") in ("Succeeded", "Failed"):
        return None
    addresses = pod_ips(pod)
    if not addresses:
        return None
    cluster = ctx.cluster
    services = _selecting(ctx, pod.namespace, pod.labels)
    services += pod_slice_services(pod, cluster.of("EndpointSlice"), ctx.services, services, cluster)
    waypoint, app_tunnel = _waypoint_and_tunnel(ctx, pod, pod.labels)
    protocol, native = tunnel_protocol(pod.labels, pod.annotations, pod_enrolled(pod, cluster))
    healthy = pod_ready(pod) and not pod.metadata.get("deletionTimestamp")
    name = pod_workload_name(pod)
    canonical_name, canonical_revision = canonical(pod.labels, name)
    return Workload(
        uid=f"{cluster.options.cluster_id}//Pod/{pod.namespace}/{pod.name}",
        name=pod.name,
        namespace=pod.namespace,
        addresses=tuple(addresses),
        network=cluster.network,
        tunnel_protocol=protocol,
        native_tunnel=native,
        trust_domain=cluster.options.wire_trust_domain,
        service_account=text(pod.spec.get("serviceAccountName"), "spec.serviceAccountName"),
        waypoint=waypoint.address if waypoint is not None else None,
        application_tunnel=app_tunnel,
        node=text(pod.spec.get("nodeName"), "spec.nodeName"),
        canonical_name=canonical_name,
        canonical_revision=canonical_revision,
        workload_type="pod",
        workload_name=name,
        services=pod_memberships(pod, services),
        authorization_policies=ctx.policies_for(pod.namespace, pod.labels),
        status=WorkloadStatus.HEALTHY if healthy else WorkloadStatus.UNHEALTHY,
        cluster_id=cluster.options.cluster_id,
        locality=cluster.node_locality(str(pod.spec.get("nodeName") or "")),
        network_mode=NetworkMode.HOST_NETWORK
        if pod.spec.get("hostNetwork") is True
        else NetworkMode.STANDARD,
    )


def _locality(value: object) -> Locality:
    parts = ([*text(value, "locality").split("/"), "", "", ""])[:3]
    return Locality(*parts)


def _entry_ports(spec: Mapping[str, Any], where: str) -> dict[str, int]:
    return {
        str(k): integer(v, f"{where}.ports.{k}", 1)
        for k, v in mapping(spec.get("ports"), f"{where}.ports").items()
    }


def _entry_workload(
    uid: str,
    name: str,
    namespace: str,
    spec: Mapping[str, Any],
    labels: Mapping[str, str],
    where: str,
    ctx: Context,
) -> dict[str, Any]:
    """The fields a WorkloadEntry and a ServiceEntry endpoint share."""
    cluster = ctx.cluster
    address = text(spec.get("address"), f"{where}.address")
    if not address:
        refuse(f"{where}.address: required")
    try:
        addresses: tuple[IPAddress, ...] = (ipaddress.ip_address(address),)
        hostname = ""
    except ValueError:
        addresses, hostname = (), address
    weight = spec.get("weight")
    return {
        "uid": uid,
        "name": name,
        "namespace": namespace,
        "addresses": addresses,
        "hostname": hostname,
        "network": text(spec.get("network"), f"{where}.network") or cluster.network,
        "trust_domain": cluster.options.wire_trust_domain,
        "service_account": text(spec.get("serviceAccount"), f"{where}.serviceAccount"),
        "cluster_id": cluster.options.cluster_id,
        "locality": _locality(spec.get("locality")),
        "capacity": integer(weight, f"{where}.weight", 1, 2**32 - 1) if weight else 1,
        "workload_type": "pod",
    }


def workload_entry_workload(entry: Obj, ctx: Context) -> Workload:
    spec = entry.spec
    labels = {**entry.labels, **string_map(spec.get("labels"), "spec.labels")}
    services = _selecting(ctx, entry.namespace, labels)
    waypoint, app_tunnel = _waypoint_and_tunnel(ctx, entry, labels)
    protocol, native = tunnel_protocol(labels, entry.annotations, False)
    name = entry.annotations.get(AUTO_REGISTRATION_GROUP_ANNOTATION) or labels.get(
        WORKLOAD_NAME_LABEL, entry.name
    )
    canonical_name, canonical_revision = canonical(labels, name)
    uid = f"{ctx.cluster.options.cluster_id}/networking.istio.io/WorkloadEntry/{entry.namespace}/{entry.name}"
    return Workload(
        **_entry_workload(uid, entry.name, entry.namespace, spec, labels, "spec", ctx),
        tunnel_protocol=protocol,
        native_tunnel=native,
        waypoint=waypoint.address if waypoint is not None else None,
        application_tunnel=app_tunnel,
        canonical_name=canonical_name,
        canonical_revision=canonical_revision,
        workload_name=name,
        services=entry_memberships(_entry_ports(spec, "spec"), services),
        authorization_policies=ctx.policies_for(entry.namespace, labels),
    )


def service_entry_workloads(entry: Obj, ctx: Context) -> list[Workload]:
    """The inline `spec.endpoints`; a DNS entry without endpoints nor selector gets one per host."""
    spec = entry.spec
    own = [s for s in ctx.services if s.source is entry]
    endpoints = items(spec.get("endpoints"), "spec.endpoints")
    implicit = (
        not endpoints
        and spec.get("resolution") in ("DNS", "DNS_ROUND_ROBIN", "DYNAMIC_DNS")
        and not spec.get("workloadSelector")
    )
    if implicit:
        endpoints = [{"address": s.service.hostname} for s in own]
    if not own:
        return []
    protocol, native = tunnel_protocol(entry.labels, entry.annotations, False)
    canonical_name, canonical_revision = canonical(entry.labels, entry.name)
    out = []
    for i, raw in enumerate(endpoints):
        where = f"spec.endpoints[{i}]"
        endpoint = mapping(raw, where)
        services = [own[i]] if implicit else own
        waypoint, app_tunnel = (None, None)
        if not implicit:
            fake = Obj(
                entry.group,
                entry.kind,
                entry.namespace,
                entry.name,
                string_map(endpoint.get("labels"), f"{where}.labels"),
                {},
                {},
            )
            waypoint, app_tunnel = _waypoint_and_tunnel(ctx, fake, fake.labels)
        address = text(endpoint.get("address"), f"{where}.address")
        uid = f"{ctx.cluster.options.cluster_id}/networking.istio.io/ServiceEntry/{entry.namespace}/{entry.name}/{address}"
        out.append(
            Workload(
                **_entry_workload(uid, entry.name, entry.namespace, endpoint, entry.labels, where, ctx),
                tunnel_protocol=protocol,
                native_tunnel=native,
                waypoint=waypoint.address if waypoint is not None else None,
                application_tunnel=app_tunnel,
                canonical_name=canonical_name,
                canonical_revision=canonical_revision,
                workload_name=entry.name,
                services=entry_memberships(_entry_ports(endpoint, where), services),
                authorization_policies=ctx.policies_for(entry.namespace, entry.labels),
            )
        )
    return out
