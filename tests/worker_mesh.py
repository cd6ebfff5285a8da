"""Two dedicated `ztunnel proxy` processes (2 workers each), the development control plane feeding
them over xDS and its CA, and an echo app: the harness of the process-model tests, with what they
read (logs, `/metrics`, readiness, the processes)."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.liveproxy import Output, echo_server
from tests.waiting import eventually

NET = f"127.{random.randint(16, 250)}.{random.randint(0, 250)}"
CLIENT, SERVER, CP_HOST, APP_IP = f"{NET}.2", f"{NET}.3", f"{NET}.10", f"{NET}.3"
APP_PORT = 8080
TD = "cluster.local"

SERVER_WORKLOAD = f"""
  - uid: x//v1/Pod/demo/server
    name: server
    namespace: demo
    serviceAccount: server
    trustDomain: {TD}
    workloadIps: ["{SERVER}"]
    protocol: HBONE"""
CLIENT_WORKLOAD = f"""
  - uid: x//v1/Pod/demo/client
    name: client
    namespace: demo
    serviceAccount: client
    trustDomain: {TD}
    workloadIps: ["{CLIENT}"]
    protocol: HBONE"""
MESH = f"workloads:{SERVER_WORKLOAD}{CLIENT_WORKLOAD}\n"
# Without the control plane: the client alone, so the echo app's address is passed through in TCP.
CLIENT_ONLY = f"workloads:{CLIENT_WORKLOAD}\n"

DENY_CLIENT = """policies:
  - name: deny-client
    namespace: demo
    scope: Namespace
    action: Deny
    dryRun: false
    rules:
      - - - principals: [!Exact "cluster.local/ns/demo/sa/client"]
