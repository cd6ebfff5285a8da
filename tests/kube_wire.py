"""Manifests to what the control plane sends, decoded from the wire: the helper of the kube tests, and
the manifest snippets they share.

`serve` reads manifests as `--kube` does, builds the snapshot the control plane serves, and decodes
every resource back from its `Any` into the wire protos, rendered as dicts with proto field names,
IPs as text and proto defaults left out (as the wire leaves them out).
"""

from __future__ import annotations

import base64
import ipaddress
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import json_format

from controlplane.kube.cluster import Options
from controlplane.kube.index import Index, build
from controlplane.kube.manifests import objects_of, parse_documents
from controlplane.snapshot import snapshot_from_config
from xds.gen.istio.security import authorization_pb2
from xds.gen.istio.workload import workload_pb2

ADDRESS_TYPE = "type.googleapis.com/istio.workload.Address"
AUTHORIZATION_TYPE = "type.googleapis.com/istio.security.Authorization"


def _ips(value: Any, key: str = "") -> Any:
    if isinstance(value, dict):
        return {k: _ips(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_ips(v, key) for v in value]
    if isinstance(value, str) and key in ("address", "addresses"):
        return str(ipaddress.ip_address(base64.b64decode(value)))
    return value


@dataclass
class Served:
    workloads: dict[str, dict[str, Any]] = field(default_factory=dict)  # by uid
    services: dict[str, dict[str, Any]] = field(default_factory=dict)  # by `namespace/hostname`
    policies: dict[str, dict[str, Any]] = field(default_factory=dict)  # by `namespace/name`
    index: Index = field(default_factory=Index)

    @property
    def refusals(self) -> list[str]:
        return [str(r) for r in self.index.refusals]

    def warned(self, *parts: str) -> bool:
        return any(all(p in w for p in parts) for w in self.index.warnings)


def serve(text: str, options: Options | None = None) -> Served:
    objects = objects_of(parse_documents(text, "t.yaml"), "t.yaml")
    index = build(objects.objects, options)
    index.refusals[:0] = objects.refusals
    snapshot = snapshot_from_config(index.config)
    out = Served(index=index)
    for name, resource in snapshot.resources[ADDRESS_TYPE].items():
        address = workload_pb2.Address()
        assert resource.resource.Unpack(address)
        rendered = _ips(json_format.MessageToDict(address, preserving_proto_field_name=True))
        if "workload" in rendered:
            out.workloads[name] = rendered["workload"]
        else:
            out.services[name] = rendered["service"]
    for name, resource in snapshot.resources[AUTHORIZATION_TYPE].items():
        policy = authorization_pb2.Authorization()
        assert resource.resource.Unpack(policy)
        out.policies[name] = _ips(json_format.MessageToDict(policy, preserving_proto_field_name=True))
    return out


# --- manifest snippets the kube tests share ---------------------------------------------------

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


def policy(name: str, body: str, ns: str = "demo", meta: str = "") -> str:
    return f"""
---
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {{name: {name}, namespace: {ns}{meta}}}
spec:
{body}
"""


def peer(name: str, ns: str, mode: str, selector: str = "", ports: str = "") -> str:
    return f"""
---
apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata: {{name: {name}, namespace: {ns}}}
spec:
  mtls: {{mode: {mode}}}{selector}{ports}
"""


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
