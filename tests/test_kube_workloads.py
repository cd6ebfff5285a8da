"""Manifests to the workloads and services the control plane sends, decoded from the wire: Pods,
WorkloadEntries, Services, ServiceEntries and EndpointSlices, as istiod's ambient index
builds them."""

from __future__ import annotations

from typing import Any

import pytest

from controlplane.kube.cluster import Options
from tests.kube_wire import NS, SERVICE, pod, serve, subset

# --- pods ---------------------------------------------------------------------------------------


def test_pod_workload_fields() -> None:
    served = serve(
        NS
        + """
---
apiVersion: v1
kind: Node
metadata:
  name: node-1
  labels: {topology.kubernetes.io/region: eu, topology.kubernetes.io/zone: eu-1, topology.istio.io/subzone: rack-7}
---
apiVersion: v1
kind: Namespace
metadata:
  name: istio-system
  labels: {topology.istio.io/network: net-a}
---
apiVersion: v1
kind: Pod
metadata:
  name: web-7d9f-x2x
  generateName: web-7d9f-
  namespace: demo
  labels: {app: web, version: v2, pod-template-hash: 7d9f}
  ownerReferences: [{apiVersion: apps/v1, kind: ReplicaSet, name: web-7d9f, controller: true}]
spec:
  serviceAccountName: web
  nodeName: node-1
status:
  podIPs: [{ip: 10.0.0.5}, {ip: "fd00::5"}]
  conditions: [{type: Ready, status: "True"}]
"""
    )
    assert served.refusals == []
    subset(
        {
            "uid": "Kubernetes//Pod/demo/web-7d9f-x2x",
            "name": "web-7d9f-x2x",
            "namespace": "demo",
            "addresses": ["10.0.0.5", "fd00::5"],
            "network": "net-a",
            "tunnel_protocol": "HBONE",
            "trust_domain": None,  # istiod leaves the default cluster.local out
            "service_account": "web",
            "node": "node-1",
            "canonical_name": "web",
            "canonical_revision": "v2",
            "workload_type": "POD",
            "workload_name": "web",  # the ReplicaSet's Deployment
            "cluster_id": "Kubernetes",
            "locality": {"region": "eu", "zone": "eu-1", "subzone": "rack-7"},
            "status": None,  # HEALTHY
        },
        served.workloads["Kubernetes//Pod/demo/web-7d9f-x2x"],
    )


@pytest.mark.parametrize(
    ("labels", "extra_meta", "name", "revision", "workload_name"),
    [
        (
            "{service.istio.io/canonical-name: c, app.kubernetes.io/name: k, app: a, service.istio.io/canonical-revision: r1, version: v}",
            "",
            "c",
            "r1",
            "p",
        ),
        (
            "{app.kubernetes.io/name: k, app: a, app.kubernetes.io/version: kv, version: v}",
            "",
            "k",
            "kv",
            "p",
        ),
        ("{app: a, version: v}", "", "a", "v", "p"),
        ("{}", "", "p", "latest", "p"),
        ("{service.istio.io/workload-name: named}", "", "named", "latest", "named"),
        (
            "{}",
            "\n  generateName: nightly-28000000-\n  ownerReferences: [{kind: Job, name: nightly-28000000, controller: true}]",
            "nightly",
            "latest",
            "nightly",
        ),
    ],
)
def test_canonical_name_revision_and_workload_name(
    labels: str, extra_meta: str, name: str, revision: str, workload_name: str
) -> None:
    served = serve(NS + pod("p", labels=labels, extra=extra_meta))
    subset(
        {"canonical_name": name, "canonical_revision": revision, "workload_name": workload_name},
        served.workloads["Kubernetes//Pod/demo/p"],
    )


@pytest.mark.parametrize(
    ("ns_labels", "pod_labels", "annotations", "protocol", "native"),
    [
        ("{istio.io/dataplane-mode: ambient}", "{}", "{}", "HBONE", False),
        ("{istio.io/dataplane-mode: ambient}", "{istio.io/dataplane-mode: none}", "{}", None, False),
        ("{}", "{istio.io/dataplane-mode: ambient}", "{}", "HBONE", False),
        ("{}", "{}", "{}", None, False),
        ("{istio.io/dataplane-mode: ambient}", "{}", "{sidecar.istio.io/status: '{}'}", None, False),
        ("{}", "{}", "{ambient.istio.io/redirection: enabled}", "HBONE", False),
        ("{}", "{networking.istio.io/tunnel: http}", "{}", "HBONE", True),
    ],
)
def test_tunnel_protocol_from_enrolment(
    ns_labels: str, pod_labels: str, annotations: str, protocol: str | None, native: bool
) -> None:
    served = serve(
        f"""
apiVersion: v1
kind: Namespace
metadata: {{name: demo, labels: {ns_labels}}}
"""
        + pod("p", labels=pod_labels, extra=f"\n  annotations: {annotations}")
    )
    subset(
        {"tunnel_protocol": protocol, "native_tunnel": True if native else None},
        served.workloads["Kubernetes//Pod/demo/p"],
    )


