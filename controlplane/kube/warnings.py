"""Warnings a user can act on, in the spirit of `istioctl precheck` and `istioctl analyze`.

Each is one line naming the object and what to change. They are printed when the manifests load
and do not change what is served.
"""

from __future__ import annotations

from collections.abc import Iterator

from controlplane.kube.cluster import CANONICAL_NAME_LABELS, CANONICAL_REVISION_LABELS, Cluster
from controlplane.kube.manifests import Obj
from controlplane.kube.workloads import pod_ips, pod_ready

PROXY_UID = 1337


def _run_as_1337(pod: Obj) -> str | None:
    contexts = [("the pod", pod.spec.get("securityContext"))]
    for kind in ("initContainers", "containers"):
        for container in pod.spec.get(kind) or []:
            if isinstance(container, dict):
                contexts.append((f"container {container.get('name', '?')}", container.get("securityContext")))
    for who, context in contexts:
        if isinstance(context, dict) and context.get("runAsUser") == PROXY_UID:
            return who
    return None


def pod_warnings(pod: Obj, cluster: Cluster) -> Iterator[str]:
    who = f"Pod {pod.namespace}/{pod.name}"
    runner = _run_as_1337(pod)
    if runner is not None:
        yield (
            f"{who}: {runner} runs as UID {PROXY_UID}, the proxy's own UID, whose traffic Istio's redirection "
            "leaves alone: its connections bypass the mesh; run it as another user"
        )
    has_name = any(label in pod.labels for label in CANONICAL_NAME_LABELS)
    has_revision = any(label in pod.labels for label in CANONICAL_REVISION_LABELS)
    if not (has_name and has_revision):
        missing = " and ".join(
            what for what, have in (("app", has_name), ("version", has_revision)) if not have
        )
        yield (
            f"{who}: no {missing} label (nor service.istio.io/canonical-"
            f"{'name' if not has_name else 'revision'}): telemetry and policy names fall back to defaults; add it"
        )
    if pod.status.get("phase") in ("Succeeded", "Failed"):
        return
    try:
        addresses = pod_ips(pod)
    except Exception:  # an invalid IP is reported as the pod's refusal
        return
    if not addresses:
        yield f"{who}: no status.podIP, so no workload (istiod waits for the pod's IP); add status.podIP"
    elif not pod_ready(pod):
        yield (
            f"{who}: no Ready condition that is True in status.conditions, so the workload is UNHEALTHY "
            "and services do not send to it"
        )
