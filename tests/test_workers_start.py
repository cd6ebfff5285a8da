"""Starting `ztunnel proxy`'s processes: addresses in use, two at once, starts in a row, the worker
count, and what an extra idle worker costs."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.waiting import eventually
from tests.worker_mesh import (
    CLIENT,
    CLIENT_ONLY,
    NET,
    ControlPlane,
    cert_helpers,
    children,
    control_plane_fixture,  # noqa: F401 (a fixture)
    echo_fixture,  # noqa: F401 (a fixture)
    exchange,
    launch,
    proxy_env,
    stop,
    wait_ready,
)

pytestmark = pytest.mark.timeout(120)


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
            # Idle: the workload's certificate made (asked for at start-up) and the helper that made
            # it gone.
            eventually(
                lambda p=proxy: [c["state"] for c in p.dump()["certificates"]] == ["Available"],
                "the workload's certificate",
            )
            eventually(lambda p=proxy: not cert_helpers(p.process.pid), "the certificate helper to exit")
            pids = [proxy.process.pid, *children(proxy.process.pid)]
            assert len(pids) == workers + 1
            totals[workers] = sum(pss_kib(p) for p in pids)
        finally:
            stop(proxy)
    extra = totals[2] - totals[1]
    print(f"idle PSS, parent + workers: 1 worker {totals[1]} KiB, 2 workers {totals[2]} KiB")
    assert extra <= 12 * 1024, totals


def mapped_libraries(pid: int) -> set[str]:
    """The file names of the shared objects `pid` maps (its extension modules among them)."""
    with open(f"/proc/{pid}/maps") as f:
        paths = {line.split(maxsplit=5)[5].strip() for line in f if len(line.split(maxsplit=5)) == 6}
    return {os.path.basename(p) for p in paths if ".so" in os.path.basename(p)}


# Extension modules of the control side: gRPC's core, protobuf's, PyYAML's, and cryptography's (which
# only the certificate helper loads, and the parent with a CRL file).
CONTROL_SIDE = {"cygrpc": "gRPC", "_message": "protobuf", "_yaml": "PyYAML", "_rust": "cryptography"}


def control_side_in(pid: int) -> list[str]:
    return sorted(
        CONTROL_SIDE[lib.split(".")[0]] for lib in mapped_libraries(pid) if lib.split(".")[0] in CONTROL_SIDE
    )


def test_workers_never_load_the_control_sides_libraries(control_plane: ControlPlane) -> None:
    """With xDS and the CA over gRPC, the parent holds protobuf and PyYAML, but neither grpcio (its
    gRPC client is our own, on the HTTP/2 core) nor cryptography (its certificate helper has it);
    the workers, forked before the parent imported them, map none."""
    xds = {"XDS_ADDRESS": f"http://{control_plane.address}", "CA_ADDRESS": f"http://{control_plane.address}"}
    proxy = launch(proxy_env("client", CLIENT, LOCAL_XDS=CLIENT_ONLY, **xds), CLIENT)
    try:
        wait_ready(proxy)
        # The workload's certificate came from the CA, keyed and checked by the helper.
        eventually(
            lambda: [c["state"] for c in proxy.dump()["certificates"]] == ["Available"], "the certificate"
        )
        assert control_side_in(proxy.process.pid) == ["PyYAML", "protobuf"]
        helpers = children(proxy.process.pid)
        assert len(helpers) == 2  # the two workers
        assert {pid: control_side_in(pid) for pid in helpers} == {pid: [] for pid in helpers}
        # Nor grpcio's Python side: nothing of the proxy imports it.
        for pid in (proxy.process.pid, *helpers):
            with open(f"/proc/{pid}/maps") as f:
                assert not [line for line in f if "cygrpc" in line], pid
    finally:
        stop(proxy)


def test_a_proxy_without_a_control_plane_never_loads_grpc(echo: None) -> None:
    proxy = launch(proxy_env("client", CLIENT, FAKE_CA="true", XDS_ADDRESS="", LOCAL_XDS=CLIENT_ONLY), CLIENT)
    try:
        wait_ready(proxy)
        assert exchange(CLIENT, b"no control plane") == b"no control plane"
        for pid in (proxy.process.pid, *children(proxy.process.pid)):
            assert not {"gRPC", "protobuf"} & set(control_side_in(pid)), pid
    finally:
        stop(proxy)


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
