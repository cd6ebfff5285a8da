"""`ztunnel demo`: the whole path on loopback, with real processes.

A development control plane (`ztunnel control-plane`) serves one YAML file over Delta ADS and signs
certificates over gRPC. Three dedicated proxies run as `ztunnel proxy` processes fed by it, each
bound to its workload's loopback address: a server workload (`demo/server`, 127.0.0.3) in front of
an echo app, and two clients with different identities (`demo/frontend` on 127.0.0.2,
`demo/intruder` on 127.0.0.4). A namespace policy allows only the frontend's identity.

The demo drives connections through each client's SOCKS5 listener, over HBONE to the server's
proxy, and shows the frontend's DNS proxy answering a name only the mesh knows (a service declared
in the control plane's file), which SOCKS5 then reaches by name. Then it edits the control plane's file to deny the frontend as well: the control plane
pushes the change, the server's proxy closes the frontend's open connection, and the next attempt
is denied.

`ztunnel demo --kube` runs the same from Kubernetes manifests instead (`control-plane --kube`): a
Namespace enrolled in ambient, three Pods, a ServiceEntry for the mesh-only name that selects the
server's pod, and an AuthorizationPolicy; the live change adds a DENY AuthorizationPolicy file.

The processes are started, waited for and stopped by `ztunnel.harness`, as the tests' and the
benches' are.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ztunnel.harness import ControlPlane, ProcessExited, ProxyProcess, http

TRUST_DOMAIN = "cluster.local"
APP_PORT = 8080

LOCAL_CONFIG = """\
workloads:
  - uid: demo//v1/Pod/demo/server
    name: server
    namespace: demo
    serviceAccount: server
    trustDomain: cluster.local
    workloadIps: ["127.0.0.3"]
    protocol: HBONE
    canonicalName: echo
    canonicalRevision: v1
    workloadName: server
    workloadType: deployment
    clusterId: Kubernetes
    services:
      "demo/echo.mesh.internal": {8080: 8080}
  - uid: demo//v1/Pod/demo/frontend
    name: frontend
    namespace: demo
    serviceAccount: frontend
    trustDomain: cluster.local
    workloadIps: ["127.0.0.2"]
    protocol: HBONE
    canonicalName: frontend
    workloadName: frontend
    workloadType: deployment
    clusterId: Kubernetes
  - uid: demo//v1/Pod/demo/intruder
    name: intruder
    namespace: demo
    serviceAccount: intruder
    trustDomain: cluster.local
    workloadIps: ["127.0.0.4"]
    protocol: HBONE
    canonicalName: intruder
    workloadName: intruder
    workloadType: deployment
    clusterId: Kubernetes
services:
  # A name only the mesh knows (a ServiceEntry): the proxies' DNS answers it with its VIP.
  - name: echo-mesh
    namespace: demo
    hostname: echo.mesh.internal
    vips: ["/240.240.0.10"]
    ports: {8080: 8080}
policies:
  - name: only-frontend
    namespace: demo
    scope: Namespace
    action: Allow
    dryRun: false
    rules:
      - - - principals: [!Exact "cluster.local/ns/demo/sa/frontend"]
"""


DENY_FRONTEND = """\
  - name: deny-frontend
    namespace: demo
    scope: Namespace
    action: Deny
    dryRun: false
    rules:
      - - - principals: [!Exact "cluster.local/ns/demo/sa/frontend"]
"""


# The same mesh as Kubernetes objects (also in examples/kube/), as istiod's ambient index reads them.
KUBE_MESH = """\
apiVersion: v1
kind: Namespace
metadata:
  name: demo
  labels: {istio.io/dataplane-mode: ambient}
---
apiVersion: v1
kind: Pod
metadata:
  name: server
  namespace: demo
  labels: {app: echo, version: v1}
spec:
  serviceAccountName: server
  containers: [{name: echo, image: echo, ports: [{name: echo, containerPort: 8080}]}]
status:
  podIP: 127.0.0.3
  conditions: [{type: Ready, status: "True"}]
---
apiVersion: v1
kind: Pod
metadata:
  name: frontend
  namespace: demo
  labels: {app: frontend, version: v1}
spec:
  serviceAccountName: frontend
status:
  podIP: 127.0.0.2
  conditions: [{type: Ready, status: "True"}]
---
apiVersion: v1
kind: Pod
metadata:
  name: intruder
  namespace: demo
  labels: {app: intruder, version: v1}
spec:
  serviceAccountName: intruder
status:
  podIP: 127.0.0.4
  conditions: [{type: Ready, status: "True"}]
