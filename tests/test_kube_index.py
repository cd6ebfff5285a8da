"""Manifests to the resources the control plane sends, decoded from the wire: istiod's ambient index,
one conversion per case (workloads, services, waypoints, policies), with the refusals and warnings a
user sees."""

from __future__ import annotations

import base64
import ipaddress
from typing import Any

import pytest
from google.protobuf import json_format

from controlplane.kube.cluster import Options
from policy.model import Connection, Scope
from policy.rbac import Allow, authorize
from tests.kube_wire import serve
from xds.convert import authorization_from_wire
from xds.gen.istio.security import authorization_pb2

NS = """
apiVersion: v1
kind: Namespace
metadata:
  name: demo
  labels: {istio.io/dataplane-mode: ambient}
"""


def pod(
    name: str,
    ip: str = "10.0.0.1",
    *,
    ns: str = "demo",
    labels: str = "{app: a, version: v1}",
    extra: str = "",
    spec: str = "",
    status: str = "",
) -> str:
    return f"""
---
apiVersion: v1
kind: Pod
metadata:
  name: {name}
  namespace: {ns}
  labels: {labels}{extra}
spec:
  serviceAccountName: sa-{name}{spec}
status:
  podIP: {ip}
  conditions: [{{type: Ready, status: "True"}}]{status}
"""


def subset(expected: dict[str, Any], actual: dict[str, Any]) -> None:
    """Every expected field has the expected value; None: the field is absent (the proto default)."""
    for key, value in expected.items():
        if value is None:
            assert key not in actual, f"{key} = {actual[key]!r}, expected absent"
        else:
            assert actual.get(key) == value, f"{key}: {actual.get(key)!r} != {value!r}"


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

SERVICE = """
---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: demo}
spec:
  clusterIP: 10.96.0.10
  clusterIPs: [10.96.0.10, "fd00:96::10"]
  ipFamilies: [IPv4, IPv6]
  selector: {app: web}
  ports:
    - {name: http, port: 80, targetPort: http-web}
    - {name: grpc, port: 9090, targetPort: 9091}
    - {name: metrics, port: 9100}
"""


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


# --- waypoints ----------------------------------------------------------------------------------

WAYPOINT = """
---
apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata:
  name: waypoint
  namespace: demo
  labels: {{istio.io/waypoint-for: {traffic}}}
spec:
  gatewayClassName: istio-waypoint
  listeners: [{{name: mesh, port: 15008, protocol: HBONE{allowed}}}]
{status}"""


def waypoint(traffic: str = "service", allowed: str = "", status: str = "") -> str:
    return WAYPOINT.format(traffic=traffic, allowed=allowed, status=status)


WAYPOINT_HOST = {
    "hostname": {"namespace": "demo", "hostname": "waypoint.demo.svc.cluster.local"},
    "hbone_mtls_port": 15008,
}


def test_namespace_waypoint_for_services_not_for_pods_by_default() -> None:
    served = serve(
        """
apiVersion: v1
kind: Namespace
metadata: {name: demo, labels: {istio.io/dataplane-mode: ambient, istio.io/use-waypoint: waypoint}}
"""
        + waypoint()
        + SERVICE
        + pod("p", labels="{app: web, version: v1}")
    )
    assert served.services["demo/web.demo.svc.cluster.local"]["waypoint"] == WAYPOINT_HOST
    assert "waypoint" not in served.workloads["Kubernetes//Pod/demo/p"]


def test_workload_waypoint_pod_label_opt_out_and_status_address() -> None:
    status = "status:\n  addresses: [{type: IPAddress, value: 10.96.5.5}]"
    served = serve(
        """
apiVersion: v1
kind: Namespace
metadata: {name: demo, labels: {istio.io/use-waypoint: waypoint}}
"""
        + waypoint("all", status=status)
        + pod("p", "10.0.0.1")
        + pod("q", "10.0.0.2", labels="{app: a, version: v1, istio.io/use-waypoint: none}")
    )
    assert served.workloads["Kubernetes//Pod/demo/p"]["waypoint"] == {
        "address": {"address": "10.96.5.5"},
        "hbone_mtls_port": 15008,
    }
    assert "waypoint" not in served.workloads["Kubernetes//Pod/demo/q"]


