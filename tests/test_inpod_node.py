"""In-pod mode end to end (root): nodes built from network namespaces, as a cluster would run them.

Each node runs `ztunnel cni-agent` and `ztunnel proxy` (PROXY_MODE=shared) inside its namespace. The
test is the container runtime: pods get their network from Debian's `bridge` + `host-local` plugins
chained with `ztunnel-cni` (tests/cninode.py). The development control plane plays istiod: once the
pods have IPs, the test writes them into its file and it pushes them to every ztunnel over xDS. Apps
in the pods connect to each other's IPs with no proxy settings; the pods' own redirection rules
capture the bytes, and the pods' proxy instances carry them over HBONE.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.cninode import Cluster, Node, Pod, join
from tests.netns import require_root, require_tools
from tests.waiting import eventually

pytestmark = pytest.mark.timeout(120)

ZTUNNEL = str(Path(sys.executable).parent / "ztunnel")
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


@dataclass
class Ztunnel:
    """`ztunnel proxy` in shared mode inside a node's namespace."""

    node: Node
    xds: str
    name: str = "ztunnel"
    ports: tuple[int, int, int] = (15000, 15020, 15021)  # admin, metrics, readiness (in the node)
    extra: dict[str, str] = field(default_factory=dict)
    log: Path = field(init=False)
    proc: subprocess.Popen[bytes] | None = None

    def __post_init__(self) -> None:
        self.log = self.node.dir / f"{self.name}.log"

    def start(self) -> None:
        env = dict(os.environ)
        env.update(
            PROXY_MODE="shared",
            INPOD_UDS=str(self.node.zds_socket),
            XDS_ADDRESS=self.xds,
            FAKE_CA="true",
            CONNECTION_TERMINATION_DEADLINE="2s",
            LOG_LEVEL="info,access=info",
            ZTUNNEL_WORKER_THREADS="2",
            ADMIN_ADDRESS=f"127.0.0.1:{self.ports[0]}",
            STATS_ADDRESS=f"0.0.0.0:{self.ports[1]}",
            READINESS_ADDRESS=f"0.0.0.0:{self.ports[2]}",
        )
        env.update(self.extra)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                ["ip", "netns", "exec", self.node.ns.name, ZTUNNEL, "proxy"],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def stop(self, sig: int = signal.SIGTERM) -> int | None:
        code = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            code = self.proc.wait(timeout=15)
        self.proc = None
        return code

    def get(self, port: int, path: str) -> tuple[int, str]:
        out = self.node.ns.exec(
            "curl", "-s", "-m", "3", "-w", "\n%{http_code}", f"http://127.0.0.1:{port}{path}", check=False
        ).stdout.decode()
        body, _, code = out.rpartition("\n")
        return int(code or 0), body

    def config_dump(self) -> dict:  # type: ignore[type-arg]
        code, body = self.get(self.ports[0], "/config_dump")
        return json.loads(body) if code == 200 else {}

    def metrics(self) -> str:
        return self.get(self.ports[1], "/metrics")[1]

    def ready(self) -> bool:
        return self.get(self.ports[2], "/healthz/ready")[0] == 200

    def workers(self) -> list[dict]:  # type: ignore[type-arg]
        return list(self.config_dump().get("workers", []))

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def access_log(zt: Ztunnel, *, src: str, direction: str, dst: str = "", error: str = "") -> list[str]:
    """The access-log lines of connections from `src` (an IP), in one direction (and, if given, to
    `dst` and with `error` in their error field), logged so far."""
    lines = []
    for line in zt.output().splitlines():
        if '"connection complete"' not in line or f"src.addr={src}:" not in line:
            continue
        if f'direction="{direction}"' not in line or (dst and f"dst.addr={dst} " not in line):
            continue
        if error and not re.search(r'error="[^"]*' + re.escape(error), line):
            continue
        lines.append(line)
    return lines


