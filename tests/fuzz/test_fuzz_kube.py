"""The manifest reader and the ambient index fed random objects: every kind read, metadata and spec
fields from the objects' own vocabulary with values of every shape, and the example manifests with
characters inserted and deleted. Every input gives served resources plus refusals, or one
`ManifestError` for a file that does not parse; never anything else, and what is served always
encodes for the wire."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from controlplane.kube.index import build
from controlplane.kube.manifests import READ_KINDS, ManifestError, objects_of, parse_documents
from controlplane.snapshot import snapshot_from_config

EXAMPLE = "\n---\n".join(
    p.read_text() for p in sorted((Path(__file__).parents[2] / "examples" / "kube").glob("*.yaml"))
)

FIELDS = [
    "spec", "status", "selector", "matchLabels", "ports", "port", "targetPort", "name", "number", "podIP",
    "podIPs", "ip", "clusterIP", "clusterIPs", "hosts", "addresses", "endpoints", "address", "labels",
    "rules", "from", "to", "when", "source", "operation", "principals", "ipBlocks", "namespaces", "key",
    "values", "notValues", "mtls", "mode", "portLevelMtls", "workloadSelector", "listeners", "protocol",
    "allowedRoutes", "containers", "containerPort", "securityContext", "runAsUser", "conditions", "type",
    "serviceAccountName", "nodeName", "hostNetwork", "ownerReferences", "generateName", "resolution",
    "trafficDistribution", "internalTrafficPolicy", "action", "targetRefs", "gatewayClassName", "weight",
    "targetRef", "kind", "ready", "uid",
]  # fmt: skip
LABELS = [
    "app", "version", "istio.io/dataplane-mode", "istio.io/use-waypoint", "istio.io/use-waypoint-namespace",
    "istio.io/waypoint-for", "gateway.networking.k8s.io/gateway-name", "networking.istio.io/tunnel",
    "topology.istio.io/network", "pod-template-hash", "kubernetes.io/service-name",
]  # fmt: skip
SCALAR = st.one_of(
    st.sampled_from(
        ["ambient", "none", "all", "STRICT", "DENY", "ALLOW", "10.0.0.1", "fd00::1", "10.0.0.0/8"]
    ),
    st.sampled_from(["*", "a*", "*a", "80", "http", "HBONE", "NONE", "DNS", "Ready", "True", "demo", "w"]),
    st.integers(-2, 70000),
    st.booleans(),
    st.none(),
    st.text(max_size=4),
)
VALUE = st.recursive(
    SCALAR,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(FIELDS), inner, max_size=4),
    max_leaves=12,
)
LABEL_MAP = st.dictionaries(
    st.sampled_from(LABELS), st.one_of(SCALAR, st.sampled_from(["waypoint", "demo"])), max_size=3
)


@st.composite
def objects(draw: st.DrawFn) -> dict[str, object]:
    group, kind = draw(st.sampled_from(sorted(READ_KINDS)))
    return {
        "apiVersion": f"{group}/v1" if group else "v1",
        "kind": kind,
        "metadata": {
            "name": draw(st.sampled_from(["a", "b", "waypoint", "demo", "istio-system"])),
            "namespace": draw(st.sampled_from(["demo", "istio-system", "other"])),
            "labels": draw(LABEL_MAP),
        },
        "spec": draw(st.dictionaries(st.sampled_from(FIELDS), VALUE, max_size=5)),
        "status": draw(st.dictionaries(st.sampled_from(FIELDS), VALUE, max_size=3)),
        # An EndpointSlice's fields are at the top level.
        **draw(st.dictionaries(st.sampled_from(["endpoints", "ports", "addressType"]), VALUE, max_size=2)),
    }


def _served(text: str) -> None:
    try:
        documents = parse_documents(text, "fuzz.yaml")
    except ManifestError:
        return
    read = objects_of(documents, "fuzz.yaml")
    index = build(read.objects)
    snapshot_from_config(
        index.config, "fuzz.yaml"
    )  # raises nothing: every resource encodes, names are unique


@given(st.lists(objects(), max_size=8))
def test_random_objects(objs: list[dict[str, object]]) -> None:
    _served("\n---\n".join(json.dumps(o) for o in objs))


@given(st.data())
def test_the_example_mutated(data: st.DataObject) -> None:
    text = EXAMPLE
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(text)))
        if data.draw(st.booleans()):
            text = (
                text[:i]
                + data.draw(st.sampled_from([" ", "\n", "-", ":", "[", "{", "'", "1", "a", "*"]))
                + text[i:]
            )
        else:
            text = text[:i] + text[i + data.draw(st.integers(1, 8)) :]
    _served(text)