def test_waypoint_in_another_namespace_needs_allowed_routes() -> None:
    def mesh(allowed: str) -> str:
        return (
            NS
            + waypoint("all", allowed=allowed)
            + pod(
                "p",
                ns="other",
                labels="{app: a, version: v1, istio.io/use-waypoint: waypoint, istio.io/use-waypoint-namespace: demo}",
            )
        )

    denied = serve(mesh(""))
    assert "waypoint" not in denied.workloads["Kubernetes//Pod/other/p"]
    assert denied.warned("Pod other/p", "does not allow attachment from namespace other")
    allowed = serve(mesh(", allowedRoutes: {namespaces: {from: All}}"))
    assert allowed.workloads["Kubernetes//Pod/other/p"]["waypoint"] == WAYPOINT_HOST


def test_the_waypoints_own_pods_and_service() -> None:
    served = serve(
        """
apiVersion: v1
kind: Namespace
metadata: {name: demo, labels: {istio.io/use-waypoint: waypoint}}
---
apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata:
  name: waypoint
  namespace: demo
  annotations: {ambient.istio.io/waypoint-inbound-binding: PROXY/15088}
spec: {gatewayClassName: istio-waypoint, listeners: [{name: mesh, port: 15008, protocol: HBONE}]}
---
apiVersion: v1
kind: Service
metadata: {name: waypoint, namespace: demo, labels: {gateway.istio.io/managed: istio.io-mesh-controller}}
spec: {clusterIP: 10.96.5.5, selector: {gateway.networking.k8s.io/gateway-name: waypoint}, ports: [{port: 15008}]}
"""
        + pod(
            "waypoint-0",
            labels="{gateway.networking.k8s.io/gateway-name: waypoint, istio.io/dataplane-mode: none, networking.istio.io/tunnel: http}",
        )
        + pod("missing", "10.0.0.2", labels="{app: a, version: v1, istio.io/use-waypoint: nope}")
    )
    instance = served.workloads["Kubernetes//Pod/demo/waypoint-0"]
    subset(
        {
            "tunnel_protocol": "HBONE",
            "native_tunnel": True,
            "application_tunnel": {"protocol": "PROXY", "port": 15088},
            "waypoint": None,
        },
        instance,
    )
    assert "waypoint" not in served.services["demo/waypoint.demo.svc.cluster.local"]
    assert served.warned("Pod demo/missing", "waypoint demo/nope is not found")


# --- authorization ------------------------------------------------------------------------------


def policy(name: str, body: str, ns: str = "demo", meta: str = "") -> str:
    return f"""
---
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {{name: {name}, namespace: {ns}{meta}}}
spec:
{body}
"""


def test_authorization_policy_l4_fields() -> None:
    served = serve(
        policy(
            "full",
            """  action: DENY
  rules:
    - from:
        - source:
            principals: [cluster.local/ns/a/sa/b, "spiffe-prefix*", "*-suffix", "*"]
            notNamespaces: [kube-system]
            ipBlocks: [10.0.0.0/8, 192.0.2.1]
            notIpBlocks: ["fd00::/8"]
            serviceAccounts: [other/sa-x, sa-y]
      to:
        - operation: {ports: ["80", "8080", "not-a-port"], notPorts: ["9090"]}
      when:
        - {key: destination.ip, values: [10.96.0.0/12]}
        - {key: source.namespace, notValues: [test]}""",
        )
    )
    subset(
        {
            "name": "full",
            "namespace": "demo",
            "scope": "NAMESPACE",
            "action": "DENY",
            "rules": [
                {
                    "clauses": [
                        {"matches": [{"destination_ports": [80, 8080], "not_destination_ports": [9090]}]},
                        {
                            "matches": [
                                {
                                    "principals": [
                                        {"exact": "cluster.local/ns/a/sa/b"},
                                        {"prefix": "spiffe-prefix"},
                                        {"suffix": "-suffix"},
                                        {"presence": {}},
                                    ],
                                    "not_namespaces": [{"exact": "kube-system"}],
                                    "source_ips": [
                                        {"address": "10.0.0.0", "length": 8},
                                        {"address": "192.0.2.1", "length": 32},
                                    ],
                                    "not_source_ips": [{"address": "fd00::", "length": 8}],
                                    "service_accounts": [
                                        {"namespace": "other", "serviceAccount": "sa-x"},
                                        {"namespace": "demo", "serviceAccount": "sa-y"},
                                    ],
                                }
                            ]
                        },
                        {"matches": [{"destination_ips": [{"address": "10.96.0.0", "length": 12}]}]},
                        {"matches": [{"not_namespaces": [{"exact": "test"}]}]},
                    ]
                }
            ],
        },
        served.policies["demo/full"],
    )


