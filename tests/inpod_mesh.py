"""In-pod nodes built from network namespaces (tests/cninode.py), each running `ztunnel cni-agent` and
`ztunnel proxy` (PROXY_MODE=shared); the development control plane playing istiod; the apps the pods
run and what the tests read from the ztunnels (access logs, listeners, metrics)."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.cninode import Cluster, Node, Pod
from tests.harness import ControlPlane, Fleet, Proxy
from tests.netns import require_root, require_tools
from tests.waiting import eventually

TD = "cluster.local"

ECHO_APP = """
import socket, sys, threading
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("0.0.0.0", 8080)); srv.listen(64); print("listening", flush=True)
def serve(c):
    with c:
        while data := c.recv(65536):
            c.sendall(data)
while True:
    c, _ = srv.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"""

# Tells each client the address it sees the connection coming from.
WHOAMI_APP = """
import socket
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("0.0.0.0", 8081)); srv.listen(64); print("listening", flush=True)
while True:
    c, peer = srv.accept()
    with c:
        c.sendall(peer[0].encode())
"""

# argv: ip port payload [hold]. Prints what came back; with `hold`, then waits for the close.
CLIENT_APP = """
import socket, sys, time
ip, port, payload = sys.argv[1], int(sys.argv[2]), sys.argv[3].encode()
s = socket.create_connection((ip, port), timeout=8)
s.sendall(payload)
got = b""
try:
    while len(got) < len(payload) and (chunk := s.recv(65536)):
        got += chunk
except OSError as e:
    print("error", type(e).__name__, flush=True)
print("echo", got.decode(errors="replace"), flush=True)
if len(sys.argv) > 4:
    start = time.monotonic()
    try:
        rest = s.recv(1)
        print("closed" if rest == b"" else "data", flush=True)
    except OSError as e:
        print("closed", type(e).__name__, flush=True)
"""


def workload_yaml(pod: Pod, policies: tuple[str, ...] = ()) -> str:
    return f"""  - uid: {pod.uid}
    name: {pod.name}
    namespace: {pod.namespace}
    serviceAccount: {pod.service_account}
    trustDomain: {TD}
    workloadIps: ["{pod.ip}"]
    protocol: HBONE
    authorizationPolicies: [{", ".join(policies)}]
"""


def mesh_yaml(pods: list[Pod], *, allow_to: Pod | None = None, allowed: Pod | None = None) -> str:
    policy = f"{allow_to.namespace}/only-allowed" if allow_to is not None else ""
    text = "workloads:\n" + "".join(
        workload_yaml(p, (policy,) if p is allow_to else ()) for p in pods if p.enrolled
    )
    if allow_to is not None and allowed is not None:
        text += f"""policies:
  - name: only-allowed
    namespace: {allow_to.namespace}
    scope: WorkloadSelector
    action: Allow
    dryRun: false
    rules:
      - - - principals: [!Exact "{TD}/ns/{allowed.namespace}/sa/{allowed.service_account}"]
