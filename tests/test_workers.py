"""One control process and its data-plane workers, dedicated mode, as real processes.

Two `ztunnel proxy` processes (a client's and a server's, 2 workers each) fed by the development
control plane over xDS and its CA; the client app reaches the server's echo app through the client
proxy's SOCKS5 listener and HBONE. What is checked is what an operator sees: the control plane's
own log (streams opened, certificates issued), `/config_dump`, `/metrics`, readiness, the traffic,
the processes, and the exit status and message of a proxy that cannot start.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import re
import signal
import socket
import socketserver
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.profiles import functions_in
from tests.waiting import eventually

pytestmark = pytest.mark.timeout(120)

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


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        try:
            while data := self.request.recv(65536):
                self.request.sendall(data)
        except OSError:
            pass


class _EchoServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


class Output:
    """A process's output, collected by a thread as it comes."""

    def __init__(self, stream: Any) -> None:
        self.lines: list[str] = []
        threading.Thread(target=self._drain, args=(stream,), daemon=True).start()

    def _drain(self, stream: Any) -> None:
        for line in stream:
            self.lines.append(line.decode(errors="replace") if isinstance(line, bytes) else line)

    def text(self) -> str:
        return "".join(self.lines)


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


def children(pid: int) -> list[int]:
    """The live descendants of `pid` (the fork server and its workers)."""
    out: list[int] = []
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = [int(p) for p in f.read().split()]
    except FileNotFoundError:
        return out
    for kid in kids:
        out.append(kid)
        out.extend(children(kid))
    return out


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