def test_pods_istiod_makes_no_workload_of_and_unhealthy_ones() -> None:
    served = serve(
        NS
        + pod("done", status="\n  phase: Succeeded")
        + """
---
apiVersion: v1
kind: Pod
metadata: {name: pending, namespace: demo, labels: {app: a, version: v}}
spec: {}
---
apiVersion: v1
kind: Pod
metadata: {name: starting, namespace: demo, labels: {app: a, version: v}}
spec: {hostNetwork: true}
status: {podIP: 10.0.0.9}
"""
    )
    assert set(served.workloads) == {"Kubernetes//Pod/demo/starting"}
    subset(
        {"status": "UNHEALTHY", "network_mode": "HOST_NETWORK", "tunnel_protocol": None},
        served.workloads["Kubernetes//Pod/demo/starting"],
    )
    assert served.warned("Pod demo/pending", "no status.podIP")
    assert served.warned("Pod demo/starting", "UNHEALTHY")


def test_options_cluster_id_and_trust_domain() -> None:
    served = serve(NS + pod("p"), Options(cluster_id="east", trust_domain="example.org"))
    subset(
        {"uid": "east//Pod/demo/p", "cluster_id": "east", "trust_domain": "example.org"},
        served.workloads["east//Pod/demo/p"],
    )


# --- services -----------------------------------------------------------------------------------


def test_service_and_its_endpoints_named_target_ports_resolved_per_pod() -> None:
    served = serve(
        NS
        + SERVICE
        + pod(
            "with-port",
            "10.0.0.1",
            labels="{app: web, version: v1}",
            spec="\n  containers: [{name: c, ports: [{name: http-web, containerPort: 8080}]}]",
        )
        + pod("without-port", "10.0.0.2", labels="{app: web, version: v1}")
        + pod("other", "10.0.0.3", labels="{app: other, version: v1}")
    )
    subset(
        {
            "name": "web",
            "namespace": "demo",
            "hostname": "web.demo.svc.cluster.local",
            "addresses": [{"address": "10.96.0.10"}, {"address": "fd00:96::10"}],
            "ports": [
                {"service_port": 80},  # named: resolved per endpoint
                {"service_port": 9090, "target_port": 9091},
                {"service_port": 9100, "target_port": 9100},  # the API server's default
            ],
            "canonical": True,
            "ip_families": "DUAL",
            "load_balancing": None,
        },
        served.services["demo/web.demo.svc.cluster.local"],
    )
    key = "demo/web.demo.svc.cluster.local"
    with_port = served.workloads["Kubernetes//Pod/demo/with-port"]["services"][key]["ports"]
    assert with_port == [
        {"service_port": 80, "target_port": 8080},
        {"service_port": 9090, "target_port": 9091},
        {"service_port": 9100, "target_port": 9100},
    ]
    # A pod without the named port is left out of that port only, as by istiod.
    without = served.workloads["Kubernetes//Pod/demo/without-port"]["services"][key]["ports"]
    assert [p["service_port"] for p in without] == [9090, 9100]
    assert "services" not in served.workloads["Kubernetes//Pod/demo/other"]


