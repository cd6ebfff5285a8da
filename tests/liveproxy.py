"""`ztunnel proxy` as an operator runs it: a process (a supervisor and its worker processes), dedicated
mode, its ports on one loopback address, its workloads from `LOCAL_XDS` and certificates from the
fake CA. Tests of the operators' tools (`ztunnel config`, a Prometheus) look at it from outside only.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import socketserver
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from tests.waiting import eventually


def loopback_net() -> str:
    """A random 127.a.b prefix, so parallel runs rarely share addresses."""
    return f"127.{random.randint(16, 250)}.{random.randint(0, 250)}"


class Output:
    """A process's output, collected by a thread as it comes (its pipe never fills)."""

    def __init__(self, stream: Any) -> None:
        self.lines: list[str] = []
        threading.Thread(target=self._drain, args=(stream,), daemon=True).start()

    def _drain(self, stream: Any) -> None:
        for line in stream:
            self.lines.append(line.decode(errors="replace") if isinstance(line, bytes) else line)

    def text(self) -> str:
        return "".join(self.lines)


@dataclass
class LiveProxy:
    ip: str
    process: subprocess.Popen[bytes]
    output: Output

    @property
    def admin(self) -> str:
        return f"{self.ip}:15000"

    @property
    def stats(self) -> str:
        return f"{self.ip}:15020"

    def get(self, port: int, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://{self.ip}:{port}{path}", timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()
        except OSError as e:
            return 0, str(e)

    def ready(self) -> bool:
        return self.get(15021, "/healthz/ready")[0] == 200


def proxy_env(workload: str, ip: str, local_xds: str, **extra: str) -> dict[str, str]:
    """`namespace/name/serviceaccount` of the proxy's workload, its address, its local config."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZTUNNEL_", "PROXY_", "XDS_", "CA_"))}
    env.update(
        PROXY_MODE="dedicated",
        PROXY_WORKLOAD_INFO=workload,
        ZTUNNEL_WORKER_THREADS="2",
        PROXY_BIND_ADDRESS=ip,
        UNSTABLE_ENABLE_SOCKS5="true",
        SOCKS5_ADDRESS=f"{ip}:15080",
        ADMIN_ADDRESS=f"{ip}:15000",
        STATS_ADDRESS=f"{ip}:15020",
        READINESS_ADDRESS=f"{ip}:15021",
        CONNECTION_TERMINATION_DEADLINE="1s",
        FAKE_CA="true",
        XDS_ADDRESS="",
        LOCAL_XDS=local_xds,
    )
    env.update(extra)
    return env


@contextmanager
def live_proxy(env: dict[str, str]) -> Iterator[LiveProxy]:
    """Start `ztunnel proxy`, wait for readiness, stop it (SIGTERM) at the end."""
    process = subprocess.Popen(
        [sys.executable, "-m", "ztunnel", "proxy"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    proxy = LiveProxy(env["PROXY_BIND_ADDRESS"], process, Output(process.stdout))
    try:
        eventually(
            lambda: proxy.ready() or process.poll() is not None,
            lambda: f"readiness of {proxy.ip}\n{proxy.output.text()[-3000:]}",
            timeout=45,
        )
        assert process.poll() is None, proxy.output.text()
        yield proxy
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        sys.stdout.write(f"--- proxy {proxy.ip} output (tail) ---\n{proxy.output.text()[-3000:]}\n")


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


@contextmanager
def echo_server(ip: str, port: int) -> Iterator[None]:
    server = _EchoServer((ip, port), _Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()


def socks5_reply(proxy_ip: str, dst_ip: str, dst_port: int, timeout: float = 10) -> tuple[socket.socket, int]:
    """A connection through the proxy's SOCKS5 listener to `dst_ip:dst_port`, and the CONNECT reply
    code (0: connected; 2: not allowed by the rules, e.g. a policy denied it)."""
    s = socket.create_connection((proxy_ip, 15080), timeout=timeout)
    s.sendall(b"\x05\x01\x00" + b"\x05\x01\x00\x01" + socket.inet_aton(dst_ip) + dst_port.to_bytes(2, "big"))
    reply = b""
    while len(reply) < 12:
        chunk = s.recv(12 - len(reply))
        if not chunk:
            raise ConnectionError(f"closed during the SOCKS5 handshake: {reply!r}")
        reply += chunk
    assert reply[:3] == b"\x05\x00\x05", reply  # no authentication, then the CONNECT reply
    return s, reply[3]


def socks5(proxy_ip: str, dst_ip: str, dst_port: int, timeout: float = 10) -> socket.socket:
    s, code = socks5_reply(proxy_ip, dst_ip, dst_port, timeout)
    assert code == 0, code
    return s


def exchange(s: socket.socket, payload: bytes) -> bytes:
    """Send `payload`, half-close, read to the end."""
    s.sendall(payload)
    s.shutdown(socket.SHUT_WR)
    got = b""
    while chunk := s.recv(65536):
        got += chunk
    return got


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants, as the kernel lists them now (a proxy: its supervisor, its
    workers, and its certificate helper while one runs)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


def open_fds(pids: list[int]) -> int:
    """The file descriptors the kernel lists for `pids`, summed."""
    total = 0
    for p in pids:
        try:
            total += len(os.listdir(f"/proc/{p}/fd"))
        except OSError:
            pass
    return total


def proportional_memory(pids: list[int]) -> float:
    """`Pss` of `pids` (bytes), summed: what they occupy together, shared pages once."""
    total = 0.0
    for p in pids:
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                total += next(float(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))
        except (OSError, StopIteration):
            pass
    return total
