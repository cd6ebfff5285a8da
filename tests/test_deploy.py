"""The manifests in deploy/: valid against a current Kubernetes schema (strict: no unknown fields),
and saying what the image and its tests rely on (the chart's arguments, environment, capabilities,
read-only root, mounts; the node agent's install options, accepted by the CLI)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.test_image import CHART_CAPS, CHART_ENV
from ztunnel.cli import build_parser

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
MANIFESTS = sorted(DEPLOY.glob("*.yaml"))


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def daemonset(name: str) -> dict[str, Any]:
    for path in MANIFESTS:
        for doc in documents(path):
            if doc["kind"] == "DaemonSet" and doc["metadata"]["name"] == name:
                return doc
    raise AssertionError(f"no DaemonSet {name} in {DEPLOY}")


def test_there_are_the_two_daemonsets() -> None:
    assert [p.name for p in MANIFESTS] == ["node-agent.yaml", "ztunnel.yaml"]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_resource_is_valid_against_the_current_schema(path: Path) -> None:
    version = kubernetes_validate.latest_version()
    kinds = []
    for doc in documents(path):
        kubernetes_validate.validate(doc, version, strict=True)  # raises ValidationError
        kinds.append(doc["kind"])
    assert kinds == ["ServiceAccount", "DaemonSet"]


def test_a_broken_resource_is_caught() -> None:
    """The check above can fail: an unknown field and a wrong type are both refused."""
    doc = daemonset("ztunnel")
    container = doc["spec"]["template"]["spec"]["containers"][0]
    version = kubernetes_validate.latest_version()
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate({**doc, "spec": {**doc["spec"], "replicas": 3}}, version, strict=True)
    container["readinessProbe"]["httpGet"]["port"] = [15021]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, version, strict=True)


def test_ztunnel_runs_as_the_chart_does() -> None:
    pod = daemonset("ztunnel")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["args"] == ["proxy", "ztunnel"]
    assert build_parser().parse_args(container["args"]).command == "proxy"
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert (security["runAsUser"], security["runAsGroup"]) == (0, 1337)
    assert security["capabilities"] == {"drop": ["ALL"], "add": [c.removeprefix("CAP_") for c in CHART_CAPS]}
    assert container["readinessProbe"]["httpGet"] == {"port": 15021, "path": "/healthz/ready"}
    # The image test runs the container with this environment (its own values where the cluster's
    # would come from the downward API), plus one proxy-metadata example.
    assert {e["name"] for e in container["env"]} == set(CHART_ENV) - {"ISTIO_META_ENABLE_HBONE"}
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert mounts == {"/var/run/secrets/istio", "/var/run/secrets/tokens", "/var/run/ztunnel", "/tmp"}
    token = next(v for v in pod["volumes"] if v["name"] == "istio-token")
    assert token["projected"]["sources"][0]["serviceAccountToken"]["audience"] == "istio-ca"
    assert pod["automountServiceAccountToken"] is False


def test_the_node_agent_installs_the_plugin_on_the_node_paths() -> None:
    pod = daemonset("ztunnel-node-agent")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = build_parser().parse_args(container["args"])
    assert args.command == "cni-agent"
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    host = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert host[mounts[args.cni_bin_dir]] == "/opt/cni/bin"
    assert host[mounts[args.cni_conf_dir]] == "/etc/cni/net.d"
    # The plugin runs on the node and dials the socket named in the conflist: same path both sides.
    assert host[mounts["/var/run/ztunnel"]] == "/var/run/ztunnel"
    assert args.cni_socket.startswith("/var/run/ztunnel/")
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["automountServiceAccountToken"] is False