def logged(zt: Ztunnel, *, src: str, direction: str, dst: str = "", error: str = "") -> list[str]:
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
    config: Path
    control_plane: subprocess.Popen[str]
    xds: str
    cp_log: list[str] = field(default_factory=list)
    ztunnels: dict[str, Ztunnel] = field(default_factory=dict)
    apps: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def push(self, text: str) -> None:
        self.config.write_text(text)

    def wait_for_workloads(self, zt: Ztunnel, pods: list[Pod]) -> None:
        want = {p.uid for p in pods if p.enrolled}

        def have() -> bool:
            return want <= {w.get("uid") for w in zt.config_dump().get("workloads", [])}

        eventually(have, f"workloads {sorted(want)} in {zt.node.ns.name}'s ztunnel")


@pytest.fixture
def mesh(tmp_path: Path) -> Iterator[Mesh]:
    require_root("ip", "iptables", "nsenter", "ss", "curl")
    require_tools("/usr/lib/cni/bridge", "/usr/lib/cni/host-local", hint="containernetworking-plugins")
    cluster = Cluster(tmp_path)
    config = tmp_path / "mesh.yaml"
    config.write_text("workloads: []\n")
    node1 = cluster.node()
    # The control plane runs in the first node (its ztunnel reaches it on loopback, others over the link).
    cp = subprocess.Popen(
        ["ip", "netns", "exec", node1.ns.name, ZTUNNEL, "control-plane", "--config", str(config),
         "--listen", "0.0.0.0:15012", "--ca-dir", str(tmp_path / "ca")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    m = Mesh(cluster, config, cp, "http://127.0.0.1:15012")
    try:
        assert cp.stdout is not None
        seen: list[str] = []
        while not any("root certificate:" in line for line in seen):
            line = cp.stdout.readline()
            assert line, "control plane exited: " + "".join(seen)
            seen.append(line)
        m.cp_log.extend(seen)
        # Never let its pipe fill; what it logs counts the xDS streams and the certificates issued.
        threading.Thread(target=lambda: m.cp_log.extend(iter(cp.stdout.readline, "")), daemon=True).start()
        yield m
    finally:
        for app in m.apps:
            app.kill()
            app.wait()
        for zt in m.ztunnels.values():
            zt.stop(signal.SIGKILL)
            if zt.log.exists():  # shown by pytest when the test failed
                sys.stdout.write(f"--- {zt.node.ns.name} {zt.name} log (tail) ---\n{zt.output()[-3000:]}\n")
        cp.kill()
        cp.wait()
        cluster.close()


def start_node(m: Mesh, node: Node, xds: str, **extra: str) -> Ztunnel:
    node.start_agent()
    zt = Ztunnel(node, xds, extra=extra)
    zt.start()
    m.ztunnels[f"{node.ns.name}/{zt.name}"] = zt
    eventually(zt.ready, "ztunnel readiness")
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


def test_one_node_captures_pod_traffic_over_hbone_with_policy(mesh: Mesh) -> None:
    node = mesh.cluster.nodes[0]
    zt = start_node(mesh, node, mesh.xds)
    client = node.add_pod("client", service_account="client")
    intruder = node.add_pod("intruder", service_account="intruder")
    server = node.add_pod("server", service_account="server")
    plain = node.add_pod("plain", enrolled=False)
    pods = [client, intruder, server, plain]
    # Each enrolled pod's listeners are open inside its namespace before its ADD returned.
    for pod in (client, intruder, server):
        assert listening_ports(pod) >= PROXY_PORTS, pod.name
        # One listening socket per port and worker, SO_REUSEPORT among them.
        assert listeners_per_port(pod, PROXY_PORTS) == {port: 2 for port in PROXY_PORTS}, pod.name
    assert not PROXY_PORTS & listening_ports(plain)
    assert "ZTUNNEL" in client.iptables_save() and "ZTUNNEL" not in plain.iptables_save()

    mesh.push(mesh_yaml(pods, allow_to=server, allowed=client))
    mesh.wait_for_workloads(zt, pods)
    mesh.apps += [start_echo(server), start_echo(plain)]

    # Allowed: captured in the client pod, over HBONE, with both identities.
    assert talk(client, server, "hello-server") == "echo hello-server"
    metrics = zt.metrics()
    assert (
        opened(
            metrics,
            reporter="destination",
            source_principal=f"spiffe://{TD}/ns/default/sa/client",
            destination_principal=f"spiffe://{TD}/ns/default/sa/server",
            connection_security_policy="mutual_tls",
        )
        == 1
    ), metrics
    assert opened(metrics, reporter="source", source_workload="client", destination_workload="server") == 1

    # Denied: the intruder's bytes never reach the server app.
    assert talk(intruder, server, "let-me-in") == "echo"
    assert logged(zt, src=intruder.ip, direction="inbound", error="allow policies exist, but none allowed")

    # The pod that is not enrolled talks plaintext: to it, the client's proxy passes TCP through ...
    assert talk(client, plain, "hello-plain") == "echo hello-plain"
    passthrough = logged(zt, src=client.ip, dst=f"{plain.ip}:8080", direction="outbound")
    assert passthrough and "dst.identity" not in passthrough[0]
    # ... and from it, plaintext is captured on the server's 15006, where the policy (mTLS identity
    # required) refuses it.
    assert talk(plain, server, "plaintext") == "echo"
    assert logged(zt, src=plain.ip, direction="inbound", error="allow policies exist, but none allowed")

    # The apps see their clients' own addresses, over HBONE and over plaintext alike.
    mesh.apps += [start_echo(server, WHOAMI_APP), start_echo(client, WHOAMI_APP)]
    assert talk(client, server, "?", port=8081) == f"echo {client.ip}"
    assert talk(plain, client, "?", port=8081) == f"echo {plain.ip}"

    dump = zt.config_dump()["workloadState"]
    assert {dump[p.uid]["state"] for p in (client, intruder, server)} == {"Up"}
    assert plain.uid not in dump


def test_pod_delete_closes_its_listeners_and_connections(mesh: Mesh) -> None:
    node = mesh.cluster.nodes[0]
    zt = start_node(mesh, node, mesh.xds)
    client = node.add_pod("client", service_account="client")
    server = node.add_pod("server", service_account="server")
    mesh.push(mesh_yaml([client, server]))
    mesh.wait_for_workloads(zt, [client, server])
    mesh.apps.append(start_echo(server))

    held = subprocess.Popen(
        ["ip", "netns", "exec", client.netns.name, sys.executable, "-c", CLIENT_APP, server.ip, "8080", "ping", "hold"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    mesh.apps.append(held)  # type: ignore[arg-type]
    assert held.stdout is not None
    assert held.stdout.readline().strip() == "echo ping"

    results = node.cni_del(server)
    assert all(r.ok for r in results), [str(r) for r in results]
    # The server pod's proxy is gone from its namespace, and the open connection was closed.
    assert not PROXY_PORTS & listening_ports(server)
    # Closed by ztunnel (FIN or RST), not the client's own 8 s timeout ("closed TimeoutError").
    line = held.stdout.readline().strip()
    assert line.startswith("closed") and line in ("closed", "closed ConnectionResetError"), line
    assert server.uid not in zt.config_dump()["workloadState"]
    assert "workload_manager_proxies_stopped_total 1" in zt.metrics()
    server.netns.delete()
    node.pods.remove(server)


def test_ztunnel_restart_restores_pods_from_the_snapshot(mesh: Mesh) -> None:
    node = mesh.cluster.nodes[0]
    zt = start_node(mesh, node, mesh.xds)
    client = node.add_pod("client", service_account="client")
    server = node.add_pod("server", service_account="server")
    gone = node.add_pod("gone", service_account="gone")
    mesh.push(mesh_yaml([client, server, gone]))
    mesh.wait_for_workloads(zt, [client, server])
    mesh.apps.append(start_echo(server))
    assert talk(client, server, "before") == "echo before"

    zt.stop(signal.SIGKILL)
    # Its data-plane workers follow the parent (death signal through the fork server) a moment later.
    for pod in (client, server, gone):
        eventually(
            lambda p=pod: not PROXY_PORTS & listening_ports(p), f"{pod.name}'s listeners closed", timeout=5
        )  # type: ignore[misc]
        assert not PROXY_PORTS & listening_ports(pod)
    # Deleted while ztunnel is down: DEL still succeeds, and the pod is not restored later.
    assert all(r.ok for r in node.del_pod(gone))

    zt.start()
    eventually(zt.ready, "ztunnel readiness after restart")
    for pod in (client, server):
        assert listening_ports(pod) >= PROXY_PORTS, pod.name
    state = zt.config_dump()["workloadState"]
    assert set(state) == {client.uid, server.uid}
    mesh.wait_for_workloads(zt, [client, server])
    assert talk(client, server, "after") == "echo after"


def test_two_nodes_cross_node_hbone(mesh: Mesh) -> None:
    node1 = mesh.cluster.nodes[0]
    node2 = mesh.cluster.node()
    node1_link, _ = join(node1, node2)
    zt1 = start_node(mesh, node1, mesh.xds)
    zt2 = start_node(mesh, node2, f"http://{node1_link}:15012")
    client = node1.add_pod("client", service_account="client")
    server = node2.add_pod("server", service_account="server")
    intruder = node1.add_pod("intruder", service_account="intruder")
    pods = [client, server, intruder]
    mesh.push(mesh_yaml(pods, allow_to=server, allowed=client))
    for zt in (zt1, zt2):
        mesh.wait_for_workloads(zt, pods)
    mesh.apps.append(start_echo(server))

    assert talk(client, server, "across") == "echo across"
    assert talk(intruder, server, "across") == "echo"
    assert (
        opened(
            zt2.metrics(),
            reporter="destination",
            source_principal=f"spiffe://{TD}/ns/default/sa/client",
            destination_principal=f"spiffe://{TD}/ns/default/sa/server",
        )
        == 1
    )
    assert (
        opened(zt1.metrics(), reporter="source", source_workload="client", destination_workload="server") == 1
    )
    # Each ztunnel runs proxies for its own node's pods only.
    assert server.uid not in zt1.config_dump()["workloadState"]


def test_upgrade_a_new_ztunnel_takes_over_without_dropping_pods(mesh: Mesh) -> None:
    node = mesh.cluster.nodes[0]
    old = start_node(mesh, node, mesh.xds)
    client = node.add_pod("client", service_account="client")
    server = node.add_pod("server", service_account="server")
    mesh.push(mesh_yaml([client, server]))
    mesh.wait_for_workloads(old, [client, server])
    mesh.apps.append(start_echo(server))
    assert talk(client, server, "v1") == "echo v1"

    # The new version starts beside the old one: the agent's snapshot gives it every pod, whose
    # listeners it binds next to the old ones (SO_REUSEPORT), then the old one drains and exits.
    new = Ztunnel(node, mesh.xds, name="ztunnel-new", ports=(25000, 25020, 25021))
    new.start()
    mesh.ztunnels["new"] = new
    eventually(new.ready, "the new ztunnel's readiness")
    assert set(new.config_dump()["workloadState"]) == {client.uid, server.uid}
    mesh.wait_for_workloads(new, [client, server])
    assert old.stop(signal.SIGTERM) == 0
    assert talk(client, server, "v2") == "echo v2"
    assert opened(new.metrics(), reporter="destination", destination_workload="server") == 1

    # New pods go to the newest ztunnel.
    late = node.add_pod("late", service_account="late")
    assert late.uid in new.config_dump()["workloadState"]
    assert listening_ports(late) >= PROXY_PORTS


HTTP_GET = """
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=8)
s.sendall(f"GET {sys.argv[3]} HTTP/1.0\\r\\nHost: x\\r\\n\\r\\n".encode())
body = b""
while chunk := s.recv(65536):
    body += chunk
print(body.decode(errors="replace"))
"""


def test_ztunnel_own_metrics_reached_from_a_pod_over_hbone(mesh: Mesh) -> None:
    # With POD_NAME, POD_NAMESPACE and SERVICE_ACCOUNT, ztunnel also listens for HBONE in its own
    # namespace, as its own workload: a pod's request to it is captured and carried over HBONE.
    node = mesh.cluster.nodes[0]
    zt = start_node(
        mesh, node, mesh.xds, POD_NAME="ztunnel-node", POD_NAMESPACE="istio-system", SERVICE_ACCOUNT="ztunnel"
    )
    out = node.ns.exec("ss", "-Hltn").stdout.decode()
    node_ports = {int(line.split()[3].rsplit(":", 1)[1]) for line in out.splitlines() if line.strip()}
    assert 15008 in node_ports and not {15001, 15006} & node_ports  # HBONE only, in the node's namespace
    client = node.add_pod("client", service_account="client")
    mesh.push(
        mesh_yaml([client])
        + f"""  - uid: istio-system/ztunnel-node
    name: ztunnel-node
    namespace: istio-system
    serviceAccount: ztunnel
    workloadIps: ["{node.gateway}"]
    protocol: HBONE
"""
    )
    mesh.wait_for_workloads(zt, [client])
    eventually(
        lambda: "istio-system/ztunnel-node" in {w.get("uid") for w in zt.config_dump()["workloads"]},
        "ztunnel's workload",
    )
    done = client.exec(sys.executable, "-c", HTTP_GET, node.gateway, "15020", "/metrics", timeout=20)
    assert "200 OK" in done.stdout and "istio_build" in done.stdout, done.stdout
    assert (
        opened(
            zt.metrics(),
            reporter="destination",
            destination_workload="ztunnel-node",
            source_principal=f"spiffe://{TD}/ns/default/sa/client",
            connection_security_policy="mutual_tls",
        )
        == 1
    )


# -- two data-plane workers -------------------------------------------------------------------------

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


def per_worker(zt: Ztunnel, key: str) -> list[int]:
    return [w[key] for w in zt.workers()]


def test_two_workers_one_xds_stream_one_certificate_per_identity_both_serving(mesh: Mesh) -> None:
    node = mesh.cluster.nodes[0]
    # Certificates from the control plane's CA this time, so it counts the requests.
    zt = start_node(mesh, node, mesh.xds, FAKE_CA="false", CA_ADDRESS=mesh.xds)
    assert len({w["pid"] for w in zt.workers()}) == 2
    client = node.add_pod("client", service_account="client")
    server = node.add_pod("server", service_account="server")
    mesh.push(mesh_yaml([client, server]))
    mesh.wait_for_workloads(zt, [client, server])
    mesh.apps.append(start_echo(server))
    n = 24
    for i in range(n):
        assert talk(client, server, f"hello-{i}") == f"echo hello-{i}"
    # The client pod's connections were spread over both workers' listeners in its namespace.
    eventually(lambda: sum(per_worker(zt, "outboundOpened")) == n, "the outbound connections counted")
    assert all(c > 0 for c in per_worker(zt, "outboundOpened")), zt.workers()
    assert opened(zt.metrics(), reporter="destination", destination_workload="server") == n
    log = "".join(mesh.cp_log)
    assert len(re.findall(r"stream from \S+ \(peer .*\) opened", log)) == 1, log
    for sa in ("client", "server"):
        assert log.count(f"issued a certificate for spiffe://{TD}/ns/default/sa/{sa} ") == 1, log
    certs = {c["identity"]: c["state"] for c in zt.config_dump()["certificates"]}
    assert certs == {f"spiffe://{TD}/ns/default/sa/{sa}": "Available" for sa in ("client", "server")}


def test_two_workers_a_policy_push_closes_held_connections_in_every_worker(mesh: Mesh) -> None:
    node = mesh.cluster.nodes[0]
    # One stream per pooled HBONE connection: the server pod's inbound spreads over both workers.
    zt = start_node(mesh, node, mesh.xds, POOL_MAX_STREAMS_PER_CONNECTION="1")
    client = node.add_pod("client", service_account="client")
    server = node.add_pod("server", service_account="server")
    mesh.push(mesh_yaml([client, server]))
    mesh.wait_for_workloads(zt, [client, server])
    mesh.apps.append(start_echo(server))
    n = 12
    holder = hold(mesh, client, server, n)
    eventually(lambda: sum(per_worker(zt, "inboundOpened")) == n, "the inbound connections counted")
    assert all(c > 0 for c in per_worker(zt, "inboundOpened")), zt.workers()
    # workloadState lists the server pod's held connections, gathered from both workers.
    held = zt.config_dump()["workloadState"][server.uid]["connections"]["inbound"]
    assert len(held) == n and {c["src"].rpartition(":")[0] for c in held} == {client.ip}, held
    # As the reference: the service the client addressed (none: it dialled the pod) and HBONE.
    assert {(c["originalDst"], c["actualDst"], c["protocol"]) for c in held} == {
        (None, f"{server.ip}:8080", "HBONE")
    }, held

    other = node.add_pod("other", service_account="other")
    mesh.push(mesh_yaml([client, server, other], allow_to=server, allowed=other))
    eventually(lambda: holder.ping() == "x" * n, "every held connection closed by the policy")
    eventually(
        lambda: len(access_log(zt, src=client.ip, direction="inbound", error="policy change")) == n,
        "every closure logged",
    )


def test_two_workers_a_killed_worker_is_replaced_while_the_other_keeps_echoing(mesh: Mesh) -> None:
    node = mesh.cluster.nodes[0]
    zt = start_node(mesh, node, mesh.xds)
    client = node.add_pod("client", service_account="client")
    plain = node.add_pod("plain", enrolled=False)  # passed through: only the client's worker carries it
    mesh.push(mesh_yaml([client, plain]))
    mesh.wait_for_workloads(zt, [client])
    mesh.apps.append(start_echo(plain))
    n = 12
    holder = hold(mesh, client, plain, n)
    eventually(lambda: sum(per_worker(zt, "outboundOpened")) == n, "the held connections counted")
    counts = per_worker(zt, "outboundOpened")
    assert all(c > 0 for c in counts), counts
    victim = zt.workers()[0]
    os.kill(victim["pid"], signal.SIGKILL)

    statuses: list[int] = []

    def replaced() -> bool:
        statuses.append(zt.get(zt.ports[2], "/healthz/ready")[0])
        w = zt.workers()[0]
        return bool(w["pid"] != victim["pid"] and w["state"] == "ready")

    eventually(lambda: zt.get(zt.ports[2], "/healthz/ready")[0] == 500, "readiness down")
    # The other worker's connections keep echoing; new connections are served meanwhile.
    assert holder.ping().count("y") == counts[1]
    assert talk(client, plain, "meanwhile") == "echo meanwhile"
    eventually(replaced, "the worker to be replaced", timeout=20)
    assert statuses[:-1] and set(statuses[:-1]) == {500}, statuses
    assert zt.ready()
    # The replacement has every pod's listeners again (both sockets per port), and serves.
    assert listeners_per_port(client, PROXY_PORTS) == {port: 2 for port in PROXY_PORTS}
    assert holder.ping().count("y") == counts[1]
    before = per_worker(zt, "outboundOpened")[0]
    for i in range(12):
        assert talk(client, plain, f"after-{i}") == f"echo after-{i}"
    eventually(lambda: per_worker(zt, "outboundOpened")[0] > before, "the new worker serving")


def test_two_workers_a_pod_is_acked_only_once_every_worker_listens(mesh: Mesh) -> None:
    node = mesh.cluster.nodes[0]
    zt = start_node(mesh, node, mesh.xds)
    stuck = zt.workers()[1]
    os.kill(stuck["pid"], signal.SIGSTOP)  # alive, but it cannot open the pod's listeners
    try:
        result, pod = node.try_add_pod("slow", service_account="slow")
        # NACKed within the agent's deadline, so the ADD fails with ztunnel's reason.
        assert not result.ok and "worker 1: no answer in time" in str(result), str(result)
    finally:
        os.kill(stuck["pid"], signal.SIGCONT)
    # Undone in every worker (the one that did open them, and the late one once it runs again).
    eventually(lambda: not PROXY_PORTS & listening_ports(pod), "the half-started listeners gone")
    # The runtime cleans up and tries again: now both workers listen before the ACK.
    node.cni_del(pod)
    assert node.cni_add(pod).ok
    assert listeners_per_port(pod, PROXY_PORTS) == {port: 2 for port in PROXY_PORTS}
    assert zt.config_dump()["workloadState"][pod.uid]["state"] == "Up"
    assert zt.workers()[1]["pid"] == stuck["pid"]  # not replaced: it answers again
