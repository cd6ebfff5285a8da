"""EndpointSlices: the endpoints of Services without selectors, as istiod reads them.

A selector Service's endpoints are read from the Pods themselves. An EndpointSlice (labelled
`kubernetes.io/service-name`, not of address type FQDN) adds what selectors cannot say: an endpoint
whose `targetRef` is a Pod makes that pod a member of the slice's Service (if not already by
selector); an endpoint with no Pod behind it becomes a workload of its own, named
`<cluster>/discovery.k8s.io/EndpointSlice/<namespace>/<slice>/<first address>`, host network,
healthy unless `conditions.ready` is false, serving the slice's TCP ports matched to the Service's
ports by name. Fields the API server or the EndpointSlice controller would fill are defaulted as they
would be (a port's protocol TCP, its name "").
"""

from __future__ import annotations

from collections.abc import Sequence

from controlplane.kube.cluster import Cluster, integer, ip, items, mapping, text
from controlplane.kube.manifests import Obj
from controlplane.kube.services import ServiceInfo
from mesh.model import NetworkMode, Workload, WorkloadStatus

SERVICE_NAME_LABEL = "kubernetes.io/service-name"


def _service_of(es: Obj, services: Sequence[ServiceInfo], cluster: Cluster) -> ServiceInfo | None:
    name = es.labels.get(SERVICE_NAME_LABEL)
    if name is None or es.body.get("addressType") == "FQDN":
        return None
    hostname = cluster.service_hostname(name, es.namespace)
    for info in services:
        if info.from_service and info.service.namespace == es.namespace and info.service.hostname == hostname:
            return info
    return None


def pod_slice_services(
    pod: Obj,
    slices: Sequence[Obj],
    services: Sequence[ServiceInfo],
    matched: Sequence[ServiceInfo],
    cluster: Cluster,
) -> list[ServiceInfo]:
    """The Services a pod belongs to by an EndpointSlice naming it, beyond those its labels select."""
    seen = {info.service.hostname for info in matched}
    out = []
    for es in slices:
        if es.namespace != pod.namespace:
            continue
        info = _service_of(es, services, cluster)
        if info is None or info.service.hostname in seen:
            continue
        for endpoint in es.body.get("endpoints") or []:
            ref = endpoint.get("targetRef") if isinstance(endpoint, dict) else None
            if (
                isinstance(ref, dict)
                and ref.get("kind") == "Pod"
                and ref.get("name") == pod.name
                and (ref.get("namespace") or es.namespace) == pod.namespace
                and (ref.get("uid") or "") == (pod.metadata.get("uid") or "")
            ):
                seen.add(info.service.hostname)
                out.append(info)
                break
    return out


def slice_workloads(es: Obj, services: Sequence[ServiceInfo], cluster: Cluster) -> list[Workload]:
    """The workloads of the endpoints with no Pod behind them."""
    info = _service_of(es, services, cluster)
    if info is None:
        return []
    ports = []
    for i, raw in enumerate(items(es.body.get("ports"), "ports")):
        port = mapping(raw, f"ports[{i}]")
        if port.get("port") is None or port.get("protocol", "TCP") != "TCP":
            continue
        name = text(port.get("name"), f"ports[{i}].name")
        for service_port, _ in info.service.ports:
            named = info.port_names.get(service_port)
            if named is not None and named.name == name:
                ports.append((service_port, integer(port["port"], f"ports[{i}].port", 1)))
                break
    options = cluster.options
    out: list[Workload] = []
    seen: set[str] = set()
    for i, raw in enumerate(items(es.body.get("endpoints"), "endpoints")):
        endpoint = mapping(raw, f"endpoints[{i}]")
        ref = endpoint.get("targetRef")
        addresses = items(endpoint.get("addresses"), f"endpoints[{i}].addresses")
        if (isinstance(ref, dict) and ref.get("kind") == "Pod") or not addresses or str(addresses[0]) in seen:
            continue
        seen.add(str(addresses[0]))
        ready = mapping(endpoint.get("conditions"), f"endpoints[{i}].conditions").get("ready")
        out.append(
            Workload(
                uid=f"{options.cluster_id}/discovery.k8s.io/EndpointSlice/{es.namespace}/{es.name}/{addresses[0]}",
                name=es.name,
                namespace=es.namespace,
                addresses=tuple(ip(a, f"endpoints[{i}].addresses") for a in addresses),
                network=cluster.network,
                trust_domain=options.wire_trust_domain,
                services=((info.service.key, tuple(ports)),),
                status=WorkloadStatus.UNHEALTHY if ready is False else WorkloadStatus.HEALTHY,
                cluster_id=options.cluster_id,
                network_mode=NetworkMode.HOST_NETWORK,
            )
        )
    return out