def test_scopes_and_which_workloads_name_a_policy() -> None:
    served = serve(
        NS
        + pod("a", "10.0.0.1", labels="{app: a, version: v1}")
        + pod("b", "10.0.0.2", labels="{app: b, version: v1}")
        + policy("for-a", "  selector: {matchLabels: {app: a}}\n  rules: [{}]")
        + policy("mesh-for-a", "  selector: {matchLabels: {app: a}}\n  rules: [{}]", ns="istio-system")
        + policy("namespace", "  rules: [{}]")
        + policy(
            "global", "  action: DENY\n  rules: [{from: [{source: {namespaces: [evil]}}]}]", ns="istio-system"
        )
    )
    assert served.policies["demo/for-a"]["scope"] == "WORKLOAD_SELECTOR"
    assert served.policies["demo/for-a"]["rules"] == [{}]  # an empty rule: a group that matches everything
    assert served.policies["demo/namespace"]["scope"] == "NAMESPACE"
    assert "scope" not in served.policies["istio-system/global"]  # GLOBAL, the proto default
    assert served.workloads["Kubernetes//Pod/demo/a"]["authorization_policies"] == [
        "demo/for-a",
        "istio-system/mesh-for-a",
    ]
    assert "authorization_policies" not in served.workloads["Kubernetes//Pod/demo/b"]


def test_http_attributes_allow_drops_the_rule_deny_drops_the_attributes() -> None:
    served = serve(
        policy(
            "allow-mixed",
            """  rules:
    - to: [{operation: {methods: [GET], ports: ["80"]}}]
    - from: [{source: {namespaces: [ok]}}]""",
        )
        + policy(
            "deny-mixed",
            """  action: DENY
  rules:
    - to: [{operation: {paths: [/admin], ports: ["80"]}}]""",
        )
        + policy(
            "deny-only-http",
            """  action: DENY
  rules:
    - from: [{source: {requestPrincipals: ["*"]}}]
      when: [{key: "request.headers[x-user]", values: [bob]}]""",
        )
    )
    # ALLOW: the rule with an HTTP attribute can never match at ztunnel and is dropped.
    assert served.policies["demo/allow-mixed"]["rules"] == [
        {"clauses": [{"matches": [{"namespaces": [{"exact": "ok"}]}]}]}
    ]
    assert served.warned(
        "AuthorizationPolicy demo/allow-mixed", "found: methods", "rules matching HTTP attributes are omitted"
    )
    # DENY: enforced without its HTTP attributes, so it denies all of port 80.
    assert served.policies["demo/deny-mixed"]["rules"] == [
        {"clauses": [{"matches": [{"destination_ports": [80]}]}]}
    ]
    assert served.warned(
        "AuthorizationPolicy demo/deny-mixed", "found: paths", "more restrictive than requested"
    )
    # DENY with nothing but HTTP attributes: empty matches, which ztunnel skips: no effect.
    assert served.policies["demo/deny-only-http"]["rules"] == [
        {"clauses": [{"matches": [{}]}, {"matches": [{}]}]}
    ]
    assert served.warned(
        "demo/deny-only-http", "request.headers[x-user], requestPrincipals", "will have no effect"
    )


def test_policies_not_for_ztunnel() -> None:
    served = serve(
        policy(
            "for-waypoint",
            "  targetRefs: [{kind: Gateway, group: gateway.networking.k8s.io, name: waypoint}]\n  rules: [{}]",
        )
        + policy("custom", "  action: CUSTOM\n  provider: {name: ext}\n  rules: [{}]")
        + policy("audit", "  action: AUDIT\n  rules: [{}]")
        + policy("dry", "  action: DENY\n  rules: [{}]", meta=", annotations: {istio.io/dry-run: 'true'}")
    )
    assert served.policies == {}
    assert served.warned("demo/custom", "does not support the CUSTOM action")
    assert served.warned("demo/dry", "dry-run")
    assert not served.warned("demo/for-waypoint")


def peer(name: str, ns: str, mode: str, selector: str = "", ports: str = "") -> str:
    return f"""
---
apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata: {{name: {name}, namespace: {ns}}}
spec:
  mtls: {{mode: {mode}}}{selector}{ports}
"""


STRICT = {
    "name": "istio_converted_static_strict",
    "namespace": "istio-system",
    "scope": "WORKLOAD_SELECTOR",
    "action": "DENY",
    "rules": [{"clauses": [{"matches": [{"not_principals": [{"presence": {}}]}]}]}],
}


