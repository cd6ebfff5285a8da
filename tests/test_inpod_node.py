"""In-pod mode end to end (root): nodes built from network namespaces, as a cluster would run them.

Each node runs `ztunnel cni-agent` and `ztunnel proxy` (PROXY_MODE=shared) inside its namespace. The
test is the container runtime: pods get their network from Debian's `bridge` + `host-local` plugins
chained with `ztunnel-cni` (tests/cninode.py). The development control plane plays istiod: once the
pods have IPs, the test writes them into its file and it pushes them to every ztunnel over xDS. Apps
in the pods connect to each other's IPs with no proxy settings; the pods' own redirection rules
capture the bytes, and the pods' proxy instances carry them over HBONE."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from tests.cninode import join
from tests.inpod_mesh import (
    CLIENT_APP,
    PROXY_PORTS,
    TD,
    WHOAMI_APP,
    Mesh,
    listeners_per_port,
    listening_ports,
    logged,
    mesh_fixture,  # noqa: F401 (a fixture)
    mesh_yaml,
    opened,
    start_echo,
    start_node,
    talk,
)
from tests.waiting import eventually

pytestmark = pytest.mark.timeout(120)


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
    metrics = zt.metrics_text()
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

    # Denied: the intruder's bytes never reach the server app. Its own proxy ends its connection
    # when the server's answers 401: closed, or reset when its bytes were still unread then.
    assert talk(intruder, server, "let-me-in") in ("echo", "error ConnectionResetError\necho")
    assert logged(zt, src=intruder.ip, direction="inbound", error="allow policies exist, but none allowed")

    # The pod that is not enrolled talks plaintext: to it, the client's proxy passes TCP through ...
    assert talk(client, plain, "hello-plain") == "echo hello-plain"
    passthrough = logged(zt, src=client.ip, dst=f"{plain.ip}:8080", direction="outbound")
    assert passthrough and "dst.identity" not in passthrough[0]
    # ... and from it, plaintext is captured on the server's 15006, where the policy (mTLS identity
    # required) refuses it: the app reads the end of its connection, no byte and no reset (the
    # server pod's proxy closes it so, whether its bytes arrived before the refusal or after).
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
    # Ended by ztunnel with a FIN (the server pod's drain), not a reset nor the client's own 8 s
    # timeout ("closed TimeoutError"); the details: tests/test_inpod_drain.py.
    line = held.stdout.readline().strip()
    assert line == "closed", line
    assert server.uid not in zt.config_dump()["workloadState"]
    assert "workload_manager_proxies_stopped_total 1" in zt.metrics_text()
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

    zt.terminate(signal.SIGKILL)
    # Its data-plane workers follow the parent (their death signal) a moment later.
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
            zt2.metrics_text(),
            reporter="destination",
            source_principal=f"spiffe://{TD}/ns/default/sa/client",
            destination_principal=f"spiffe://{TD}/ns/default/sa/server",
        )
        == 1
    )
    assert (
        opened(zt1.metrics_text(), reporter="source", source_workload="client", destination_workload="server")
        == 1
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
    new = mesh.ztunnel(node, mesh.xds, ports=(25000, 25020, 25021))
    new.start()
    eventually(new.ready, "the new ztunnel's readiness")
    assert set(new.config_dump()["workloadState"]) == {client.uid, server.uid}
    mesh.wait_for_workloads(new, [client, server])
    assert old.terminate(signal.SIGTERM) == 0
    assert talk(client, server, "v2") == "echo v2"
    assert opened(new.metrics_text(), reporter="destination", destination_workload="server") == 1

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
            zt.metrics_text(),
            reporter="destination",
            destination_workload="ztunnel-node",
            source_principal=f"spiffe://{TD}/ns/default/sa/client",
            connection_security_policy="mutual_tls",
        )
        == 1
    )


# -- two data-plane workers -------------------------------------------------------------------------
