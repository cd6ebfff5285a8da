"""ztunnel in in-pod mode against a node agent played by the test (root: real network namespaces).

The test speaks ZDS from the agent's side with `xds.zds` and hands over real pod namespaces to a
`ztunnel proxy` process (its supervisor and workers); what it checks is what an operator sees: listeners inside the pod's namespace (marked, reuse-port), the
acks, readiness, `/config_dump`, the `workload_manager_*` metrics, and the exit on a protocol error.
The full node (the real agent, the CNI plugins, traffic) is in `test_inpod_node.py` and
`test_inpod_workers.py`.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import random
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
from cryptography import x509
from prometheus_client.parser import text_string_to_metric_families

from tests.harness import Fleet, Proxy
from tests.netns import Netns, require_root
from tests.waiting import eventually_async
from xds import zds

pytestmark = pytest.mark.timeout(60)

LOCAL = """
workloads:
- uid: cluster1//v1/Pod/ns/pod-a
  name: pod-a
  namespace: ns
  serviceAccount: sa-a
  workloadIps: [10.66.0.2]
  protocol: HBONE
"""


class Agent:
    """The agent's end of ZDS, blocking calls run in threads."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(path)
        self.listener.listen(4)
        self.conn: socket.socket | None = None

    async def accept(self) -> None:
        self.listener.settimeout(10)
        conn, _ = await asyncio.to_thread(self.listener.accept)
        conn.settimeout(10)
        self.conn = conn
        packet = await asyncio.to_thread(zds.recv_packet, conn)
        assert packet is not None
        assert zds.decode_hello(packet[0]).version == zds.V1

    async def request(self, data: bytes, fds: list[int] | None = None) -> str:
        """Send one request, return the ack's error ("" for ACK)."""
        assert self.conn is not None
        zds.send_packet(self.conn, data, fds or [])
        packet = await asyncio.to_thread(zds.recv_packet, self.conn)
        assert packet is not None, "ztunnel closed the connection"
        return zds.decode_response(packet[0]).ack.error

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.listener.close()


def listeners(ns: Netns) -> dict[int, str]:
    """Listening TCP ports inside the namespace, with their extended socket info (fwmark …)."""
    out = ns.exec("ss", "-Hltne").stdout.decode()
    ports: dict[int, str] = {}
    for line in out.splitlines():
        local = line.split()[3]
        ports[int(local.rsplit(":", 1)[1])] = line
    return ports


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def readiness(ip: str, status: int) -> Callable[[], bool]:
    """A blocking check (it calls this process's own server: run it with `blocking=True`)."""
    return lambda: http_get(f"http://{ip}:15021/healthz/ready")[0] == status


@pytest.fixture
def pods() -> Iterator[list[Netns]]:
    require_root("ip", "ss")
    made: list[Netns] = []
    yield made
    for ns in made:
        ns.delete()


@pytest.fixture
async def node(tmp_path: Path, fleet: Fleet) -> AsyncIterator[tuple[Proxy, Agent, str]]:
    require_root("ip", "ss")
    ip = f"127.{random.randint(1, 250)}.{random.randint(1, 250)}.{random.randint(2, 250)}"
    uds = str(tmp_path / "ztunnel.sock")
    agent = Agent(uds)
    env = {
        "PROXY_MODE": "shared",
        "XDS_ADDRESS": "",
        "FAKE_CA": "true",
        "LOCAL_XDS": LOCAL,
        "INPOD_UDS": uds,
        "ADMIN_ADDRESS": f"{ip}:15000",
        "STATS_ADDRESS": f"{ip}:15020",
        "READINESS_ADDRESS": f"{ip}:15021",
        "CONNECTION_TERMINATION_DEADLINE": "1s",
        "ZTUNNEL_WORKER_THREADS": "2",
    }
    proxy = fleet.proxy(env)
    proxy.spawn()  # ready only once the agent's snapshot is in: each test plays the agent
    try:
        yield proxy, agent, ip
    finally:
        agent.close()


