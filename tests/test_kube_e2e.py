"""Kubernetes manifests drive the mesh, end to end, as real processes.

`ztunnel control-plane --kube DIR` serves what istiod would compute from a directory of manifests;
three `ztunnel proxy` processes (dedicated mode, with worker processes) play the pods of those
manifests, get their state over Delta ADS and their certificates from its CA; connections are
allowed and denied as the AuthorizationPolicy says, and editing the policy's file changes the
outcome live. What is checked is what a user sees: the traffic, the SOCKS5 replies, the control
plane's log.
"""

from __future__ import annotations

import os
import random
import re
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.apps import echo_server, exchange, socks5_reply
from tests.harness import ControlPlane, Fleet, proxy_env
from tests.waiting import eventually

pytestmark = pytest.mark.timeout(180)

NET = f"127.{random.randint(16, 250)}.{random.randint(0, 250)}"
SERVER, CLIENT, INTRUDER, CP_HOST = f"{NET}.3", f"{NET}.2", f"{NET}.4", f"{NET}.10"
APP_PORT = 8080
# A cluster IP of the Service in front of the server pod (a range no host uses: only the mesh knows it).
VIP = f"240.{random.randint(0, 250)}.{random.randint(0, 250)}.80"

NAMESPACE = """\
apiVersion: v1
kind: Namespace
metadata:
  name: demo
  labels: {istio.io/dataplane-mode: ambient}
"""


def pod(name: str, ip: str) -> str:
    return f"""\
---
apiVersion: v1
kind: Pod
metadata:
  name: {name}
  namespace: demo
  labels: {{app: {name}, version: v1}}
spec:
  serviceAccountName: {name}
  containers: [{{name: app, image: app, ports: [{{name: echo, containerPort: {APP_PORT}}}]}}]
status:
  podIP: {ip}
  conditions: [{{type: Ready, status: "True"}}]
"""


# A `kind: List` as `kubectl get -o yaml` prints it, with a pod that cannot be converted; a Service
# whose named target port resolves to the server pod's container port.
PODS = (
    pod("server", SERVER)
    + pod("client", CLIENT)
    + pod("intruder", INTRUDER)
    + """\
---
apiVersion: v1
kind: List
items:
  - apiVersion: v1
    kind: Pod
    metadata: {name: broken, namespace: demo, labels: {app: broken, version: v1}}
    status: {podIP: 10.0.0.999}
"""
    + f"""\
---
apiVersion: v1
kind: Service
metadata:
  name: echo
  namespace: demo
spec:
  clusterIP: {VIP}
  selector:
    app: server
  ports:
    - name: tcp-echo
      port: 80
      targetPort: echo
"""
)


def only(principal: str) -> str:
    return f"""\
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata:
  name: only-one
  namespace: demo
spec:
  selector:
    matchLabels: {{app: server}}
  action: ALLOW
  rules:
    - from:
        - source:
            principals: ["cluster.local/ns/demo/sa/{principal}"]
      to:
        - operation:
            ports: ["{APP_PORT}"]
"""


@dataclass
class Mesh:
    manifests: Path
    cp: ControlPlane