"""
    return text


def ztunnel_env(
    node: Node, xds: str, ports: tuple[int, int, int] = (15000, 15020, 15021), **extra: str
) -> dict[str, str]:
    """`ztunnel proxy` in shared mode for a node: its agent's socket, `xds`, the fake CA, two workers;
    `ports`: admin, metrics, readiness (in the node's namespace)."""
    env = {
        "PROXY_MODE": "shared",
        "INPOD_UDS": str(node.zds_socket),
        "XDS_ADDRESS": xds,
        "FAKE_CA": "true",
        "CONNECTION_TERMINATION_DEADLINE": "2s",
        "LOG_LEVEL": "info,access=info",
        "ZTUNNEL_WORKER_THREADS": "2",
        "ADMIN_ADDRESS": f"127.0.0.1:{ports[0]}",
        "STATS_ADDRESS": f"0.0.0.0:{ports[1]}",
        "READINESS_ADDRESS": f"0.0.0.0:{ports[2]}",
    }
    env.update(extra)
    return env


def access_log(zt: Proxy, *, src: str, direction: str, dst: str = "", error: str = "") -> list[str]:
    """The access-log lines of connections from `src` (an IP), in one direction (and, if given, to
    `dst` and with `error` in their error field), logged so far."""
    lines = []
    for line in zt.log().splitlines():
        if '"connection complete"' not in line or f"src.addr={src}:" not in line:
            continue
        if f'direction="{direction}"' not in line or (dst and f"dst.addr={dst} " not in line):
            continue
        if error and not re.search(r'error="[^"]*' + re.escape(error), line):
            continue
        lines.append(line)
    return lines


def logged(zt: Proxy, *, src: str, direction: str, dst: str = "", error: str = "") -> list[str]:
    """`access_log`, waiting for a line: a connection is logged once its relay is over, which can be
    after its client has seen the end of it."""
    found: list[str] = []

    def check() -> bool:
        found[:] = access_log(zt, src=src, direction=direction, dst=dst, error=error)
        return bool(found)

    eventually(check, f"an access-log line of {src} ({direction}, dst {dst or 'any'}, error {error!r})")
    return found


def listening_ports(pod: Pod) -> set[int]:
    out = pod.exec("ss", "-Hltn").stdout
    return {int(line.split()[3].rsplit(":", 1)[1]) for line in out.splitlines() if line.strip()}


PROXY_PORTS = {15001, 15006, 15008}


def listeners_per_port(pod: Pod, ports: set[int]) -> dict[int, int]:
    out = pod.exec("ss", "-Hltn").stdout
    found = [int(line.split()[3].rsplit(":", 1)[1]) for line in out.splitlines() if line.strip()]
    return {port: found.count(port) for port in ports}


def start_echo(pod: Pod, app: str = ECHO_APP) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        ["ip", "netns", "exec", pod.netns.name, sys.executable, "-c", app],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"listening"
    return proc


def talk(src: Pod, dst: Pod, payload: str, port: int = 8080) -> str:
    """What `src`'s app got back from `dst`'s echo app, as `echo <bytes>` (or an error line)."""
    done = src.exec(sys.executable, "-c", CLIENT_APP, dst.ip, str(port), payload, check=False, timeout=20)
    return (done.stdout + done.stderr).strip()


@dataclass
class Mesh:
    cluster: Cluster
    fleet: Fleet
    control_plane: ControlPlane
    xds: str
    apps: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def push(self, text: str) -> None:
        self.control_plane.push(text)

    def ztunnel(
        self,
        node: Node,
        xds: str,
        *,
        ports: tuple[int, int, int] = (15000, 15020, 15021),
        wrap: list[str] | None = None,
        **extra: str,
    ) -> Proxy:
        """A ztunnel of this mesh in `node`'s namespace (not started)."""
        return self.fleet.proxy(ztunnel_env(node, xds, ports, **extra), netns=node.ns.name, wrap=wrap or ())

    def wait_for_workloads(self, zt: Proxy, pods: list[Pod]) -> None:
        want = {p.uid for p in pods if p.enrolled}

        def have() -> bool:
            return want <= {w.get("uid") for w in zt.config_dump().get("workloads", [])}

        eventually(have, f"workloads {sorted(want)} in {zt.netns}'s {zt.name}")


@pytest.fixture(name="mesh")
def mesh_fixture(tmp_path: Path, fleet: Fleet) -> Iterator[Mesh]:
    require_root("ip", "iptables", "nsenter", "ss", "curl")
    require_tools("/usr/lib/cni/bridge", "/usr/lib/cni/host-local", hint="containernetworking-plugins")
    cluster = Cluster(tmp_path)
    m: Mesh | None = None
    try:
        node1 = cluster.node()
        # The control plane runs in the first node (its ztunnel reaches it on loopback, others over the link).
        cp = fleet.control_plane(
            tmp_path / "cp", "0.0.0.0", "workloads: []\n", port=15012, netns=node1.ns.name
        )
        m = Mesh(cluster, fleet, cp, "http://127.0.0.1:15012")
        yield m
    finally:
        for app in m.apps if m is not None else []:
            app.kill()
            app.wait()
        fleet.close()  # before the namespaces go
        cluster.close()


def start_node(m: Mesh, node: Node, xds: str, **extra: str) -> Proxy:
    node.start_agent()
    zt = m.ztunnel(node, xds, **extra)
    zt.start()
    return zt


def opened(metrics: str, **labels: str) -> int:
    """Sum of istio_tcp_connections_opened_total over the series carrying all these labels."""
    total = 0
    for line in metrics.splitlines():
        if not line.startswith("istio_tcp_connections_opened_total{"):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += int(float(line.rsplit(" ", 1)[1]))
    return total


# argv: ip port n. Holds n connections; on each line of stdin, sends one byte on every one still
# open and prints a letter per connection: y (echoed) or x (closed, now or before).
HOLDER_APP = """
import socket, sys
ip, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
conns = [socket.create_connection((ip, port), timeout=5) for _ in range(n)]
print("open", flush=True)
for _ in sys.stdin:
    states = []
    for i, c in enumerate(conns):
        ok = False
        if c is not None:
            try:
                c.sendall(b"p")
                ok = c.recv(1) == b"p"
            except OSError:
                pass
            if not ok:
                c.close()
                conns[i] = None
        states.append("y" if ok else "x")
    print("".join(states), flush=True)
"""


@dataclass
class Holder:
    proc: subprocess.Popen[str]

    def ping(self) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("ping\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()


def hold(mesh: Mesh, src: Pod, dst: Pod, n: int) -> Holder:
    proc = subprocess.Popen(
        ["ip", "netns", "exec", src.netns.name, sys.executable, "-c", HOLDER_APP, dst.ip, "8080", str(n)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    mesh.apps.append(proc)  # type: ignore[arg-type]
    assert proc.stdout is not None and proc.stdout.readline().strip() == "open"
    holder = Holder(proc)
    assert holder.ping() == "y" * n
    return holder


def per_worker(zt: Proxy, key: str) -> list[int]:
    return [w[key] for w in zt.worker_entries()]
