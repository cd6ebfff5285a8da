"""Manifests to the waypoints workloads and services use, decoded from the wire: `istio.io/use-waypoint`
on namespaces, services and pods, the waypoint's own pods and Service, as istiod resolves them."""

from __future__ import annotations

from tests.kube_wire import NS, SERVICE, pod, serve, subset

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
    # A status whose hostname is empty: no waypoint at no hostname (the proxies would refuse it).
    empty = "status:\n  addresses: [{type: Hostname, value: ''}]\n"
    with_empty = serve(NS + ingress + empty + pod("p", labels=labels))
    assert with_empty.refusals == [
        "t.yaml document 2: Gateway demo/ingress refused: "
        "status.addresses: a Hostname address that is empty; not a waypoint"
    ]
    assert "waypoint" not in with_empty.workloads["Kubernetes//Pod/demo/p"]
    assert with_empty.warned("Pod demo/p", "waypoint demo/ingress is not found")
