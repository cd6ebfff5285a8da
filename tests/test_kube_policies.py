"""Manifests to the policies the control plane sends, decoded from the wire (AuthorizationPolicy,
PeerAuthentication, as istiod converts them for ztunnel) and the verdicts a proxy reaches with
them; then reading: lists, refusals, warnings."""

from __future__ import annotations

import base64
import ipaddress
from typing import Any

from google.protobuf import json_format

from policy.model import Connection, Scope
from policy.rbac import Allow, authorize
from tests.kube_wire import NS, peer, pod, policy, serve, subset
from xds.convert import authorization_from_wire
from xds.gen.istio.security import authorization_pb2

# --- authorization ------------------------------------------------------------------------------


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