@pytest.fixture(scope="module")
def echo() -> Iterator[None]:
    server = _EchoServer((APP_IP, APP_PORT), _Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def control_plane(tmp_path: Path) -> Iterator[ControlPlane]:
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


@pytest.fixture
def mesh(echo: None, control_plane: ControlPlane) -> Iterator[Mesh]:
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


# -- the tests ------------------------------------------------------------------------------------


def test_one_xds_stream_and_one_certificate_request_per_identity(mesh: Mesh) -> None:
    # The workload's certificate is asked for at start-up, before any connection needs it.
    for proxy, name in ((mesh.client, "client"), (mesh.server, "server")):
        eventually(
            lambda p=proxy, n=name: (
                [(c["identity"], c["state"]) for c in p.dump()["certificates"]]  # type: ignore[misc]
                == [(f"spiffe://{TD}/ns/demo/sa/{n}", "Available")]
            ),
            f"{name}'s certificate prefetched",
        )
    for proxy in (mesh.client, mesh.server):
        pids = {w["pid"] for w in proxy.workers()}
        assert len(pids) == 2 and proxy.process.pid not in pids
        assert set(children(proxy.process.pid)) >= pids
    # Traffic through every worker of both proxies: each needed its workload's certificate.
    spread(mesh, mesh.client)
    eventually(
        lambda: all(c > 0 for c in opened_per_worker(mesh.server).values()), "both server workers used"
    )
    # One stream per proxy process (its node id names the instance), never one per worker.
    assert mesh.cp.streams_opened(CLIENT) == 1, mesh.cp.output.text()
    assert mesh.cp.streams_opened(SERVER) == 1, mesh.cp.output.text()
    assert mesh.cp.streams_opened() == 2
    for name in ("client", "server"):
        assert mesh.cp.certificates_issued(f"spiffe://{TD}/ns/demo/sa/{name}") == 1, mesh.cp.output.text()
    # The parent holds the certificates and shows them.
    certs = mesh.client.dump()["certificates"]
    assert [(c["identity"], c["state"]) for c in certs] == [(f"spiffe://{TD}/ns/demo/sa/client", "Available")]
    assert certs[0]["certChain"] and certs[0]["rootCerts"]


def test_connections_are_served_by_both_workers_and_metrics_are_summed(mesh: Mesh) -> None:
    n = 40
    for i in range(n):
        payload = f"hello {i}".encode() * 100
        assert exchange(CLIENT, payload) == payload
    # A scrape collects every worker's counters at once: exact right after the traffic.
    assert mesh.client.metric_total("istio_tcp_connections_opened_total", reporter="source") == n
    assert mesh.server.metric_total("istio_tcp_connections_opened_total", reporter="destination") == n
    assert mesh.server.metric_total("istio_tcp_received_bytes_total", reporter="destination") == sum(
        len(f"hello {i}") * 100 for i in range(n)
    )
    for proxy in (mesh.client, mesh.server):
        eventually(lambda p=proxy: sum(opened_per_worker(p).values()) == n, "every connection counted")  # type: ignore[misc]
        per_worker = opened_per_worker(proxy)
        assert all(count > 0 for count in per_worker.values()), per_worker


def test_a_policy_pushed_over_xds_closes_held_connections_in_every_worker(mesh: Mesh) -> None:
    held = spread(mesh, mesh.client)
    eventually(
        lambda: all(c > 0 for c in opened_per_worker(mesh.server).values()), "both server workers hold some"
    )
    mesh.cp.push(MESH + DENY_CLIENT)
    for s in held:
        s.settimeout(10)
        assert s.recv(100) == b"", "a held connection was not closed by the policy"
    eventually(lambda: mesh.server.output.text().count("connection closed due to policy change") >= len(held),
               "every closure logged")  # fmt: skip
    # New connections are refused by the server's inbound, in whichever worker.
    for _ in range(4):
        s, code = socks5_reply(CLIENT)
        s.close()
        assert code == 2  # connection not allowed by ruleset


def test_a_killed_worker_is_replaced_while_the_other_keeps_echoing(mesh: Mesh) -> None:
    proxy = mesh.client
    held = spread(mesh, proxy)
    survivors_expected = opened_per_worker(proxy)[1]
    victim = proxy.workers()[0]
    os.kill(victim["pid"], signal.SIGKILL)
    eventually(lambda: not alive(victim["pid"]), "the worker's death")

    # From its death until its replacement accepts, readiness is never 200.
    statuses: list[tuple[int, str]] = []

    def replaced() -> bool:
        statuses.append(proxy.readiness())
        w = proxy.workers()[0]
        return bool(w["pid"] != victim["pid"] and w["state"] == "ready")

    # Meanwhile the connections of the other worker keep echoing, and new ones are served.
    survivors = [s for s in held if echoes(s, b"still there?")]
    assert exchange(CLIENT, b"new while one is down") == b"new while one is down"
    eventually(replaced, "the worker to be replaced", timeout=20)
    not_ready = statuses[:-1]
    assert not_ready and all(code == 500 and "proxy" in body for code, body in not_ready), statuses
    assert len(survivors) == survivors_expected
    assert all(echoes(s, b"and after") for s in survivors)
    restarted = proxy.workers()[0]
    assert restarted["restarts"] == 1 and alive(restarted["pid"])
    assert proxy.ready()
    # The replacement serves too.
    before = opened_per_worker(proxy)[0]
    for i in range(16):
        assert exchange(CLIENT, f"after {i}".encode()) == f"after {i}".encode()
    eventually(lambda: opened_per_worker(proxy)[0] > before, "the new worker serving")


def test_stopping_the_parent_leaves_no_worker_behind(mesh: Mesh) -> None:
    descendants = children(mesh.client.process.pid)
    assert len(descendants) == 3  # the fork server and two workers
    mesh.client.process.kill()  # no chance to clean up: the workers go with it all the same
    mesh.client.process.wait()
    eventually(lambda: not any(alive(p) for p in descendants), "the workers to exit")
    # A graceful stop: exit 0, nothing left.
    descendants = children(mesh.server.process.pid)
    assert stop(mesh.server) == 0
    assert not any(alive(p) for p in descendants)


def test_a_drain_cuts_held_connections_at_its_deadline_in_every_worker(mesh: Mesh) -> None:
    """SIGTERM with connections held in both workers: new connections are refused, the held ones
    keep echoing until CONNECTION_TERMINATION_DEADLINE (1 s) and are then cut, each logged with
    the drain deadline; the proxy exits 0."""
    held = spread(mesh, mesh.client, n=8)
    mesh.client.process.send_signal(signal.SIGTERM)
    assert all(echoes(s, b"during") for s in held)  # inside the deadline: still carried
    eventually(lambda: refused((CLIENT, 15080)), "new connections refused")
    assert mesh.client.process.wait(timeout=20) == 0
    for s in held:
        s.settimeout(5)
        assert not echoes(s, b"after")
    lines = [line for line in mesh.client.output.text().splitlines() if "connection complete" in line]
    cut = [line for line in lines if 'error="connection closed: drain deadline"' in line]
    assert len(cut) == len(held), "\n".join(lines)


def test_a_second_proxy_on_addresses_in_use_fails_with_one_line(echo: None) -> None:
    first = launch(proxy_env("client", CLIENT, FAKE_CA="true", XDS_ADDRESS="", LOCAL_XDS=CLIENT_ONLY), CLIENT)
    try:
        wait_ready(first)
        # Same proxy addresses, its own admin ports: only the listeners conflict.
        other = f"{NET}.4"
        env = proxy_env("client", CLIENT, FAKE_CA="true", XDS_ADDRESS="", LOCAL_XDS=CLIENT_ONLY,
                        ADMIN_ADDRESS=f"{other}:15000", STATS_ADDRESS=f"{other}:15020",
                        READINESS_ADDRESS=f"{other}:15021")  # fmt: skip
        second = subprocess.run([sys.executable, "-m", "ztunnel", "proxy"], env=env, capture_output=True,
                                text=True, timeout=30)  # fmt: skip
        assert second.returncode != 0
        errors = [line for line in (second.stdout + second.stderr).splitlines() if "failed to bind" in line]
        assert len(errors) == 1 and f"{CLIENT}:15001" in errors[0], second.stdout + second.stderr
        assert "Traceback" not in second.stdout + second.stderr
        # The first one never shared its ports: it still serves every connection.
        for i in range(10):
            assert exchange(CLIENT, f"first {i}".encode()) == f"first {i}".encode()
        assert first.metric_total("istio_tcp_connections_opened_total") == 10
    finally:
        stop(first)


def test_two_proxies_started_at_once_on_the_same_addresses_one_wins(echo: None) -> None:
    procs = []
    for other in (f"{NET}.5", f"{NET}.6"):
        env = proxy_env("client", CLIENT, FAKE_CA="true", XDS_ADDRESS="", LOCAL_XDS=CLIENT_ONLY,
                        ADMIN_ADDRESS=f"{other}:15000", STATS_ADDRESS=f"{other}:15020",
                        READINESS_ADDRESS=f"{other}:15021")  # fmt: skip
        procs.append(launch(env, other))
    try:
        eventually(lambda: sum(p.process.poll() is not None for p in procs) >= 1, "one of them to exit")
        losers = [p for p in procs if p.process.poll() is not None]
        assert len(losers) == 1 and losers[0].process.returncode != 0
        winner = next(p for p in procs if p.process.poll() is None)
        wait_ready(winner)
        assert "failed to bind the proxy listeners" in losers[0].output.text()
    finally:
        for p in procs:
            stop(p)


def pss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        m = re.search(r"^Pss:\s+(\d+) kB", f.read(), re.M)
    assert m is not None
    return int(m.group(1))


def test_idle_memory_of_an_extra_worker(echo: None) -> None:
    totals = {}
    for workers in (1, 2):
        proxy = launch(
            proxy_env("client", CLIENT, FAKE_CA="true", XDS_ADDRESS="", LOCAL_XDS=CLIENT_ONLY,
                      ZTUNNEL_WORKER_THREADS=str(workers)),
            CLIENT,
        )  # fmt: skip
        try:
            wait_ready(proxy)
            assert exchange(CLIENT, b"warm") == b"warm"
            pids = [proxy.process.pid, *children(proxy.process.pid)]
            assert len(pids) == workers + 2
            totals[workers] = sum(pss_kib(p) for p in pids)
        finally:
            stop(proxy)
    extra = totals[2] - totals[1]
    print(f"idle PSS, parent + fork server + workers: 1 worker {totals[1]} KiB, 2 workers {totals[2]} KiB")
    assert extra <= 12 * 1024, totals


def test_starts_in_a_row_with_xds(control_plane: ControlPlane) -> None:
    """Start-up never fails on a race with gRPC (fork before any gRPC thread): N starts in a row."""
    runs = int(os.environ.get("ZTUNNEL_TEST_STARTS", "5"))
    xds = {"XDS_ADDRESS": f"http://{control_plane.address}", "CA_ADDRESS": f"http://{control_plane.address}"}
    for i in range(runs):
        proxy = launch(proxy_env("client", CLIENT, **xds), CLIENT)
        try:
            wait_ready(proxy)
        finally:
            code = stop(proxy)
        assert code == 0, f"start {i + 1} of {runs}: exit {code}"
        assert "Check failed" not in proxy.output.text() and "skipping fork()" not in proxy.output.text()


def test_the_worker_count_follows_the_cpu_limit_by_default(echo: None) -> None:
    env = proxy_env(
        "client", CLIENT, FAKE_CA="true", XDS_ADDRESS="", LOCAL_XDS=CLIENT_ONLY, ZTUNNEL_CPU_LIMIT="12"
    )
    del env["ZTUNNEL_WORKER_THREADS"]
    proxy = launch(env, CLIENT)
    try:
        wait_ready(proxy)
        workers = proxy.workers()
        assert [w["index"] for w in workers] == [0, 1, 2]  # 25 % of 12 CPUs
        assert all(w["state"] == "ready" for w in workers)
    finally:
        stop(proxy)


def test_a_log_filter_set_over_admin_reaches_every_worker(echo: None) -> None:
    proxy = launch(proxy_env("client", CLIENT, FAKE_CA="true", XDS_ADDRESS="", LOCAL_XDS=CLIENT_ONLY), CLIENT)

    def post(query: str) -> str:
        req = urllib.request.Request(f"http://{CLIENT}:15000/logging?{query}", method="POST")
        with urllib.request.urlopen(req, timeout=5) as r:
            return str(r.read().decode())

    def completed() -> int:
        return proxy.output.text().count('"connection complete"')

    try:
        wait_ready(proxy)
        assert exchange(CLIENT, b"logged") == b"logged"
        eventually(lambda: completed() == 1, "the first access-log line")
        assert "access=off" in post("level=access=off")
        for i in range(16):  # over both workers
            assert exchange(CLIENT, f"quiet {i}".encode()) == f"quiet {i}".encode()
        assert "access=info" in post("level=access=info")
        assert exchange(CLIENT, b"logged again") == b"logged again"
        # The quiet connections were over before this one began: only its line is new.
        eventually(lambda: completed() >= 2, "the access-log line after the filter came back")
        assert completed() == 2, proxy.output.text()
        assert proxy.metric_total("istio_tcp_connections_opened_total") == 18
    finally:
        stop(proxy)


def test_a_stuck_worker_makes_the_proxy_unready_until_it_answers_again(echo: None) -> None:
    proxy = launch(proxy_env("client", CLIENT, FAKE_CA="true", XDS_ADDRESS="", LOCAL_XDS=CLIENT_ONLY), CLIENT)
    try:
        wait_ready(proxy)
        stuck = proxy.workers()[1]
        os.kill(stuck["pid"], signal.SIGSTOP)  # alive, its listeners open, but nothing runs
        try:
            eventually(lambda: proxy.readiness()[0] == 500, "readiness down", timeout=15)
            assert proxy.workers()[1]["state"] == "unresponsive"
            assert "proxy" in proxy.readiness()[1]
        finally:
            os.kill(stuck["pid"], signal.SIGCONT)
        eventually(proxy.ready, "readiness back once it answers")
        again = proxy.workers()[1]
        assert (again["pid"], again["state"], again["restarts"]) == (stuck["pid"], "ready", 0)  # not replaced
    finally:
        stop(proxy)


def test_a_cpu_profile_samples_the_parent_and_every_worker(echo: None, profile_pb2: ModuleType) -> None:
    """`/debug/pprof/profile` on the parent: one pprof document with every process's samples, each
    labelled with its pid (decoded here with the published profile.proto)."""
    proxy = launch(proxy_env("client", CLIENT, FAKE_CA="true", XDS_ADDRESS="", LOCAL_XDS=CLIENT_ONLY), CLIENT)
    try:
        wait_ready(proxy)
        pids = {int(w["pid"]) for w in proxy.workers()} | {proxy.process.pid}
        assert len(pids) == 3
        stop_traffic = threading.Event()

        def traffic() -> None:
            while not stop_traffic.is_set():
                assert exchange(CLIENT, b"profiled" * 512) == b"profiled" * 512

        t = threading.Thread(target=traffic, daemon=True)
        t.start()
        try:
            with urllib.request.urlopen(
                f"http://{CLIENT}:15000/debug/pprof/profile?seconds=2&frequency=200", timeout=30
            ) as r:
                assert r.status == 200
                body = r.read()
        finally:
            stop_traffic.set()
            t.join(10)
        profile = profile_pb2.Profile.FromString(gzip.decompress(body))
        strings = profile.string_table
        sampled = {label.num for s in profile.sample for label in s.label if strings[label.key] == "pid"}
        assert pids <= sampled, (pids, sampled)
        assert any(fn.startswith(("hbone.", "ztunnel.proxy.")) for fn in functions_in(profile))
    finally:
        stop(proxy)


def test_on_demand_xds_is_asked_by_the_workers_through_the_parents_stream(
    echo: None, control_plane: ControlPlane
) -> None:
    """XDS_ON_DEMAND=true: the client knows only itself; the worker that takes a connection to the
    server asks the parent, whose one stream asks the control plane, and reaches it over HBONE."""
    xds = {"XDS_ADDRESS": f"http://{control_plane.address}", "CA_ADDRESS": f"http://{control_plane.address}"}
    server = launch(proxy_env("server", SERVER, INSTANCE_IP=SERVER, **xds), SERVER)
    client = launch(
        proxy_env(
            "client",
            CLIENT,
            INSTANCE_IP=CLIENT,
            XDS_ON_DEMAND="true",
            LOCAL_XDS=CLIENT_ONLY,
            ISTIO_META_DNS_CAPTURE="false",
            **xds,
        ),
        CLIENT,
    )
    try:
        for proxy in (server, client):
            wait_ready(proxy)
        known = {ip for w in client.dump()["workloads"] for ip in w.get("workloadIps", [])}
        assert SERVER not in known
        for i in range(6):  # whichever worker takes it
            assert exchange(CLIENT, f"on demand {i}".encode()) == f"on demand {i}".encode()
        # Over HBONE: the server's proxy took every one of them.
        assert server.metric_total("istio_tcp_connections_opened_total", reporter="destination") == 6
        known = {ip for w in client.dump()["workloads"] for ip in w.get("workloadIps", [])}
        assert SERVER in known
        assert control_plane.streams_opened(CLIENT) == 1, control_plane.output.text()
    finally:
        for proxy in (client, server):
            stop(proxy)
