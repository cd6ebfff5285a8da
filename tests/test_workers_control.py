"""The control process reaching every worker: the log filter set over admin, readiness of a stuck
worker, the CPU profile, on-demand xDS through the parent's stream."""

from __future__ import annotations

import gzip
import os
import signal
import threading
import urllib.error
import urllib.request
from types import ModuleType

import pytest

from tests.harness import ControlPlane, Fleet
from tests.profiles import functions_in
from tests.waiting import eventually
from tests.xds_mesh import (
    CLIENT,
    CLIENT_ONLY,
    SERVER,
    client_alone,
    control_plane_fixture,  # noqa: F401 (a fixture)
    echo_fixture,  # noqa: F401 (a fixture)
    exchange,
    proxy_env,
)

pytestmark = pytest.mark.timeout(120)


def test_a_log_filter_set_over_admin_reaches_every_worker(fleet: Fleet, echo: None) -> None:
    proxy = fleet.proxy(client_alone())

    def post(query: str) -> str:
        req = urllib.request.Request(f"http://{CLIENT}:15000/logging?{query}", method="POST")
        with urllib.request.urlopen(req, timeout=5) as r:
            return str(r.read().decode())

    def completed() -> int:
        return proxy.log().count('"connection complete"')

    try:
        proxy.start()
        assert exchange(CLIENT, b"logged") == b"logged"
        eventually(lambda: completed() == 1, "the first access-log line")
        assert "access=off" in post("level=access=off")
        for i in range(16):  # over both workers
            assert exchange(CLIENT, f"quiet {i}".encode()) == f"quiet {i}".encode()
        assert "access=info" in post("level=access=info")
        assert exchange(CLIENT, b"logged again") == b"logged again"
        # The quiet connections were over before this one began: only its line is new.
        eventually(lambda: completed() >= 2, "the access-log line after the filter came back")
        assert completed() == 2, proxy.log()
        assert proxy.metric("istio_tcp_connections_opened_total") == 18
    finally:
        proxy.stop()


def test_a_stuck_worker_makes_the_proxy_unready_until_it_answers_again(fleet: Fleet, echo: None) -> None:
    proxy = fleet.proxy(client_alone())
    try:
        proxy.start()
        stuck = proxy.worker_entries()[1]
        os.kill(stuck["pid"], signal.SIGSTOP)  # alive, its listeners open, but nothing runs
        try:
            eventually(lambda: proxy.readiness_answer()[0] == 500, "readiness down", timeout=15)
            assert proxy.worker_entries()[1]["state"] == "unresponsive"
            assert "proxy" in proxy.readiness_answer()[1]
        finally:
            os.kill(stuck["pid"], signal.SIGCONT)
        eventually(proxy.ready, "readiness back once it answers")
        again = proxy.worker_entries()[1]
        assert (again["pid"], again["state"], again["restarts"]) == (stuck["pid"], "ready", 0)  # not replaced
    finally:
        proxy.stop()


def test_a_cpu_profile_samples_the_parent_and_every_worker(
    fleet: Fleet, echo: None, profile_pb2: ModuleType
) -> None:
    """`/debug/pprof/profile` on the parent: one pprof document with every process's samples, each
    labelled with its pid (decoded here with the published profile.proto)."""
    proxy = fleet.proxy(client_alone())
    try:
        proxy.start()
        pids = {int(w["pid"]) for w in proxy.worker_entries()} | {proxy.pid}
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
        proxy.stop()


def test_on_demand_xds_is_asked_by_the_workers_through_the_parents_stream(
    fleet: Fleet, echo: None, control_plane: ControlPlane
) -> None:
    """XDS_ON_DEMAND=true: the client knows only itself; the worker that takes a connection to the
    server asks the parent, whose one stream asks the control plane, and reaches it over HBONE."""
    server = fleet.proxy(control_plane.wire(proxy_env(SERVER, "demo/server/server", INSTANCE_IP=SERVER)))
    client_env = control_plane.wire(
        client_alone(INSTANCE_IP=CLIENT, XDS_ON_DEMAND="true", ISTIO_META_DNS_CAPTURE="false")
    )
    client = fleet.proxy({**client_env, "LOCAL_XDS": CLIENT_ONLY})
    try:
        for proxy in (server, client):
            proxy.start()
        known = {ip for w in client.config_dump()["workloads"] for ip in w.get("workloadIps", [])}
        assert SERVER not in known
        for i in range(6):  # whichever worker takes it
            assert exchange(CLIENT, f"on demand {i}".encode()) == f"on demand {i}".encode()
        # Over HBONE: the server's proxy took every one of them.
        assert server.metric("istio_tcp_connections_opened_total", reporter="destination") == 6
        known = {ip for w in client.config_dump()["workloads"] for ip in w.get("workloadIps", [])}
        assert SERVER in known
        assert control_plane.streams_opened(CLIENT) == 1, control_plane.log()
    finally:
        for proxy in (client, server):
            proxy.stop()