def write(path: Path, text: str) -> None:
    """Replace the file in one step, as editors that save by rename do."""
    tmp = path.with_name("." + path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def env_of(name: str, ip: str, control_plane: ControlPlane) -> dict[str, str]:
    """A dedicated proxy of the pod `demo/name` fed by the control plane (the server with 2 workers)."""
    env = proxy_env(
        ip, f"demo/{name}/{name}", INSTANCE_IP=ip, ZTUNNEL_WORKER_THREADS="2" if name == "server" else "1"
    )
    return control_plane.wire(env)


@pytest.fixture(scope="module")
def echo() -> Iterator[None]:
    with echo_server(SERVER, APP_PORT):
        yield


@pytest.fixture
def mesh(echo: None, tmp_path: Path, fleet: Fleet) -> Mesh:
    manifests = tmp_path / "manifests"
    manifests.mkdir()
    (manifests / "00-namespace.yaml").write_text(NAMESPACE)
    (manifests / "10-pods.yaml").write_text(PODS)
    (manifests / "20-policy.yaml").write_text(only("client"))
    (manifests / "README.md").write_text("not a manifest: not read\n")
    cp = fleet.control_plane(tmp_path, CP_HOST, None, "--kube", str(manifests))
    fleet.start_all(
        *(
            env_of(name, ip, cp)
            for name, ip in (("server", SERVER), ("client", CLIENT), ("intruder", INTRUDER))
        )
    )
    return Mesh(manifests, cp)


def connect(proxy_ip: str, target: tuple[str, int] = (SERVER, APP_PORT)) -> tuple[socket.socket, int]:
    """A SOCKS5 CONNECT through a proxy to the server pod's app; the reply code (0: connected)."""
    return socks5_reply(proxy_ip, *target)


def echoed(proxy_ip: str, payload: bytes, target: tuple[str, int] = (SERVER, APP_PORT)) -> bool:
    """Whether a new connection through `proxy_ip` carries `payload` to the server's app and back."""
    s, code = connect(proxy_ip, target)
    with s:
        if code != 0:
            return False
        try:
            return exchange(s, payload) == payload
        except OSError:
            return False


def denied(proxy_ip: str) -> bool:
    s, code = connect(proxy_ip)
    s.close()
    return code == 2  # "connection not allowed by ruleset"


def held_open(s: socket.socket) -> bool:
    try:
        s.sendall(b"ping")
        return s.recv(4) == b"ping"
    except OSError:
        return False


def test_manifests_drive_identity_policy_and_live_edits(mesh: Mesh) -> None:
    out = mesh.cp.log
    # What could not be converted is named, and the rest applies.
    assert re.search(r"Pod demo/broken refused: status.podIPs: invalid IP address '10.0.0.999'", out()), out()
    assert "3 workload(s), 1 service(s), 1 polic(ies)" in out(), out()
    # Certificates from the control plane's CA, for the identities the pods' service accounts give.
    for name in ("server", "client", "intruder"):
        eventually(
            lambda n=name: f"issued a certificate for spiffe://cluster.local/ns/demo/sa/{n} " in out(),
            f"{name}'s certificate",
        )  # type: ignore[misc]
    payload = os.urandom(200_000)
    assert echoed(CLIENT, payload)
    assert denied(INTRUDER)
    # The Service's VIP port 80 reaches the pod's port named `echo` (8080), the policy's port.
    assert echoed(CLIENT, b"by the service", (VIP, 80))

    held, code = connect(CLIENT)
    assert code == 0 and held_open(held)

    # A save that does not parse: refused, the last good state keeps being served.
    write(mesh.manifests / "20-policy.yaml", only("intruder").replace("rules:", "rules: [oops"))
    eventually(
        lambda: "refused the changed file, keeping what it held before" in out(), "the refusal", timeout=20
    )
    assert echoed(CLIENT, b"still allowed") and denied(INTRUDER) and held_open(held)

    # The edit: now only the intruder. The open connection is closed, and the outcomes swap.
    write(mesh.manifests / "20-policy.yaml", only("intruder"))
    eventually(
        lambda: not held_open(held), "the client's open connection closed by the server's proxy", timeout=20
    )
    held.close()
    eventually(lambda: denied(CLIENT), "the client denied", timeout=20)
    assert echoed(INTRUDER, payload)
    # Pushed as the difference: the one policy changed, no address.
    assert re.search(
        r"configuration reloaded: Authorization 1 updated, 0 removed; pushing to 3 stream", out()
    ), out()
    assert not re.search(r"configuration reloaded: Address", out()), out()

    # Removing the policy file removes the policy: everyone is allowed.
    (mesh.manifests / "20-policy.yaml").unlink()
    eventually(lambda: echoed(CLIENT, b"open again"), "the client allowed with no policy", timeout=20)
    assert echoed(INTRUDER, b"and the intruder")
