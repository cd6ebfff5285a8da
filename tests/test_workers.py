"""Worker processes (`ZTUNNEL_WORKER_THREADS`): a real `ztunnel proxy` process with two workers sharing
the listeners, traffic through its SOCKS5 listener to an echo app it passes through in plain TCP."""

from __future__ import annotations

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
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

NET = f"127.{random.randint(16, 250)}.{random.randint(0, 250)}"
PROXY_IP, APP_IP, APP_PORT = f"{NET}.2", f"{NET}.9", 7777

CONFIG = f"""
workloads:
  - uid: w//v1/Pod/w/client
    name: client
    namespace: w
    serviceAccount: client
    trustDomain: cluster.local
    workloadIps: ["{PROXY_IP}"]
    protocol: TCP
"""


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(65536):
            self.request.sendall(data)


class _EchoServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


@dataclass
class Proxy:
    process: subprocess.Popen[bytes]
    log: list[str]

    def dump(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"http://{PROXY_IP}:15000/config_dump", timeout=5) as r:
            result: dict[str, Any] = json.load(r)
        return result

    def metric_total(self, name: str) -> float:
        with urllib.request.urlopen(f"http://{PROXY_IP}:15020/metrics", timeout=5) as r:
            text = r.read().decode()
        return sum(float(m.group(1)) for m in re.finditer(rf"^{name}\{{.*\}} (\S+)$", text, re.M))


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def ready() -> bool:
    try:
        with urllib.request.urlopen(f"http://{PROXY_IP}:15021/healthz/ready", timeout=1) as r:
            return bool(r.status == 200)
    except (OSError, urllib.error.HTTPError):
        return False


def start_proxy(**extra: str) -> Proxy:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZTUNNEL_", "PROXY_", "XDS_", "CA_"))}
    env.update(
        PROXY_MODE="dedicated",
        PROXY_WORKLOAD_INFO="w/client/client",
        XDS_ADDRESS="",
        FAKE_CA="true",
        LOCAL_XDS=CONFIG,
        PROXY_BIND_ADDRESS=PROXY_IP,
        UNSTABLE_ENABLE_SOCKS5="true",
        SOCKS5_ADDRESS=f"{PROXY_IP}:15080",
        ADMIN_ADDRESS=f"{PROXY_IP}:15000",
        STATS_ADDRESS=f"{PROXY_IP}:15020",
        READINESS_ADDRESS=f"{PROXY_IP}:15021",
        CONNECTION_TERMINATION_DEADLINE="1s",
        **extra,
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "ztunnel", "proxy"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    log: list[str] = []

    def drain_output() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            log.append(line.decode(errors="replace"))

    threading.Thread(target=drain_output, daemon=True).start()
    proxy = Proxy(process, log)
    wait_for(lambda: ready() or process.poll() is not None, "readiness")
    assert process.poll() is None, "".join(log)
    return proxy


def stop_proxy(proxy: Proxy) -> None:
    if proxy.process.poll() is None:
        proxy.process.send_signal(signal.SIGTERM)
        try:
            proxy.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proxy.process.kill()
            proxy.process.wait()
    print("".join(proxy.log))


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
def workers(echo: None) -> Iterator[Proxy]:
    proxy = start_proxy(ZTUNNEL_WORKER_THREADS="2")
    try:
        yield proxy
    finally:
        stop_proxy(proxy)


def exchange(payload: bytes) -> bytes:
    """One connection through the proxy's SOCKS5 listener to the echo app; returns what came back."""
    with socket.create_connection((PROXY_IP, 15080), timeout=10) as s:
        s.sendall(
            b"\x05\x01\x00" + b"\x05\x01\x00\x01" + socket.inet_aton(APP_IP) + APP_PORT.to_bytes(2, "big")
        )
        reply = b""
        while len(reply) < 12:
            chunk = s.recv(12 - len(reply))
            if not chunk:
                raise ConnectionError(f"closed during the SOCKS5 handshake: {reply!r}")
            reply += chunk
        assert reply[:2] == b"\x05\x00" and reply[3] == 0, reply  # 5th byte on: the CONNECT reply
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
        return got


def opened_per_worker(proxy: Proxy) -> dict[int, int]:
    return {w["index"]: w["connectionsOpened"] for w in proxy.dump()["workers"]}


def test_connections_are_served_by_both_workers(workers: Proxy) -> None:
    dump = workers.dump()
    pids = {w["pid"] for w in dump["workers"]}
    assert len(pids) == 2 and workers.process.pid not in pids
    n = 40
    for i in range(n):
        payload = f"hello {i}".encode() * 100
        assert exchange(payload) == payload
    # Workers report their counters about once a second; the parent sums them.
    wait_for(lambda: sum(opened_per_worker(workers).values()) == n, "every connection counted")
    per_worker = opened_per_worker(workers)
    assert all(count > 0 for count in per_worker.values()), per_worker
    assert workers.metric_total("istio_tcp_connections_opened_total") == n
    assert workers.metric_total("istio_tcp_received_bytes_total") == sum(
        len(f"hello {i}") * 100 for i in range(n)
    )


def test_a_killed_worker_is_restarted_and_the_listeners_stay_up(workers: Proxy) -> None:
    for _ in range(20):
        assert exchange(b"before") == b"before"
    wait_for(lambda: sum(opened_per_worker(workers).values()) == 20, "the connections counted")

    victim = workers.dump()["workers"][0]
    os.kill(victim["pid"], signal.SIGKILL)
    wait_for(
        lambda: (
            workers.dump()["workers"][0]["pid"] != victim["pid"]
            or workers.dump()["workers"][0]["state"] != "ready"
        ),
        "the parent to notice",
    )

    # The other worker's listeners carry on: every new connection is served.
    for i in range(20):
        payload = f"after {i}".encode()
        assert exchange(payload) == payload
    assert ready()

    wait_for(
        lambda: (w := workers.dump()["workers"][0])["state"] == "ready" and w["pid"] != victim["pid"],
        "the worker to be restarted",
    )
    restarted = workers.dump()["workers"][0]
    assert restarted["restarts"] == 1
    # The killed worker's counts were reported before the kill: they stay in the sum, exactly once.
    wait_for(
        lambda: workers.metric_total("istio_tcp_connections_opened_total") == 40, "counts of both generations"
    )
    for _ in range(10):
        assert exchange(b"again") == b"again"
    wait_for(
        lambda: workers.metric_total("istio_tcp_connections_opened_total") == 50,
        "the restarted worker's counts",
    )


def test_without_the_variable_the_proxy_is_one_process(echo: None) -> None:
    proxy = start_proxy()
    try:
        assert "workers" not in proxy.dump()
        assert exchange(b"single") == b"single"
        pid = proxy.process.pid
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            assert f.read().split() == []  # no worker processes
    finally:
        stop_proxy(proxy)
