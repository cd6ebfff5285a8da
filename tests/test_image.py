"""The node image, built and run for real (root): `make image`, then the container as Istio's
ztunnel chart starts it.

The image runs with `buildah run --isolation chroot` inside a network namespace made by the test (the
node), so its listeners never meet the host's. In the node: the development control plane plays
istiod, with TLS and a checked bearer token and cluster id, under the chart's own address
`istiod.istio-system.svc:15012`; the node agent runs from the image too (installing the plugin into
a CNI conf directory like the node's); ztunnel gets exactly the chart's arguments, environment,
capabilities, user and mounts (token, root, ZDS directory, an empty /tmp), once as it is and once on
a read-only root file system. It must become ready on `:15021/healthz/ready` and carry a connection:
an HBONE client with a certificate from the same CA connects to ztunnel's own workload and reaches
an HTTP server in the node through it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from hbone.build import HOT_PATH
from tests.harness import ControlPlane, Process
from tests.netns import Netns, cannot_run, require_root
from tests.waiting import eventually

pytestmark = [pytest.mark.root, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parent.parent
# The image `make image` tags by default; kept after the test, so its layers cache the next build.
IMAGE = "localhost/ztunnel-py:latest"
NODE_IP = "10.244.0.5"
CLIENT_IP = "10.244.0.6"
ISTIOD = "istiod.istio-system.svc"
CLUSTER = "cluster-east"
POD = "ztunnel-x7k2p"
HTTP_PORT = 8080

# What Istio's ztunnel chart sets (values as a default install renders them, ids made up).
CHART_ENV = {
    "CA_ADDRESS": f"{ISTIOD}:15012",
    "XDS_ADDRESS": f"{ISTIOD}:15012",
    "RUST_LOG": "info",
    "RUST_BACKTRACE": "1",
    "ISTIO_META_CLUSTER_ID": CLUSTER,
    "INPOD_ENABLED": "true",
    "TERMINATION_GRACE_PERIOD_SECONDS": "30",
    "POD_NAME": POD,
    "POD_NAMESPACE": "istio-system",
    "NODE_NAME": "node-1",
    "INSTANCE_IP": NODE_IP,
    "SERVICE_ACCOUNT": "ztunnel",
    "ZTUNNEL_CPU_LIMIT": "0",
    "ISTIO_META_ENABLE_HBONE": "true",
}
# The chart's mounts are under /var/run, which in Debian is a link to /run; buildah's chroot isolation
# does not follow a link in a mount's destination, so the test mounts where the link leads.
RUN = "/run"
CHART_CAPS = ("CAP_NET_ADMIN", "CAP_SYS_ADMIN", "CAP_NET_RAW")
BUILDAH_DEFAULT_CAPS = (
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_NET_BIND_SERVICE",
    "CAP_SETFCAP",
    "CAP_SETGID",
    "CAP_SETPCAP",
    "CAP_SETUID",
    "CAP_SYS_CHROOT",
)

MESH = f"""workloads:
  - uid: {CLUSTER}//Pod/istio-system/{POD}
    name: {POD}
    namespace: istio-system
    serviceAccount: ztunnel
    node: node-1
    workloadIps: ["{NODE_IP}"]
    protocol: HBONE
  - uid: {CLUSTER}//Pod/default/client
    name: client
    namespace: default
    serviceAccount: client
    node: node-2
    workloadIps: ["{CLIENT_IP}"]
    protocol: HBONE
"""

# argv: CA address, root, token, cluster, source ip, ztunnel ip, authority. Gets a certificate for
# default/client from the CA, opens HBONE to ztunnel, CONNECTs and sends an HTTP GET; prints the reply.
HBONE_CLIENT = """
import asyncio, socket, sys
from hbone.client import HboneConnection
from hbone.identity import Identity
from hbone.settings import H2Settings
from hbone.tls import TlsCredentials
from xds.channel import AuthToken
from ztunnel.identity.caclient import GrpcCaClient

class Collect(asyncio.Protocol):
    def __init__(self):
        self.data, self.done = b"", asyncio.get_running_loop().create_future()
    def data_received(self, data):
        self.data += data
    def eof_received(self):
        self.done.done() or self.done.set_result(None)
    def connection_lost(self, exc):
        self.done.done() or self.done.set_result(None)