"""


@dataclass
class Proxy:
    ip: str
    process: subprocess.Popen[bytes]
    output: Output
    admin: str = ""

    def get(self, port: int, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://{self.ip}:{port}{path}", timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def dump(self) -> dict[str, Any]:
        code, body = self.get(15000, "/config_dump")
        assert code == 200, body
        result: dict[str, Any] = json.loads(body)
        return result

    def workers(self) -> list[dict[str, Any]]:
        workers: list[dict[str, Any]] = self.dump()["workers"]
        return workers

    def readiness(self) -> tuple[int, str]:
        try:
            return self.get(15021, "/healthz/ready")
        except OSError as e:
            return 0, str(e)

    def ready(self) -> bool:
        return self.readiness()[0] == 200

    def metric_total(self, name: str, **labels: str) -> float:
        _, text = self.get(15020, "/metrics")
        total = 0.0
        for m in re.finditer(rf"^{name}\{{(.*)\}} (\S+)$", text, re.M):
            if all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
                total += float(m.group(2))
        return total


def proxy_env(name: str, ip: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZTUNNEL_", "PROXY_", "XDS_", "CA_"))}
    env.update(
        PROXY_MODE="dedicated",
        PROXY_WORKLOAD_INFO=f"demo/{name}/{name}",
        ZTUNNEL_WORKER_THREADS="2",
        PROXY_BIND_ADDRESS=ip,
        UNSTABLE_ENABLE_SOCKS5="true",
        SOCKS5_ADDRESS=f"{ip}:15080",
        ADMIN_ADDRESS=f"{ip}:15000",
        STATS_ADDRESS=f"{ip}:15020",
        READINESS_ADDRESS=f"{ip}:15021",
        CONNECTION_TERMINATION_DEADLINE="1s",
    )
    env.update(extra)
    return env


def launch(env: dict[str, str], ip: str) -> Proxy:
    process = subprocess.Popen(
        [sys.executable, "-m", "ztunnel", "proxy"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    return Proxy(ip, process, Output(process.stdout))


def wait_ready(proxy: Proxy) -> None:
    eventually(
        lambda: proxy.ready() or proxy.process.poll() is not None,
        lambda: f"readiness of {proxy.ip}: {proxy.readiness()}\n{proxy.output.text()[-3000:]}",
        timeout=30,
    )
    assert proxy.process.poll() is None, proxy.output.text()


def stop(proxy: Proxy) -> int:
    if proxy.process.poll() is None:
        proxy.process.send_signal(signal.SIGTERM)
        try:
            proxy.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proxy.process.kill()
            proxy.process.wait()
    sys.stdout.write(f"--- proxy {proxy.ip} output (tail) ---\n{proxy.output.text()[-4000:]}\n")
    return proxy.process.returncode


def descendants(pid: int) -> list[int]:
    """The live descendants of `pid`: its workers, and its certificate helper while one runs."""
    out: list[int] = []
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = [int(p) for p in f.read().split()]
    except FileNotFoundError:
        return out
    for kid in kids:
        # Neither a zombie not yet reaped nor a process exiting (its memory, and with it its
        # command line, already released): a helper that just left, say.
        if alive(kid) and _cmdline(kid):
            out.append(kid)
            out.extend(descendants(kid))
    return out


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except (FileNotFoundError, ProcessLookupError):
        return b""


def is_cert_helper(pid: int) -> bool:
    """Whether `pid` is a certificate helper (`python -m ztunnel.identity.certwork`)."""
    return b"ztunnel.identity.certwork" in _cmdline(pid).split(b"\0")


def cert_helpers(pid: int) -> list[int]:
    """The certificate helpers of the proxy whose parent is `pid` (none once they lingered out)."""
    return [p for p in descendants(pid) if is_cert_helper(p)]


def children(pid: int) -> list[int]:
    """The live descendants of `pid` but its certificate helper: its workers."""
    return [p for p in descendants(pid) if not is_cert_helper(p)]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@dataclass
class ControlPlane:
    config: Path
    process: subprocess.Popen[str]
    output: Output
    address: str

    def push(self, text: str) -> None:
        self.config.write_text(text)

    def streams_opened(self, node_id_part: str = "") -> int:
        return len(
            re.findall(rf"stream from \S*{re.escape(node_id_part)}\S* \(peer .*\) opened", self.output.text())
        )

    def certificates_issued(self, identity: str) -> int:
        return self.output.text().count(f"issued a certificate for {identity} ")


@dataclass
class Mesh:
    cp: ControlPlane
    client: Proxy
    server: Proxy
    held: list[socket.socket] = field(default_factory=list)


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module", name="echo")
def echo_fixture() -> Iterator[None]:
    with echo_server(APP_IP, APP_PORT):
        yield


@pytest.fixture(name="control_plane")
def control_plane_fixture(tmp_path: Path) -> Iterator[ControlPlane]:
    config = tmp_path / "mesh.yaml"
    config.write_text(MESH)
    address = f"{CP_HOST}:{free_port(CP_HOST)}"
    process = subprocess.Popen(
        [sys.executable, "-m", "ztunnel", "control-plane", "--config", str(config), "--listen", address,
         "--ca-dir", str(tmp_path / "ca")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert process.stdout is not None
    seen = []
    while not any("root certificate:" in line for line in seen):
        line = process.stdout.readline()
        assert line, "control plane exited: " + "".join(seen)
        seen.append(line)
    root = re.search(r"root certificate: (\S+)", "".join(seen))
    assert root is not None
    cp = ControlPlane(config, process, Output(process.stdout), address)
    cp.output.lines.extend(seen)
    try:
        yield cp
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.fixture(name="mesh")
def mesh_fixture(echo: None, control_plane: ControlPlane) -> Iterator[Mesh]:
    xds = {"XDS_ADDRESS": f"http://{control_plane.address}", "CA_ADDRESS": f"http://{control_plane.address}"}
    proxies = [
        launch(proxy_env("server", SERVER, INSTANCE_IP=SERVER, **xds), SERVER),
        # One stream per pooled HBONE connection: the server's workers each get some of them.
        launch(
            proxy_env("client", CLIENT, INSTANCE_IP=CLIENT, POOL_MAX_STREAMS_PER_CONNECTION="1", **xds),
            CLIENT,
        ),
    ]
    m = Mesh(control_plane, proxies[1], proxies[0])
    try:
        for proxy in proxies:
            wait_ready(proxy)
        yield m
    finally:
        for s in m.held:
            s.close()
        for proxy in proxies:
            stop(proxy)


def socks5_reply(proxy_ip: str, timeout: float = 10) -> tuple[socket.socket, int]:
    """A connection through the proxy's SOCKS5 listener to the echo app, and the CONNECT reply code."""
    s = socket.create_connection((proxy_ip, 15080), timeout=timeout)
    s.sendall(b"\x05\x01\x00" + b"\x05\x01\x00\x01" + socket.inet_aton(APP_IP) + APP_PORT.to_bytes(2, "big"))
    reply = b""
    while len(reply) < 12:
        chunk = s.recv(12 - len(reply))
        if not chunk:
            raise ConnectionError(f"closed during the SOCKS5 handshake: {reply!r}")
        reply += chunk
    assert reply[:2] == b"\x05\x00", reply
    return s, reply[3]


def socks5(proxy_ip: str, timeout: float = 10) -> socket.socket:
    s, code = socks5_reply(proxy_ip, timeout)
    assert code == 0, code
    return s


def echoes(s: socket.socket, payload: bytes) -> bool:
    """Whether the held connection still carries `payload` there and back."""
    try:
        s.sendall(payload)
        got = b""
        while len(got) < len(payload):
            chunk = s.recv(65536)
            if not chunk:
                return False
            got += chunk
        return got == payload
    except OSError:
        return False


def exchange(proxy_ip: str, payload: bytes) -> bytes:
    with socks5(proxy_ip) as s:
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
        return got


def refused(addr: tuple[str, int]) -> bool:
    try:
        socket.create_connection(addr, timeout=1).close()
    except OSError:
        return True
    return False


def opened_per_worker(proxy: Proxy) -> dict[int, int]:
    return {w["index"]: w["connectionsOpened"] for w in proxy.workers()}


def spread(m: Mesh, proxy: Proxy, n: int = 16) -> list[socket.socket]:
    """Hold `n` connections, until each worker of `proxy` carries at least one."""
    before = sum(opened_per_worker(proxy).values())
    for i in range(n):
        s = socks5(CLIENT)
        m.held.append(s)
        assert echoes(s, f"hold {i}".encode())
    eventually(lambda: sum(opened_per_worker(proxy).values()) >= before + n, "the held connections counted")
    per_worker = opened_per_worker(proxy)
    assert all(count > 0 for count in per_worker.values()), per_worker
    return m.held[-n:]