@pytest.mark.parametrize(
    ("spec", "annotations", "ns_annotations", "balancing"),
    [
        (
            "trafficDistribution: PreferClose",
            "{}",
            "{}",
            {"routing_preference": ["NETWORK", "REGION", "ZONE"], "mode": "FAILOVER"},
        ),
        (
            "trafficDistribution: PreferSameNode",
            "{}",
            "{}",
            {"routing_preference": ["NETWORK", "REGION", "ZONE", "SUBZONE", "NODE"], "mode": "FAILOVER"},
        ),
        ("internalTrafficPolicy: Local", "{}", "{}", {"routing_preference": ["NODE"], "mode": "STRICT"}),
        (
            "{}",
            "{networking.istio.io/traffic-distribution: PreferClose}",
            "{}",
            {"routing_preference": ["NETWORK", "REGION", "ZONE"], "mode": "FAILOVER"},
        ),
        (
            "{}",
            "{}",
            "{networking.istio.io/traffic-distribution: PreferSameZone}",
            {"routing_preference": ["NETWORK", "REGION", "ZONE"], "mode": "FAILOVER"},
        ),
        ("publishNotReadyAddresses: true", "{}", "{}", {"health_policy": "ALLOW_ALL"}),
        ("{}", "{}", "{}", None),
    ],
)
def test_service_load_balancing(
    spec: str, annotations: str, ns_annotations: str, balancing: dict[str, Any] | None
) -> None:
    body = (
        "\n  ".join(["selector: {app: web}", "ports: [{port: 80}]", spec])
        if spec != "{}"
        else "selector: {app: web}\n  ports: [{port: 80}]"
    )
    served = serve(
        f"""
apiVersion: v1
kind: Namespace
metadata: {{name: demo, annotations: {ns_annotations}}}
---
apiVersion: v1
kind: Service
metadata: {{name: web, namespace: demo, annotations: {annotations}}}
spec:
  clusterIP: 10.96.0.10
  {body}
"""
    )
    subset({"load_balancing": balancing}, served.services["demo/web.demo.svc.cluster.local"])


def test_headless_and_external_name_services() -> None:
    served = serve(
        NS
        + """
---
apiVersion: v1
kind: Service
metadata: {name: headless, namespace: demo}
spec: {clusterIP: None, selector: {app: a}, ports: [{port: 80}]}
---
apiVersion: v1
kind: Service
metadata: {name: outside, namespace: demo}
spec: {type: ExternalName, externalName: example.com}
"""
    )
    subset(
        {"addresses": None, "ports": [{"service_port": 80, "target_port": 80}]},
        served.services["demo/headless.demo.svc.cluster.local"],
    )
    assert "demo/outside.demo.svc.cluster.local" not in served.services
    assert served.warned("Service demo/outside", "ExternalName")


SERVICE_ENTRY = """
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: external, namespace: demo}
spec:
  hosts: [api.example.com, api2.example.com]
  addresses: [240.0.0.1, 240.1.0.0/16]
  ports:
    - {number: 443, name: https, protocol: TLS}
    - {number: 80, name: http, targetPort: 8080}
  resolution: STATIC
  subjectAltNames: [spiffe://example.com/ns/x/sa/y]
  endpoints:
    - {address: 192.0.2.1, serviceAccount: ext, network: far, locality: us/us-1/a, weight: 3, ports: {https: 8443}}
    - {address: vm.example.com}
"""


def test_service_entry_services_and_static_endpoints() -> None:
    served = serve(NS + SERVICE_ENTRY)
    for host in ("api.example.com", "api2.example.com"):
        subset(
            {
                "name": "external",
                "hostname": host,
                "addresses": [{"address": "240.0.0.1"}, {"address": "240.1.0.0", "length": 16}],
                "ports": [
                    {"service_port": 443, "target_port": 443},
                    {"service_port": 80, "target_port": 8080},
                ],
                "subject_alt_names": ["spiffe://example.com/ns/x/sa/y"],
                "load_balancing": None,
            },
            served.services[f"demo/{host}"],
        )
    assert served.services["demo/api.example.com"]["canonical"] is True
    first = served.workloads["Kubernetes/networking.istio.io/ServiceEntry/demo/external/192.0.2.1"]
    subset(
        {
            "name": "external",
            "addresses": ["192.0.2.1"],
            "network": "far",
            "service_account": "ext",
            "locality": {"region": "us", "zone": "us-1", "subzone": "a"},
            "capacity": 3,
            "workload_name": "external",
            "workload_type": "POD",
        },
        first,
    )
    assert first["services"]["demo/api.example.com"]["ports"] == [
        {"service_port": 443, "target_port": 8443},
        {"service_port": 80, "target_port": 8080},
    ]
    second = served.workloads["Kubernetes/networking.istio.io/ServiceEntry/demo/external/vm.example.com"]
    subset({"hostname": "vm.example.com", "addresses": None}, second)


def test_service_entry_resolution_none_is_passthrough() -> None:
    served = serve(
        NS
        + """
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: any, namespace: demo}
spec: {hosts: [any.example.com], addresses: [240.0.0.9], ports: [{number: 80, name: http}], resolution: NONE}
"""
    )
    subset(
        {"load_balancing": {"mode": "PASSTHROUGH", "health_policy": "ALLOW_ALL"}},
        served.services["demo/any.example.com"],
    )