---
# A name only the mesh knows; its endpoints are the pods it selects.
apiVersion: networking.istio.io/v1
kind: ServiceEntry
metadata:
  name: echo-mesh
  namespace: demo
spec:
  hosts: [echo.mesh.internal]
  addresses: [240.240.0.10]
  ports: [{number: 8080, name: echo, protocol: TCP}]
  resolution: STATIC
  workloadSelector:
    labels: {app: echo}
"""

KUBE_ONLY_FRONTEND = """\
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata:
  name: only-frontend
  namespace: demo
spec:
  selector:
    matchLabels: {app: echo}
  action: ALLOW
  rules:
    - from:
        - source:
            principals: ["cluster.local/ns/demo/sa/frontend"]
"""

KUBE_DENY_FRONTEND = """\
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata:
  name: deny-frontend
  namespace: demo
spec:
  action: DENY
  rules:
    - from:
        - source:
            principals: ["cluster.local/ns/demo/sa/frontend"]
"""


@dataclass
class DemoWorkload:
    """One of the demo's workloads and its dedicated proxy (`process`, once started)."""

    name: str
    ip: str
    process: ProxyProcess | None = None

    @property
    def identity(self) -> str:
        return f"spiffe://{TRUST_DOMAIN}/ns/demo/sa/{self.name}"

    def env(self, control_plane: str) -> dict[str, str]:
        return dict(
            PROXY_MODE="dedicated",
            PROXY_WORKLOAD_INFO=f"demo/{self.name}/{self.name}",
            XDS_ADDRESS=control_plane,
            CA_ADDRESS=control_plane,
            PROXY_BIND_ADDRESS=self.ip,
            UNSTABLE_ENABLE_SOCKS5="true",
            SOCKS5_ADDRESS=f"{self.ip}:15080",
            ADMIN_ADDRESS=f"{self.ip}:15000",
            STATS_ADDRESS=f"{self.ip}:15020",
            READINESS_ADDRESS=f"{self.ip}:15021",
            LOG_LEVEL="info",
        )


async def echo_server(host: str, port: int) -> asyncio.AbstractServer:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()

    return await asyncio.start_server(handle, host, port)


async def socks5_exchange(proxy_ip: str, target: tuple[str, int], payload: bytes) -> tuple[int, bytes]:
    """One SOCKS5 CONNECT through a proxy; returns (reply code, echoed bytes)."""
    reader, writer = await asyncio.open_connection(proxy_ip, 15080)
    try:
        writer.write(b"\x05\x01\x00")
        await reader.readexactly(2)
        host = target[0]
        if host.replace(".", "").isdigit():
            address = b"\x01" + bytes(int(x) for x in host.split("."))
        else:  # a name, resolved by the proxy
            address = b"\x03" + bytes((len(host),)) + host.encode()
        writer.write(b"\x05\x01\x00" + address + target[1].to_bytes(2, "big"))
        head = await reader.readexactly(4)
        code = head[1]
        if code != 0:
            return code, b""
        await reader.readexactly(6)
        writer.write(payload)
        writer.write_eof()
        echoed = await asyncio.wait_for(reader.read(), 10)
        return code, echoed
    except (asyncio.IncompleteReadError, ConnectionError):
        return -1, b""
    finally:
        writer.close()


METRIC_LINE = re.compile(r"^(istio_tcp_\w+)\{(.*)\}\s+([0-9.e+]+)$")