async def main(ca, root, token, cluster, src, dst, authority):
    client = GrpcCaClient(ca, root_ca=root, token=AuthToken(path=token), cluster_id=cluster)
    cert = await client.fetch(Identity.parse("spiffe://cluster.local/ns/default/sa/client"))
    await client.close()
    sock = socket.socket()
    sock.setblocking(False)
    sock.bind((src, 0))
    await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, (dst, 15008)), 10)
    expected = [Identity.parse("spiffe://cluster.local/ns/istio-system/sa/ztunnel")]
    conn = await HboneConnection.open(sock, TlsCredentials.build(cert), expected, H2Settings())
    stream = await asyncio.wait_for(conn.connect(authority), 10)
    sink = Collect()
    stream.set_protocol(sink)
    stream.write(b"GET /hello.txt HTTP/1.0\\r\\nHost: web\\r\\n\\r\\n")
    stream.write_eof()
    await asyncio.wait_for(sink.done, 10)
    sys.stdout.write(sink.data.decode(errors="replace"))

asyncio.run(main(*sys.argv[1:]))
"""


def buildah(*args: str, timeout: float = 60) -> str:
    done = subprocess.run(["buildah", *args], capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, f"buildah {' '.join(args)}: {done.stderr}"
    return done.stdout.strip()


@pytest.fixture(scope="module")
def image() -> str:
    require_root("buildah", "debootstrap", "ip", "curl")
    started = time.monotonic()
    done = subprocess.run(
        ["make", "-s", "image", f"IMAGE={IMAGE}"],
        cwd=REPO,
        env={**os.environ, "IMAGE": IMAGE},
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if done.returncode != 0:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"make image failed:\n{done.stderr[-4000:]}")
        cannot_run(f"make image failed (no Debian mirror?): {done.stderr.strip().splitlines()[-1:]}")
    print(f"make image took {time.monotonic() - started:.1f}s")
    return IMAGE


def test_the_image_holds_the_node_programs_and_nothing_of_the_tests(image: str) -> None:
    ctr = buildah("from", "--quiet", image)
    try:
        out = buildah(
            "run",
            "--isolation",
            "chroot",
            ctr,
            "--",
            "sh",
            "-c",
            "for t in ztunnel ztunnel-cni iptables nsenter ip; do command -v $t; done; ls /opt/ztunnel/lib/python3*/site-packages; "
            "ztunnel version",
        )
        config = json.loads(buildah("inspect", "--type", "image", image))["OCIv1"]["config"]
    finally:
        buildah("rm", ctr)
    lines = out.splitlines()
    assert lines[:5] == [
        "/opt/ztunnel/bin/ztunnel",
        "/opt/ztunnel/bin/ztunnel-cni",
        "/usr/sbin/iptables",
        "/usr/bin/nsenter",
        "/usr/sbin/ip",
    ]
    packages = set(lines[5:])
    assert {"ztunnel", "hbone", "xds", "mesh", "policy", "cni", "controlplane"} <= packages
    assert not {"tests", "benches"} & packages
    assert any(line.startswith("version.BuildInfo{") for line in lines)
    # The image runs the compiled hot path (its build stage had the compiler).
    assert f"build: compiled (mypyc, {len(HOT_PATH)} modules)" in lines
    assert config["Entrypoint"] == ["ztunnel"] and config.get("WorkingDir") == "/"


@dataclass
class Node:
    """The node's namespace, its files and the processes the test started in it."""

    dir: Path
    ns: Netns
    hosts_dir: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    containers: list[str] = field(default_factory=list)
    ztunnels: list[Process] = field(default_factory=list)  # run from this checkout, not the image

    def exec(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["ip", "netns", "exec", self.ns.name, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def start(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        with log.open("ab") as out:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", self.ns.name, *args],
                env=env or dict(os.environ),
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.procs.append(proc)
        return proc

    def run_image(
        self,
        image: str,
        log: Path,
        command: list[str],
        *,
        env: dict[str, str],
        volumes: list[str],
        caps: tuple[str, ...] = (),
        user: str = "0:0",
    ) -> subprocess.Popen[bytes]:
        ctr = buildah("from", "--quiet", image)
        self.containers.append(ctr)
        args = [
            "buildah",
            "run",
            "--isolation",
            "chroot",
            "--user",
            user,
            "--mount",
            "type=tmpfs,destination=/tmp",
        ]
        if caps:
            # `drop: [ALL]` then `add: caps`; buildah's `--cap-drop all` would win over the adds.
            args += [a for c in BUILDAH_DEFAULT_CAPS if c not in caps for a in ("--cap-drop", c)]
            args += [a for c in caps for a in ("--cap-add", c)]
        for name, value in env.items():
            args += ["--env", f"{name}={value}"]
        for volume in volumes:
            args += ["--volume", volume]
        return self.start([*args, ctr, "--", *command], log)

    def stop(self, proc: subprocess.Popen[bytes]) -> int:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        return proc.returncode

    def close(self) -> None:
        for proc in reversed(self.procs):
            self.stop(proc)
        for process in self.ztunnels:
            process.stop()
        for ctr in self.containers:
            subprocess.run(["buildah", "rm", ctr], capture_output=True, timeout=60, check=False)
        self.ns.delete()
        shutil.rmtree(self.hosts_dir, ignore_errors=True)


@pytest.fixture
def node(image: str, tmp_path: Path) -> Iterator[Node]:
    ns = Netns("imgnode")
    # `ip netns exec` puts /etc/netns/<name>/hosts over /etc/hosts: istiod's name resolves in the node.
    hosts_dir = Path("/etc/netns") / ns.name
    hosts_dir.mkdir(parents=True, exist_ok=True)
    (hosts_dir / "hosts").write_text(f"127.0.0.1 localhost\n{NODE_IP} {ISTIOD}\n")
    node = Node(tmp_path, ns, hosts_dir)
    try:
        # The node's address, and a client's beside it (its replies then stay in the node).
        ns.exec("ip", "addr", "add", f"{NODE_IP}/32", "dev", "lo")
        ns.exec("ip", "addr", "add", f"{CLIENT_IP}/32", "dev", "lo")
        yield node
    finally:
        node.close()


@dataclass
class Mesh:
    node: Node
    token: Path
    root: Path
    zds_dir: Path
    conf_dir: Path
    control_plane_log: Path


@pytest.fixture
def mesh(node: Node, image: str) -> Mesh:
    token, root, cp_log = start_control_plane(node)
    start_web_server(node)
    zds_dir, conf_dir = start_node_agent(node, image)
    return Mesh(node, token, root, zds_dir, conf_dir, cp_log)


def start_control_plane(node: Node) -> tuple[Path, Path, Path]:
    """The control plane with TLS, its CA and token auth: the token, the root and the log it writes."""
    d = node.dir
    token = d / "istio-token"
    token.write_text(f"header.{uuid.uuid4().hex}.signature\n")  # opaque to us, as a projected JWT is
    args = ("--tls", "--auth-token", str(token), "--cluster-id", CLUSTER)
    cp = ControlPlane(d, f"{ISTIOD}:15012", MESH, *args, netns=node.ns.name)
    node.ztunnels.append(cp)
    cp.start()
    assert "control plane listening" in cp.log()
    return token, d / "ca" / "root-cert.pem", cp.log_path


def start_web_server(node: Node) -> None:
    d = node.dir
    www = d / "www"
    www.mkdir()
    (www / "hello.txt").write_text("hello through the mesh\n")
    node.start(
        [sys.executable, "-m", "http.server", str(HTTP_PORT), "--bind", NODE_IP, "--directory", str(www)],
        d / "http.log",
    )
    eventually(
        lambda: node.exec("curl", "-sf", f"http://{NODE_IP}:{HTTP_PORT}/hello.txt").returncode == 0,
        "the web server",
    )


def start_node_agent(node: Node, image: str) -> tuple[Path, Path]:
    """The node agent from the image, read-only root, chaining its plugin: the ZDS and CNI conf dirs."""
    d = node.dir
    # The node agent's container, as deploy/ runs it: the ZDS directory and the node's CNI directories.
    zds_dir, bin_dir, conf_dir = d / "run-ztunnel", d / "opt-cni-bin", d / "etc-cni-net.d"
    for path in (zds_dir, bin_dir, conf_dir):
        path.mkdir()
    (conf_dir / "10-bridge.conflist").write_text(
        json.dumps({"cniVersion": "1.0.0", "name": "k8s", "plugins": [{"type": "bridge", "bridge": "cni0"}]})
    )
    agent_log = d / "agent.log"
    node.run_image(
        image,
        agent_log,
        read_only_root(
            [
                "ztunnel",
                "cni-agent",
                "--cni-bin-dir",
                "/host/opt/cni/bin",
                "--cni-conf-dir",
                "/host/etc/cni/net.d",
            ]
        ),
        env={"LOG_LEVEL": "info"},
        volumes=[
            f"{zds_dir}:{RUN}/ztunnel",
            f"{bin_dir}:/host/opt/cni/bin",
            f"{conf_dir}:/host/etc/cni/net.d",
        ],
        caps=("CAP_NET_ADMIN", "CAP_SYS_ADMIN", "CAP_NET_RAW", "CAP_SYS_PTRACE"),
    )

    def chained() -> bool:
        plugins = json.loads((conf_dir / "10-bridge.conflist").read_text())["plugins"]
        return plugins[-1] == {
            "type": "ztunnel-cni",
            "agentSocket": "/var/run/ztunnel/cni-agent.sock",
            "excludeNamespaces": ["kube-system", "istio-system"],
        }

    eventually(chained, lambda: f"the agent chaining its plugin:\n{agent_log.read_text()}", timeout=30)
    assert "root file system is read-only" in agent_log.read_text()
    # The plugin copied out of the image runs on the node, with the node's python3.
    version = subprocess.run(
        [str(bin_dir / "ztunnel-cni")],
        input=b"{}",
        env={"PATH": "/usr/bin:/bin", "CNI_COMMAND": "VERSION"},
        capture_output=True,
        timeout=30,
        check=False,
    )
    assert version.returncode == 0 and "1.0.0" in json.loads(version.stdout)["supportedVersions"], version
    return zds_dir, conf_dir


def read_only_root(command: list[str]) -> list[str]:
    """`command` with readOnlyRootFilesystem, as the kubelet gives it: the root mounted read-only
    (needs SYS_ADMIN, which both DaemonSets have), /tmp a tmpfs (every run_image has one)."""
    return [
        "sh",
        "-c",
        "mount -o remount,bind,ro / && ! touch /probe 2>/dev/null && echo 'root file system is read-only' "
        '&& exec "$@"',
        "sh",
        *command,
    ]


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            found += children
            todo += children
    return found


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def ready(node: Node) -> bool:
    done = node.exec("curl", "-s", "-m", "2", f"http://{NODE_IP}:15021/healthz/ready")
    return done.returncode == 0 and done.stdout.strip() == "ready"


@pytest.mark.parametrize("read_only", [False, True], ids=["root-fs", "read-only-root-fs"])
def test_the_chart_s_container_becomes_ready_and_carries_a_connection(
    mesh: Mesh, image: str, read_only: bool
) -> None:
    node = mesh.node
    log = node.dir / "ztunnel.log"
    command = ["ztunnel", "proxy", "ztunnel"]  # the chart's args after the image's entry point
    if read_only:
        command = read_only_root(command)
    ztunnel = node.run_image(
        image,
        log,
        command,
        env=CHART_ENV,
        volumes=[
            f"{mesh.token}:{RUN}/secrets/tokens/istio-token:ro",
            f"{mesh.root}:{RUN}/secrets/istio/root-cert.pem:ro",
            f"{mesh.zds_dir}:{RUN}/ztunnel",
        ],
        caps=CHART_CAPS,
        user="0:1337",
    )
    eventually(
        lambda: ready(node) or ztunnel.poll() is not None,
        lambda: f"ztunnel ready:\n{log.read_text()}",
        timeout=60,
    )
    assert ztunnel.poll() is None, log.read_text()
    if read_only:
        assert "root file system is read-only" in log.read_text()

    # xDS got through the control plane's token and cluster id check (it refuses any other call).
    cp = mesh.control_plane_log.read_text()
    assert "refused" not in cp, cp
    assert f"stream from ztunnel~{NODE_IP}~{POD}.istio-system~istio-system.svc.cluster.local" in cp

    done = node.exec(
        sys.executable,
        "-c",
        HBONE_CLIENT,
        f"https://{ISTIOD}:15012",
        str(mesh.root),
        str(mesh.token),
        CLUSTER,
        CLIENT_IP,
        NODE_IP,
        f"{NODE_IP}:{HTTP_PORT}",
        timeout=60,
    )
    assert done.returncode == 0, f"{done.stderr}\n--- ztunnel:\n{log.read_text()}"
    assert done.stdout.startswith("HTTP/1.0 200") and done.stdout.endswith("hello through the mesh\n"), (
        done.stdout
    )
    eventually(
        lambda: '"connection complete"' in log.read_text() and f"src.addr={CLIENT_IP}:" in log.read_text(),
        lambda: f"the access log line of the connection:\n{log.read_text()}",
    )

    # ztunnel's certificate came from the CA, with the chart's token and cluster id.
    cp = mesh.control_plane_log.read_text()
    assert "refused" not in cp, cp
    issued = [line for line in cp.splitlines() if "issued a certificate for" in line]
    assert any(
        "spiffe://cluster.local/ns/istio-system/sa/ztunnel" in line
        and f"token present, cluster {CLUSTER}" in line
        for line in issued
    ), cp

    # The kubelet's SIGTERM goes to the container's process (buildah itself would just kill it).
    proxy = next(
        pid
        for pid in descendants(ztunnel.pid)
        if cmdline(pid).split(b"\0")[:5]
        == [b"/opt/ztunnel/bin/python3", b"-OO", b"/opt/ztunnel/bin/ztunnel", b"proxy", b"ztunnel"]
    )
    os.kill(proxy, signal.SIGTERM)
    assert ztunnel.wait(timeout=30) == 0, log.read_text()
    # The chart's grace period of 30 s leaves a 25 s drain deadline.
    assert "shutting down: draining for up to 25.0s" in log.read_text()
    assert "Traceback" not in log.read_text()