def test_service_entry_selecting_pods_and_service_selecting_workload_entries() -> None:
    served = serve(
        NS
        + """
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: db, namespace: demo}
spec:
  hosts: [db.example.internal]
  addresses: [240.0.0.5]
  ports: [{number: 5432, name: pg}]
  resolution: STATIC
  workloadSelector: {labels: {app: db}}
---
apiVersion: networking.istio.io/v1
kind: WorkloadEntry
metadata: {name: vm-1, namespace: demo, labels: {app: web}}
spec:
  address: 192.0.2.10
  serviceAccount: vm
  labels: {version: v3}
  ports: {http-web: 8081}
"""
        + SERVICE
        + pod(
            "db-0",
            "10.0.0.7",
            labels="{app: db, version: v1}",
            spec="\n  containers: [{name: pg, ports: [{name: pg, containerPort: 15432}]}]",
        )
    )
    db = served.workloads["Kubernetes//Pod/demo/db-0"]
    assert db["services"] == {
        "demo/db.example.internal": {"ports": [{"service_port": 5432, "target_port": 15432}]}
    }
    vm = served.workloads["Kubernetes/networking.istio.io/WorkloadEntry/demo/vm-1"]
    subset(
        {
            "name": "vm-1",
            "addresses": ["192.0.2.10"],
            "service_account": "vm",
            "canonical_name": "web",
            "canonical_revision": "v3",  # spec.labels count too
            "workload_name": "vm-1",
            "workload_type": "POD",
            "tunnel_protocol": None,  # a VM is HBONE only when it says so
            "status": None,
        },
        vm,
    )
    assert vm["services"]["demo/web.demo.svc.cluster.local"]["ports"] == [
        {"service_port": 80, "target_port": 8081},
        {"service_port": 9090, "target_port": 9091},
        {"service_port": 9100, "target_port": 9100},
    ]


def test_one_service_per_hostname_and_namespace_and_the_canonical_one() -> None:
    def entry(name: str, ns: str, created: str, host: str = "shared.example.com") -> str:
        return f"""
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {{name: {name}, namespace: {ns}, creationTimestamp: "{created}"}}
spec: {{hosts: [{host}], ports: [{{number: 80, name: http}}], resolution: DNS}}
"""

    served = serve(
        entry("newer", "a", "2026-02-01T00:00:00Z")
        + entry("older", "a", "2026-01-01T00:00:00Z")
        + entry("elsewhere", "b", "2025-12-01T00:00:00Z")
        + entry("shadowed", "demo", "2020-01-01T00:00:00Z", "web.demo.svc.cluster.local")
        + SERVICE
    )
    assert served.services["a/shared.example.com"]["name"] == "older"
    assert served.services["b/shared.example.com"].get("canonical") is True
    assert "canonical" not in served.services["a/shared.example.com"]
    # The Service wins its hostname over a ServiceEntry in its namespace.
    assert served.services["demo/web.demo.svc.cluster.local"]["name"] == "web"


def test_endpoint_slices_of_a_service_without_selector() -> None:
    served = serve(
        NS
        + """
---
apiVersion: v1
kind: Service
metadata: {name: legacy, namespace: demo}
spec: {clusterIP: 10.96.0.20, ports: [{name: db, port: 5432, targetPort: 15432}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: legacy-abc, namespace: demo, labels: {kubernetes.io/service-name: legacy}}
addressType: IPv4
ports: [{name: db, port: 15432, protocol: TCP}, {name: other, port: 1}]
endpoints:
  - addresses: [10.0.0.1]
    targetRef: {kind: Pod, name: p, namespace: demo}
  - addresses: [192.0.2.7]
    conditions: {ready: false}
  - addresses: [192.0.2.8]
"""
        + pod("p", "10.0.0.1")
    )
    key = "demo/legacy.demo.svc.cluster.local"
    # The pod the slice names joins the Service, its ports resolved as for a selector.
    assert served.workloads["Kubernetes//Pod/demo/p"]["services"] == {
        key: {"ports": [{"service_port": 5432, "target_port": 15432}]}
    }
    outside = served.workloads["Kubernetes/discovery.k8s.io/EndpointSlice/demo/legacy-abc/192.0.2.7"]
    subset(
        {
            "name": "legacy-abc",
            "addresses": ["192.0.2.7"],
            "status": "UNHEALTHY",
            "network_mode": "HOST_NETWORK",
            "service_account": None,
            "services": {key: {"ports": [{"service_port": 5432, "target_port": 15432}]}},
        },
        outside,
    )
    assert (
        "status"
        not in served.workloads["Kubernetes/discovery.k8s.io/EndpointSlice/demo/legacy-abc/192.0.2.8"]
    )
    assert "Kubernetes/discovery.k8s.io/EndpointSlice/demo/legacy-abc/10.0.0.1" not in served.workloads