def test_peer_authentication_strict_and_its_overrides() -> None:
    served = serve(
        NS
        + """
---
apiVersion: v1
kind: Namespace
metadata: {name: relaxed}
"""
        + peer("default", "istio-system", "STRICT")
        + peer("relaxed", "relaxed", "PERMISSIVE")
        + peer(
            "ports",
            "demo",
            "STRICT",
            selector="\n  selector: {matchLabels: {app: b}}",
            ports="\n  portLevelMtls: {'9090': {mode: PERMISSIVE}}",
        )
        + pod("a", "10.0.0.1", labels="{app: a, version: v1}")
        + pod("b", "10.0.0.2", labels="{app: b, version: v1}")
        + pod("c", "10.0.0.3", ns="relaxed")
    )
    assert served.policies["istio-system/istio_converted_static_strict"] == STRICT
    assert served.workloads["Kubernetes//Pod/demo/a"]["authorization_policies"] == [
        "istio-system/istio_converted_static_strict"
    ]
    assert "authorization_policies" not in served.workloads["Kubernetes//Pod/relaxed/c"]
    # STRICT but for one port: the converted policy replaces the static one for this workload.
    assert served.workloads["Kubernetes//Pod/demo/b"]["authorization_policies"] == [
        "demo/converted_peer_authentication_ports"
    ]
    assert served.policies["demo/converted_peer_authentication_ports"] == {
        "name": "converted_peer_authentication_ports",
        "namespace": "demo",
        "scope": "WORKLOAD_SELECTOR",
        "action": "DENY",
        "rules": [
            {
                "clauses": [
                    {"matches": [{"not_principals": [{"presence": {}}]}]},
                    {"matches": [{"not_destination_ports": [9090]}]},
                    # The mesh-wide STRICT merged in, as istiod does (here it repeats the first clause).
                    {"matches": [{"not_principals": [{"presence": {}}]}]},
                ]
            }
        ],
    }


def test_no_peer_authentication_no_static_policy() -> None:
    served = serve(NS + pod("a"))
    assert served.policies == {}


# --- reading, refusals, warnings ----------------------------------------------------------------


def test_lists_and_documents_and_kinds_not_read() -> None:
    served = serve(
        """
apiVersion: v1
kind: List
items:
  - {apiVersion: v1, kind: Namespace, metadata: {name: demo}}
  - {apiVersion: apps/v1, kind: Deployment, metadata: {name: web, namespace: demo}}
  - apiVersion: v1
    kind: Pod
    metadata: {name: p, namespace: demo, labels: {app: a, version: v}}
    status: {podIP: 10.0.0.1}
---
apiVersion: v1
kind: Pod
metadata: {name: q, labels: {app: a, version: v}}
status: {podIP: 10.0.0.2}
"""
    )
    # A Pod without a namespace is in `default`, as kubectl applies it.
    assert set(served.workloads) == {"Kubernetes//Pod/demo/p", "Kubernetes//Pod/default/q"}
    assert served.refusals == []


def test_an_object_that_cannot_be_converted_is_refused_and_the_rest_applies() -> None:
    served = serve(
        NS
        + pod("bad-ip", "10.0.0.999")
        + pod("good", "10.0.0.1")
        + pod("good", "10.0.0.2")
        + """
---
apiVersion: v1
kind: Pod
metadata: {name: float-label, namespace: demo, labels: {version: 1.10}}
status: {podIP: 10.0.0.3}
---
apiVersion: v1
kind: Service
metadata: {name: bad-port, namespace: demo}
spec: {ports: [{port: 70000}]}
---
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata: {name: no-hosts, namespace: demo}
spec: {ports: [{number: 80}]}
"""
    )
    assert set(served.workloads) == {"Kubernetes//Pod/demo/good"}
    assert served.workloads["Kubernetes//Pod/demo/good"]["addresses"] == ["10.0.0.1"]
    refusals = served.refusals
    assert (
        "t.yaml document 2: Pod demo/bad-ip refused: status.podIPs: invalid IP address '10.0.0.999'"
        in refusals
    )
    assert any(
        r.startswith("t.yaml document 4: Pod demo/good refused: a duplicate of the one in t.yaml document 3")
        for r in refusals
    )
    assert any(
        "Pod demo/float-label refused: metadata.labels.version: expected a string, got the number 1.1" in r
        for r in refusals
    )
    assert any(
        "Service demo/bad-port refused: spec.ports[0].port: 70000 is out of range" in r for r in refusals
    )
    assert any(
        "ServiceEntry demo/no-hosts refused: spec.hosts: at least one host is required" in r for r in refusals
    )


