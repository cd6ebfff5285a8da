"""One control process and its data-plane workers, dedicated mode, as real processes, serving:
one xDS stream and one certificate per identity, connections spread over the workers and metrics
summed, a policy reaching every worker, a killed worker replaced, the drain, the parent's exit.
What is checked is what an operator sees."""

from __future__ import annotations

import os
import signal

import pytest

from tests.procs import alive, cmdline
from tests.waiting import eventually
from tests.xds_mesh import (
    CLIENT,
    DENY_CLIENT,
    MESH,
    SERVER,
    TD,
    Mesh,
    control_plane_fixture,  # noqa: F401 (a fixture)
    echo_fixture,  # noqa: F401 (a fixture)
    echoes,
    exchange,
    mesh_fixture,  # noqa: F401 (a fixture)
    opened_per_worker,
    refused,
    socks5_reply,
    spread,
)

pytestmark = pytest.mark.timeout(120)

# -- the tests ------------------------------------------------------------------------------------


def test_one_xds_stream_and_one_certificate_request_per_identity(mesh: Mesh) -> None:
    # The workload's certificate is asked for at start-up, before any connection needs it.
    for proxy, name in ((mesh.client, "client"), (mesh.server, "server")):
        eventually(
            lambda p=proxy, n=name: (
                [(c["identity"], c["state"]) for c in p.config_dump()["certificates"]]  # type: ignore[misc]
                == [(f"spiffe://{TD}/ns/demo/sa/{n}", "Available")]
            ),
            f"{name}'s certificate prefetched",
        )
    for proxy in (mesh.client, mesh.server):
        pids = {w["pid"] for w in proxy.worker_entries()}
        assert len(pids) == 2 and proxy.pid not in pids
        assert set(proxy.workers()) >= pids
    # Traffic through every worker of both proxies: each needed its workload's certificate.
    spread(mesh, mesh.client)
    eventually(
        lambda: all(c > 0 for c in opened_per_worker(mesh.server).values()), "both server workers used"
    )
    # One stream per proxy process (its node id names the instance), never one per worker.
    assert mesh.cp.streams_opened(CLIENT) == 1, mesh.cp.log()
    assert mesh.cp.streams_opened(SERVER) == 1, mesh.cp.log()
    assert mesh.cp.streams_opened() == 2
    for name in ("client", "server"):
        assert mesh.cp.certificates_issued(f"spiffe://{TD}/ns/demo/sa/{name}") == 1, mesh.cp.log()
    # The parent holds the certificates and shows them.
    certs = mesh.client.config_dump()["certificates"]
    assert [(c["identity"], c["state"]) for c in certs] == [(f"spiffe://{TD}/ns/demo/sa/client", "Available")]
    assert certs[0]["certChain"] and certs[0]["rootCerts"]


def test_connections_are_served_by_both_workers_and_metrics_are_summed(mesh: Mesh) -> None:
    n = 40
    for i in range(n):
        payload = f"hello {i}".encode() * 100
        assert exchange(CLIENT, payload) == payload
    # A scrape collects every worker's counters at once: exact right after the traffic.
    assert mesh.client.metric("istio_tcp_connections_opened_total", reporter="source") == n
    assert mesh.server.metric("istio_tcp_connections_opened_total", reporter="destination") == n
    assert mesh.server.metric("istio_tcp_received_bytes_total", reporter="destination") == sum(
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
    eventually(lambda: mesh.server.log().count("connection closed due to policy change") >= len(held),
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
    victim = proxy.worker_entries()[0]
    os.kill(victim["pid"], signal.SIGKILL)
    eventually(lambda: not alive(victim["pid"]), "the worker's death")

    # From its death until its replacement accepts, readiness is never 200.
    statuses: list[tuple[int, str]] = []

    def replaced() -> bool:
        statuses.append(proxy.readiness_answer())
        w = proxy.worker_entries()[0]
        return bool(w["pid"] != victim["pid"] and w["state"] == "ready")

    # Meanwhile the connections of the other worker keep echoing, and new ones are served.
    survivors = [s for s in held if echoes(s, b"still there?")]
    assert exchange(CLIENT, b"new while one is down") == b"new while one is down"
    eventually(replaced, "the worker to be replaced", timeout=20)
    not_ready = statuses[:-1]
    assert not_ready and all(code == 500 and "proxy" in body for code, body in not_ready), statuses
    assert len(survivors) == survivors_expected
    assert all(echoes(s, b"and after") for s in survivors)
    restarted = proxy.worker_entries()[0]
    assert restarted["restarts"] == 1 and alive(restarted["pid"])
    assert "-OO" in cmdline(restarted["pid"])  # a new interpreter, run as its parent is
    assert proxy.ready()
    # The replacement serves too.
    before = opened_per_worker(proxy)[0]
    for i in range(16):
        assert exchange(CLIENT, f"after {i}".encode()) == f"after {i}".encode()
    eventually(lambda: opened_per_worker(proxy)[0] > before, "the new worker serving")


def test_stopping_the_parent_leaves_no_worker_behind(mesh: Mesh) -> None:
    assert len(mesh.client.workers()) == 2  # the two workers
    # and a certificate helper, while one runs: it goes with them
    left = mesh.client.pids()[1:]
    mesh.client.send(signal.SIGKILL)  # no chance to clean up: the workers go with it all the same
    mesh.client.wait_exit()
    eventually(lambda: not any(alive(p) for p in left), "the workers to exit")
    # A graceful stop: exit 0, nothing left.
    left = mesh.server.pids()[1:]
    assert mesh.server.terminate() == 0
    assert not any(alive(p) for p in left)


def test_a_drain_cuts_held_connections_at_its_deadline_in_every_worker(mesh: Mesh) -> None:
    """SIGTERM with connections held in both workers: new connections are refused, the held ones
    keep echoing until CONNECTION_TERMINATION_DEADLINE (1 s) and are then cut, each logged with
    the drain deadline; the proxy exits 0."""
    held = spread(mesh, mesh.client, n=8)
    mesh.client.send(signal.SIGTERM)
    assert all(echoes(s, b"during") for s in held)  # inside the deadline: still carried
    eventually(lambda: refused((CLIENT, 15080)), "new connections refused")
    assert mesh.client.wait_exit(20) == 0
    for s in held:
        s.settimeout(5)
        assert not echoes(s, b"after")
    lines = [line for line in mesh.client.log().splitlines() if "connection complete" in line]
    cut = [line for line in lines if 'error="connection closed: drain deadline"' in line]
    assert len(cut) == len(held), "\n".join(lines)
