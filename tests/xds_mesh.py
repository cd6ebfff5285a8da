"""A scene of the process-model tests: two dedicated proxies (two workers each) fed over xDS by the
development control plane and its CA, and an echo app, all started through `tests/harness.py`;
with what those tests do to it (SOCKS5 to the echo app, connections held per worker)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests import apps
from tests.apps import echo_server, loopback_net
from tests.harness import ControlPlane, Fleet, Proxy, proxy_env
from tests.waiting import eventually

NET = loopback_net()
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


def client_alone(**extra: str) -> dict[str, str]:
    """The client proxy on its own: workloads from `CLIENT_ONLY`, the fake CA."""
    return proxy_env(CLIENT, "demo/client/client", CLIENT_ONLY, **extra)


@dataclass
class Mesh:
    cp: ControlPlane
    client: Proxy
    server: Proxy
    held: list[socket.socket] = field(default_factory=list)


@pytest.fixture(scope="module", name="echo")
def echo_fixture() -> Iterator[None]:
    with echo_server(APP_IP, APP_PORT):
        yield


@pytest.fixture(name="control_plane")
def control_plane_fixture(tmp_path: Path, fleet: Fleet) -> ControlPlane:
    return fleet.control_plane(tmp_path / "cp", CP_HOST, MESH)


@pytest.fixture(name="mesh")
def mesh_fixture(echo: None, control_plane: ControlPlane, fleet: Fleet) -> Iterator[Mesh]:
    server, client = fleet.start_all(
        control_plane.wire(proxy_env(SERVER, "demo/server/server", INSTANCE_IP=SERVER)),
        # One stream per pooled HBONE connection: the server's workers each get some of them.
        control_plane.wire(
            proxy_env(CLIENT, "demo/client/client", INSTANCE_IP=CLIENT, POOL_MAX_STREAMS_PER_CONNECTION="1")
        ),
    )
    m = Mesh(control_plane, client, server)
    try:
        yield m
    finally:
        for s in m.held:
            s.close()


def socks5_reply(proxy_ip: str, timeout: float = 10) -> tuple[socket.socket, int]:
    """A connection through the proxy's SOCKS5 listener to the echo app, and the CONNECT reply code."""
    return apps.socks5_reply(proxy_ip, APP_IP, APP_PORT, timeout)


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
    return {w["index"]: w["connectionsOpened"] for w in proxy.worker_entries()}


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