def test_precheck_warnings() -> None:
    served = serve(
        NS
        + pod("root", spec="\n  securityContext: {runAsUser: 1337}")
        + pod("unlabelled", "10.0.0.2", labels="{}")
        + pod(
            "sidecarish", "10.0.0.3", spec="\n  containers: [{name: app, securityContext: {runAsUser: 1337}}]"
        )
    )
    assert served.warned("Pod demo/root", "the pod runs as UID 1337")
    assert served.warned("Pod demo/sidecarish", "container app runs as UID 1337")
    assert served.warned("Pod demo/unlabelled", "no app and version label")
    assert not served.warned("Pod demo/root", "label")


# --- what a proxy decides with them -------------------------------------------------------------


def decide(text: str, workload_uid: str, principal: str | None, port: int = 80) -> str:
    """The verdict a destination proxy reaches with the policies sent: the wire decoded by the proxy's
    own converter, the candidates chosen as the proxy does (namespace, global, the workload's list)."""
    served = serve(text)
    workload = served.workloads[workload_uid]
    policies = [
        authorization_from_wire(json_format.ParseDict(_wire_ips(p), authorization_pb2.Authorization()))
        for p in served.policies.values()
    ]
    listed = set(workload.get("authorization_policies", []))
    candidates = [
        p
        for p in policies
        if p.scope is Scope.GLOBAL
        or (p.scope is Scope.NAMESPACE and p.namespace == workload["namespace"])
        or p.key in listed
    ]
    ns = principal.split("/")[2] if principal else None
    conn = Connection(
        src_ip=ipaddress.ip_address("10.1.1.1"),
        src_port=40000,
        dst_ip=ipaddress.ip_address(workload["addresses"][0]),
        dst_port=port,
        src_principal=f"spiffe://{principal}" if principal else None,
        src_namespace=ns,
        src_service_account=principal.rsplit("/", 1)[1] if principal else None,
    )
    return "allow" if isinstance(authorize(candidates, conn), Allow) else "deny"


def _wire_ips(value: Any) -> Any:
    """The reverse of the test helper's rendering: IP text back to base64 bytes for ParseDict."""
    if isinstance(value, dict):
        return {
            k: (base64.b64encode(ipaddress.ip_address(v).packed).decode() if k == "address" else _wire_ips(v))
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_wire_ips(v) for v in value]
    return value


def test_the_proxy_enforces_strict_mtls_and_the_fail_closed_deny() -> None:
    mesh = NS + pod("a") + peer("default", "istio-system", "STRICT")
    assert decide(mesh, "Kubernetes//Pod/demo/a", None) == "deny"  # plaintext: no peer identity
    assert decide(mesh, "Kubernetes//Pod/demo/a", "cluster.local/ns/other/sa/x") == "allow"
    deny_get = (
        NS
        + pod("a")
        + policy(
            "no-get", '  action: DENY\n  rules:\n    - to: [{operation: {methods: [GET], ports: ["80"]}}]'
        )
    )
    # The HTTP method is out of ztunnel's sight: all of port 80 is denied, other ports are not.
    assert decide(deny_get, "Kubernetes//Pod/demo/a", "cluster.local/ns/x/sa/y", 80) == "deny"
    assert decide(deny_get, "Kubernetes//Pod/demo/a", "cluster.local/ns/x/sa/y", 8080) == "allow"
    allow_get = NS + pod("a") + policy("only-get", "  rules:\n    - to: [{operation: {methods: [GET]}}]")
    # ALLOW with only an HTTP rule: the rule is dropped, nothing is allowed.
    assert decide(allow_get, "Kubernetes//Pod/demo/a", "cluster.local/ns/x/sa/y") == "deny"


def test_which_gateways_are_waypoints() -> None:
    ingress = """
---
apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata: {name: ingress, namespace: demo, labels: {istio.io/waypoint-for: all}}
spec: {gatewayClassName: istio, listeners: [{name: http, port: 80, protocol: HTTP}]}
"""
    labels = "{app: a, version: v1, istio.io/use-waypoint: ingress}"
    without_status = serve(NS + ingress + pod("p", labels=labels))
    assert "waypoint" not in without_status.workloads["Kubernetes//Pod/demo/p"]
    assert without_status.warned("Pod demo/p", "waypoint demo/ingress is not found")
    # With the status a controller writes, istiod takes any Gateway as a waypoint.
    status = "status:\n  addresses: [{type: Hostname, value: ingress-istio.demo.svc.cluster.local}]\n"
    with_status = serve(NS + ingress + status + pod("p", labels=labels))
    assert with_status.workloads["Kubernetes//Pod/demo/p"]["waypoint"] == {
        "hostname": {"namespace": "demo", "hostname": "ingress-istio.demo.svc.cluster.local"},
        "hbone_mtls_port": 15008,
    }


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
