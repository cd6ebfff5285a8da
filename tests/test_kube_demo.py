"""`ztunnel demo --kube`: the demo's mesh from Kubernetes manifests, and the example manifests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from controlplane.kube.manifests import manifest_files
from tests.kube_wire import serve
from ztunnel.demo import KUBE_MESH, KUBE_ONLY_FRONTEND

EXAMPLES = Path(__file__).parent.parent / "examples" / "kube"


def test_the_example_manifests_are_the_demos() -> None:
    text = "\n---\n".join(p.read_text() for p in manifest_files(EXAMPLES))
    example, demo = serve(text), serve(KUBE_MESH + "\n---\n" + KUBE_ONLY_FRONTEND)
    assert example.refusals == [] and example.index.warnings == []
    assert (example.workloads, example.services, example.policies) == (
        demo.workloads,
        demo.services,
        demo.policies,
    )
    # The server pod is the mesh-only name's endpoint (a ServiceEntry selecting a Pod).
    server = example.workloads["Kubernetes//Pod/demo/server"]
    assert server["services"] == {
        "demo/echo.mesh.internal": {"ports": [{"service_port": 8080, "target_port": 8080}]}
    }
    assert server["authorization_policies"] == ["demo/only-frontend"]


def test_demo_from_manifests_behaves() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "ztunnel", "demo", "--kube"], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stdout + r.stderr
    rows = {" ".join(line.split()) for line in r.stdout.splitlines()}
    assert "from Kubernetes manifests" in r.stdout, r.stdout
    assert (
        "frontend spiffe://cluster.local/ns/demo/sa/frontend 127.0.0.3:8080 allow allowed 1280/1280" in rows
    ), r.stdout
    assert (
        "intruder spiffe://cluster.local/ns/demo/sa/intruder 127.0.0.3:8080 deny denied (SOCKS5 reply 2) 0/0"
        in rows
    ), r.stdout
    assert "DNS A echo.mesh.internal at 127.0.0.2:15053 240.240.0.10" in rows, r.stdout
    assert "AuthorizationPolicy file added: deny frontend pushed over Delta ADS" in rows, r.stdout
    assert "the open connection closed by the server's proxy" in rows, r.stdout
    assert "result: everything behaved" in rows, r.stdout