def open_netns(ns: Netns) -> int:
    return os.open(f"/var/run/netns/{ns.name}", os.O_RDONLY)


async def test_pod_listeners_open_inside_its_namespace(
    node: tuple[Proxy, Agent, str], pods: list[Netns]
) -> None:
    proxy, agent, ip = node
    pod = Netns("pod")
    pods.append(pod)
    await agent.accept()
    status, body = await asyncio.to_thread(http_get, f"http://{ip}:15021/healthz/ready")
    assert status == 500 and "workload proxy manager" in body  # no snapshot yet

    assert await agent.request(zds.add("uid-a", "pod-a", "ns", "sa-a"), [open_netns(pod)]) == ""
    ports = listeners(pod)
    assert {15001, 15006, 15008} <= set(ports)
    for port in (15001, 15006, 15008):
        assert "fwmark:0x539" in ports[port]  # SO_MARK 1337 on every socket of the pod's proxy
    # SO_REUSEPORT: a second ztunnel (an upgrade) can bind the same ports in the pod meanwhile.
    second = pod.exec(
        sys.executable, "-c",
        "import socket; s = socket.socket(socket.AF_INET6); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1);"
        "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('::', 15008)); s.listen(); print('bound')",
        check=False,
    )  # fmt: skip
    assert second.stdout.strip() == b"bound", second.stderr
    # Nothing in ztunnel's own namespace: no wildcard listener on 15008 (any spelling), and no socket of
    # ztunnel's processes (supervisor, workers) on 15008 at all. Other processes (tests
    # run beside this one) may hold a loopback address's 15008 here.
    host = subprocess.run(
        ["ss", "-Hltnp", "sport = :15008"], capture_output=True, text=True, check=True
    ).stdout
    assert "*:15008" not in host and "0.0.0.0:15008" not in host and "[::]:15008" not in host, host
    pids = proxy.pids()
    assert len(pids) >= 3, pids  # the supervisor, two workers
    for pid in pids:
        assert f"pid={pid}," not in host, host

    status, _ = await asyncio.to_thread(http_get, f"http://{ip}:15021/healthz/ready")
    assert status == 500  # still inside the snapshot
    assert await agent.request(zds.snapshot_sent()) == ""
    await eventually_async(readiness(ip, 200), "readiness 200", blocking=True)

    _, dump = await asyncio.to_thread(http_get, f"http://{ip}:15000/config_dump")
    state = json.loads(dump)["workloadState"]
    assert state["uid-a"]["state"] == "Up"
    assert state["uid-a"]["info"] == {"name": "pod-a", "namespace": "ns", "serviceAccount": "sa-a"}

    _, metrics = await asyncio.to_thread(http_get, f"http://{ip}:15020/metrics")
    assert "workload_manager_active_proxy_count 1\n" in metrics
    assert "workload_manager_proxies_started_total 1\n" in metrics

    identities = [c["identity"] for c in json.loads(dump)["certificates"]]
    assert identities == ["spiffe://cluster.local/ns/ns/sa/sa-a"]

    # Deleted: its listeners are gone at once, and its certificate is no longer kept.
    assert await agent.request(zds.delete("uid-a")) == ""
    assert not {15001, 15006, 15008} & set(listeners(pod))
    _, dump = await asyncio.to_thread(http_get, f"http://{ip}:15000/config_dump")
    assert json.loads(dump)["certificates"] == []
    _, metrics = await asyncio.to_thread(http_get, f"http://{ip}:15020/metrics")
    assert "workload_manager_active_proxy_count 0\n" in metrics
    assert "workload_manager_proxies_stopped_total 1\n" in metrics