def scrape(proxy: DemoWorkload) -> list[tuple[str, dict[str, str], float]]:
    _, body = http("GET", f"http://{proxy.ip}:15020/metrics", timeout=2.0)
    out = []
    for line in body.decode().splitlines():
        m = METRIC_LINE.match(line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            out.append((m.group(1), labels, float(m.group(3))))
    return out


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


async def drive(server: DemoWorkload, clients: list[DemoWorkload]) -> tuple[list[list[str]], bool]:
    rows = [["client", "identity", "to", "expected", "outcome", "bytes sent/echoed"]]
    ok = True
    for client, allowed in zip(clients, (True, False), strict=True):
        payload = f"hello from {client.name}\n".encode() * 64
        code, echoed = await socks5_exchange(client.ip, (server.ip, APP_PORT), payload)
        passed = echoed == payload and code == 0
        outcome = "allowed" if passed else (f"denied (SOCKS5 reply {code})" if code > 0 else "failed")
        behaved = passed == allowed and (allowed or code == 2)
        ok &= behaved
        rows.append(
            [
                client.name,
                client.identity,
                f"{server.ip}:{APP_PORT}",
                "allow" if allowed else "deny",
                outcome + ("" if behaved else "  <-- unexpected"),
                f"{len(payload) if code == 0 else 0}/{len(echoed)}",
            ]
        )
    return rows, ok


CONTROL_PLANE = "127.0.0.1:15012"


async def live_policy_change(
    server: DemoWorkload, frontend: DemoWorkload, deny: Callable[[], str]
) -> tuple[list[list[str]], bool]:
    """Hold a connection open, deny its client in the control plane's file, watch it close."""
    rows = [["step", "outcome"]]
    reader, writer = await asyncio.open_connection(frontend.ip, 15080)
    writer.write(b"\x05\x01\x00")
    await reader.readexactly(2)
    writer.write(
        b"\x05\x01\x00\x01" + bytes(int(x) for x in server.ip.split(".")) + APP_PORT.to_bytes(2, "big")
    )
    head = await reader.readexactly(4)
    await reader.readexactly(6)
    writer.write(b"still here?")
    open_ok = head[1] == 0 and await asyncio.wait_for(reader.readexactly(11), 5) == b"still here?"
    rows.append(["frontend opens a long-lived connection", "echoing" if open_ok else "FAILED"])

    rows.append([f"{deny()}: deny frontend", "pushed over Delta ADS"])
    try:
        closed = await asyncio.wait_for(reader.read(), 10) == b""
    except (TimeoutError, ConnectionError):
        closed = False
    writer.close()
    rows.append(["the open connection", "closed by the server's proxy" if closed else "STILL OPEN"])
    code, _ = await socks5_exchange(frontend.ip, (server.ip, APP_PORT), b"again")
    rows.append(
        ["frontend tries again", f"denied (SOCKS5 reply {code})" if code == 2 else f"UNEXPECTED ({code})"]
    )
    return rows, open_ok and closed and code == 2


MESH_NAME = "echo.mesh.internal"


async def mesh_name(frontend: DemoWorkload) -> tuple[list[list[str]], bool]:
    """The frontend's DNS proxy answers a name only the mesh knows, and SOCKS5 reaches it by name."""
    import dns.message

    rows = [["step", "outcome"]]
    loop = asyncio.get_running_loop()
    addresses: list[str] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.setblocking(False)
        s.connect((frontend.ip, 15053))
        await loop.sock_sendall(s, dns.message.make_query(MESH_NAME, "A").to_wire())
        try:
            reply = dns.message.from_wire(await asyncio.wait_for(loop.sock_recv(s, 4096), 3))
            addresses = [r.to_text() for rrset in reply.answer for r in rrset]
        except (TimeoutError, OSError, ValueError):
            pass
    resolved = addresses == ["240.240.0.10"]
    rows.append([f"DNS A {MESH_NAME} at {frontend.ip}:15053", ", ".join(addresses) or "no answer"])
    payload = b"hello by name\n"
    code, echoed = await socks5_exchange(frontend.ip, (MESH_NAME, APP_PORT), payload)
    reached = code == 0 and echoed == payload
    rows.append([f"frontend SOCKS5 to {MESH_NAME}:{APP_PORT}", "echoed" if reached else f"FAILED ({code})"])
    return rows, resolved and reached


@dataclass
class DemoMesh:
    """The demo's files: what the control plane serves, and the edit that denies the frontend."""

    workdir: Path
    kube: bool

    @property
    def config_path(self) -> Path:
        return self.workdir / ("manifests" if self.kube else "mesh.yaml")

    def write(self) -> None:
        if self.kube:
            self.config_path.mkdir()
            (self.config_path / "mesh.yaml").write_text(KUBE_MESH)
            (self.config_path / "policy.yaml").write_text(KUBE_ONLY_FRONTEND)
        else:
            self.config_path.write_text(LOCAL_CONFIG)

    def deny(self) -> str:
        if self.kube:
            (self.config_path / "deny-frontend.yaml").write_text(KUBE_DENY_FRONTEND)
            return "AuthorizationPolicy file added"
        self.config_path.write_text(LOCAL_CONFIG + DENY_FRONTEND)
        return "control plane file edited"

    def editable(self) -> Path:
        return self.config_path / "policy.yaml" if self.kube else self.config_path


def control_plane(mesh: DemoMesh) -> ControlPlane:
    source = "--kube" if mesh.kube else "--config"
    return ControlPlane(mesh.workdir, CONTROL_PLANE, None, source, str(mesh.config_path))


def proxy_process(proxy: DemoWorkload, workdir: Path) -> ProxyProcess:
    env = proxy.env(f"http://{CONTROL_PLANE}")
    proxy.process = ProxyProcess(env, workdir / f"{proxy.name}.log", name=f"proxy {proxy.name}")
    return proxy.process


def stop_proxies(proxies: list[DemoWorkload]) -> None:
    """Drain each proxy as an operator would (`/quitquitquit`), then stop what is left of it."""
    for p in proxies:
        if p.process is not None and p.process.running():
            try:
                http("POST", f"http://{p.ip}:15000/quitquitquit", timeout=2.0)
            except OSError:
                p.process.send(signal.SIGTERM)
    for p in proxies:
        if p.process is not None:
            p.process.stop()


def server_metrics(server: DemoWorkload) -> tuple[list[list[str]], float]:
    """The server proxy's traffic metrics as seen by the destination, and the connections it opened."""
    rows = [["metric (server proxy, reporter=destination)", "source_principal", "flags", "value"]]
    samples = scrape(server)
    for name, labels, value in samples:
        if labels.get("reporter") == "destination":
            principal = labels.get("source_principal", "")
            rows.append([name, principal, labels.get("response_flags", ""), f"{value:g}"])
    opened = sum(v for n, _, v in samples if n == "istio_tcp_connections_opened_total")
    return rows, opened


async def keep_running(mesh: DemoMesh, server: DemoWorkload) -> None:
    print(f"\ncontrol plane file, logs and proxy output: {mesh.workdir}")
    print(
        "\nThe demo keeps running. Try:\n"
        f"  curl --socks5 127.0.0.2:15080 telnet://{server.ip}:{APP_PORT}   (frontend)\n"
        f"  curl --socks5 127.0.0.4:15080 telnet://{server.ip}:{APP_PORT}   (intruder: denied)\n"
        f"  $EDITOR {mesh.editable()}   (the control plane pushes every change)\n"
        "  curl -s 127.0.0.3:15000/config_dump | less\n"
        "  curl -s 127.0.0.3:15020/metrics | grep istio_tcp\n"
        "Press Ctrl-C to stop."
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()


async def show(mesh: DemoMesh, server: DemoWorkload, frontend: DemoWorkload, intruder: DemoWorkload) -> bool:
    """The demo's steps, each printed as a table; whether everything behaved."""
    source = "Kubernetes manifests" if mesh.kube else "a local-config file"
    print(
        f"ztunnel demo: a control plane on {CONTROL_PLANE} (xDS and CA, from {source}) and three"
        " dedicated proxies on loopback\n"
    )
    rows, ok = await drive(server, [frontend, intruder])
    print(table(rows))
    print()
    named, named_ok = await mesh_name(frontend)
    print(table(named))
    print()
    change, changed_ok = await live_policy_change(server, frontend, mesh.deny)
    print(table(change))
    await asyncio.sleep(0.3)  # let the server proxy finish its records
    metrics, opened = server_metrics(server)
    print()
    print(table(metrics) if len(metrics) > 1 else "no traffic metrics on the server proxy")
    return ok and named_ok and changed_ok and opened >= 3


async def demo_main(mesh: DemoMesh, *, keep: bool) -> int:
    server = DemoWorkload("server", "127.0.0.3")
    frontend, intruder = DemoWorkload("frontend", "127.0.0.2"), DemoWorkload("intruder", "127.0.0.4")
    proxies = [server, frontend, intruder]
    echo = await echo_server(server.ip, APP_PORT)
    cp = control_plane(mesh)
    try:
        await cp.astart(20)
        started = [proxy_process(p, mesh.workdir) for p in proxies]
        for process in started:
            process.spawn()
        for process in started:
            await process.await_ready(20)
        ok = await show(mesh, server, frontend, intruder)
        if keep:
            await keep_running(mesh, server)
        print("\nresult:", "everything behaved" if ok else "SOMETHING MISBEHAVED")
        return 0 if ok else 1
    finally:
        await asyncio.to_thread(stop_proxies, proxies)
        await cp.astop()
        echo.close()


def run_demo(*, keep: bool = False, kube: bool = False) -> int:
    mesh = DemoMesh(Path(tempfile.mkdtemp(prefix="ztunnel-demo-")), kube)
    mesh.write()
    try:
        return asyncio.run(demo_main(mesh, keep=keep))
    except (RuntimeError, ProcessExited) as e:
        print(f"ztunnel demo: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"ztunnel demo: {e.strerror or e} (is another demo running?)", file=sys.stderr)
        return 1
    finally:
        if not keep and os.environ.get("ZTUNNEL_DEMO_KEEP_LOGS") != "1":
            shutil.rmtree(mesh.workdir, ignore_errors=True)
