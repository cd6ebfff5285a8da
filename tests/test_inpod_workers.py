"""In-pod mode (root) with two data-plane workers: one xDS stream and one certificate per identity,
both workers serving, a policy push and a killed worker seen in every worker, a pod acknowledged
only once every worker listens."""

from __future__ import annotations

import os
import re
import signal

import pytest

from tests.inpod_mesh import (
    PROXY_PORTS,
    TD,
    Mesh,
    access_log,
    hold,
    listeners_per_port,
    listening_ports,
    mesh_fixture,  # noqa: F401 (a fixture)
    mesh_yaml,
    opened,
    per_worker,
    start_echo,
    start_node,
    talk,
)
from tests.waiting import eventually

pytestmark = pytest.mark.timeout(120)


def test_two_workers_one_xds_stream_one_certificate_per_identity_both_serving(mesh: Mesh) -> None:
    node = mesh.cluster.nodes[0]
    # Certificates from the control plane's CA this time, so it counts the requests.
    zt = start_node(mesh, node, mesh.xds, FAKE_CA="false", CA_ADDRESS=mesh.xds)
    assert len({w["pid"] for w in zt.worker_entries()}) == 2
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
    assert all(c > 0 for c in per_worker(zt, "outboundOpened")), zt.worker_entries()
    assert opened(zt.metrics_text(), reporter="destination", destination_workload="server") == n
    log = mesh.control_plane.log()
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
    assert all(c > 0 for c in per_worker(zt, "inboundOpened")), zt.worker_entries()
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
    victim = zt.worker_entries()[0]
    os.kill(victim["pid"], signal.SIGKILL)

    statuses: list[int] = []

    def replaced() -> bool:
        statuses.append(zt.readiness_answer()[0])
        w = zt.worker_entries()[0]
        return bool(w["pid"] != victim["pid"] and w["state"] == "ready")

    eventually(lambda: zt.readiness_answer()[0] == 500, "readiness down")
    # The answer says what it waits for (unless the replacement was quicker than this look).
    answer = zt.readiness_answer()
    assert answer[0] == 200 or answer[1] == (
        "not ready, pending: proxy\n"
        "proxy: each of the 2 data-plane workers serving (its listeners accepting)\n"
    ), answer
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
    stuck = zt.worker_entries()[1]
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
    assert zt.worker_entries()[1]["pid"] == stuck["pid"]  # not replaced: it answers again