async def test_a_pod_that_cannot_start_is_nacked_and_retried(
    node: tuple[Proxy, Agent, str], pods: list[Netns]
) -> None:
    _proxy, agent, ip = node
    pod = Netns("pod")
    pods.append(pod)
    # Something in the pod holds 15008 without SO_REUSEPORT.
    squatter = subprocess.Popen(
        ["ip", "netns", "exec", pod.name, "python3", "-c",
         "import socket,time; s=socket.socket(); s.bind(('0.0.0.0',15008)); s.listen(); print('ok',flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert squatter.stdout is not None and squatter.stdout.readline().strip() == b"ok"
        await agent.accept()
        error = await agent.request(zds.add("uid-a", "pod-a", "ns", "sa-a"), [open_netns(pod)])
        assert error == "failure to start proxy : Address already in use", error
        assert await agent.request(zds.snapshot_sent()) == ""
        status, body = await asyncio.to_thread(http_get, f"http://{ip}:15021/healthz/ready")
        assert status == 500 and "workload proxy manager" in body  # a pod is pending
        _, dump = await asyncio.to_thread(http_get, f"http://{ip}:15000/config_dump")
        assert json.loads(dump)["workloadState"]["uid-a"]["state"] == "Pending"
    finally:
        squatter.kill()
        squatter.wait()
    await eventually_async(
        lambda: {15001, 15006, 15008} <= set(listeners(pod)),
        "the retried pod's listeners",
        15.0,  # retried every 5 s
        blocking=True,
    )
    await eventually_async(readiness(ip, 200), "readiness 200", blocking=True)


async def test_reconnect_and_snapshot_drop_pods_the_agent_no_longer_has(
    node: tuple[Proxy, Agent, str], pods: list[Netns]
) -> None:
    _proxy, agent, ip = node
    a, b = Netns("pod"), Netns("pod")
    pods += [a, b]
    await agent.accept()
    assert await agent.request(zds.add("uid-a", "pod-a", "ns", "sa-a"), [open_netns(a)]) == ""
    assert await agent.request(zds.add("uid-b", "pod-b", "ns", "sa-b"), [open_netns(b)]) == ""
    assert await agent.request(zds.snapshot_sent()) == ""
    # The agent restarts: its connection drops, ztunnel reconnects, readiness waits for the snapshot.
    assert agent.conn is not None
    agent.conn.close()
    await eventually_async(readiness(ip, 500), "readiness 500 while the agent is away", blocking=True)
    await agent.accept()
    # The snapshot names pod-a again (its namespace unchanged: nothing restarts) but not pod-b.
    assert await agent.request(zds.add("uid-a", "pod-a", "ns", "sa-a"), [open_netns(a)]) == ""
    assert await agent.request(zds.snapshot_sent()) == ""
    assert {15001, 15006, 15008} <= set(listeners(a))
    assert not {15001, 15006, 15008} & set(listeners(b))
    await eventually_async(readiness(ip, 200), "readiness 200", blocking=True)


async def test_a_bad_packet_costs_only_the_connection(
    node: tuple[Proxy, Agent, str], pods: list[Netns]
) -> None:
    _proxy, agent, _ip = node
    await agent.accept()
    assert "must carry exactly one fd" in await agent.request(zds.add("uid-a", "pod-a", "ns", "sa-a"))
    assert agent.conn is not None
    assert await asyncio.to_thread(zds.recv_packet, agent.conn) is None  # ztunnel hung up ...
    await agent.accept()  # ... and came back
    assert await agent.request(zds.snapshot_sent()) == ""


def test_protocol_error_ends_ztunnel_with_status_1(tmp_path: Path, fleet: Fleet) -> None:
    require_root("ip")
    uds = str(tmp_path / "ztunnel.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(uds)
    listener.listen(1)
    listener.settimeout(20)
    ip = f"127.{random.randint(1, 250)}.{random.randint(1, 250)}.{random.randint(2, 250)}"
    env = dict(
        PROXY_MODE="shared",
        XDS_ADDRESS="",
        FAKE_CA="true",
        LOCAL_XDS=LOCAL,
        INPOD_UDS=uds,
        ADMIN_ADDRESS=f"{ip}:15000",
        STATS_ADDRESS=f"{ip}:15020",
        READINESS_ADDRESS=f"{ip}:15021",
    )
    proxy = fleet.proxy(env)
    proxy.spawn()
    try:
        conn, _ = listener.accept()
        conn.settimeout(10)
        assert zds.recv_packet(conn) is not None  # hello
        zds.send_packet(conn, zds.snapshot_sent())
        assert zds.recv_packet(conn) is not None
        zds.send_packet(conn, zds.keep("late"))
        packet = zds.recv_packet(conn)
        assert packet is not None
        assert "after the snapshot" in zds.decode_response(packet[0]).ack.error
        assert proxy.wait_exit(15) == 1
        assert "node agent protocol error: KeepWorkload late after the snapshot" in proxy.log()
    finally:
        listener.close()


def test_without_the_right_to_switch_namespaces_start_up_stops_in_one_line(
    tmp_path: Path, fleet: Fleet
) -> None:
    require_root("setpriv")
    ip = f"127.{random.randint(1, 250)}.{random.randint(1, 250)}.{random.randint(2, 250)}"
    env = dict(
        PROXY_MODE="shared",
        XDS_ADDRESS="",
        FAKE_CA="true",
        INPOD_UDS=str(tmp_path / "ztunnel.sock"),
        ADMIN_ADDRESS=f"{ip}:15000",
        STATS_ADDRESS=f"{ip}:15020",
        READINESS_ADDRESS=f"{ip}:15021",
    )
    # Root without CAP_SYS_ADMIN (dropped from the bounding set before exec).
    proxy = fleet.proxy(env, wrap=["setpriv", "--bounding-set=-sys_admin"])
    proxy.spawn()
    assert proxy.wait_exit(30) == 1
    assert proxy.log().strip().splitlines() == [
        "ztunnel: PROXY_MODE=shared (in-pod mode): cannot switch network namespaces (needs CAP_SYS_ADMIN):"
        " setns(CLONE_NEWNET): Operation not permitted"
    ]


async def test_cert_expiry_series_per_pod_identity_leaves_with_the_pod(
    node: tuple[Proxy, Agent, str], pods: list[Netns]
) -> None:
    """`istio_cert_expiry_seconds{identity}` in the parent's `/metrics`: the NotAfter of the
    certificate `/config_dump` shows, while a pod of the identity runs; gone once it is deleted."""
    _proxy, agent, ip = node
    identity = "spiffe://cluster.local/ns/ns/sa/sa-a"
    pod = Netns("pod")
    pods.append(pod)
    await agent.accept()
    assert await agent.request(zds.add("uid-a", "pod-a", "ns", "sa-a"), [open_netns(pod)]) == ""
    assert await agent.request(zds.snapshot_sent()) == ""

    def expiry_series() -> dict[str, float]:
        text = http_get(f"http://{ip}:15020/metrics")[1]
        return {
            s.labels["identity"]: s.value
            for family in text_string_to_metric_families(text)
            if family.name == "istio_cert_expiry_seconds"
            for s in family.samples
        }

    await eventually_async(lambda: identity in expiry_series(), "the identity's expiry series", blocking=True)
    _, dump = await asyncio.to_thread(http_get, f"http://{ip}:15000/config_dump")
    [cert] = json.loads(dump)["certificates"]
    assert cert["identity"] == identity and cert["state"] == "Available"
    leaf = x509.load_pem_x509_certificate(base64.b64decode(cert["certChain"][0]["pem"]))
    not_after = leaf.not_valid_after_utc.timestamp()
    shown = await asyncio.to_thread(expiry_series)
    assert shown == {identity: not_after}
    # The same instant `/config_dump` writes out.
    assert cert["certChain"][0]["expirationTime"] == leaf.not_valid_after_utc.strftime("%Y-%m-%dT%H:%M:%SZ")
    # One series, from the parent: the workers' certificates are copies of its own.
    text = (await asyncio.to_thread(http_get, f"http://{ip}:15020/metrics"))[1]
    assert text.count("istio_cert_expiry_seconds{") == 1, text

    assert await agent.request(zds.delete("uid-a")) == ""
    assert await asyncio.to_thread(expiry_series) == {}
    assert (
        "istio_cert_expiry_seconds"
        not in (await asyncio.to_thread(http_get, f"http://{ip}:15020/metrics"))[1]
    )
