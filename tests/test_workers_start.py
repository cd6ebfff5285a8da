"""Starting `ztunnel proxy`'s processes: addresses in use, two at once, starts in a row, the worker
count, and what an extra idle worker costs."""

from __future__ import annotations

import os
import re

import pytest

from tests.harness import ControlPlane, Fleet
from tests.procs import cmdline
from tests.waiting import eventually
from tests.xds_mesh import (
    CLIENT,
    CLIENT_ONLY,
    NET,
    client_alone,
    control_plane_fixture,  # noqa: F401 (a fixture)
    echo_fixture,  # noqa: F401 (a fixture)
    exchange,
)

pytestmark = pytest.mark.timeout(120)


def test_a_second_proxy_on_addresses_in_use_fails_with_one_line(fleet: Fleet, echo: None) -> None:
    first = fleet.proxy(client_alone())
    try:
        first.start()
        # Same proxy addresses, its own admin ports: only the listeners conflict.
        other = f"{NET}.4"
        env = client_alone(
            ADMIN_ADDRESS=f"{other}:15000", STATS_ADDRESS=f"{other}:15020", READINESS_ADDRESS=f"{other}:15021"
        )
        second = fleet.proxy(env)
        second.spawn()
        assert second.wait_exit(30) != 0
        errors = [line for line in second.log().splitlines() if "failed to bind" in line]
        assert len(errors) == 1 and f"{CLIENT}:15001" in errors[0], second.log()
        assert "Traceback" not in second.log()
        # The first one never shared its ports: it still serves every connection.
        for i in range(10):
            assert exchange(CLIENT, f"first {i}".encode()) == f"first {i}".encode()
        assert first.metric("istio_tcp_connections_opened_total") == 10
    finally:
        first.stop()


def test_two_proxies_started_at_once_on_the_same_addresses_one_wins(fleet: Fleet, echo: None) -> None:
    procs = []
    for other in (f"{NET}.5", f"{NET}.6"):
        env = client_alone(
            ADMIN_ADDRESS=f"{other}:15000", STATS_ADDRESS=f"{other}:15020", READINESS_ADDRESS=f"{other}:15021"
        )
        procs.append(fleet.proxy(env))
        procs[-1].spawn()
    try:
        eventually(lambda: sum(not p.running() for p in procs) >= 1, "one of them to exit")
        losers = [p for p in procs if not p.running()]
        assert len(losers) == 1 and losers[0].returncode != 0
        winner = next(p for p in procs if p.running())
        winner.wait_ready()
        assert "failed to bind the proxy listeners" in losers[0].log()
    finally:
        for p in procs:
            p.stop()


def pss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        m = re.search(r"^Pss:\s+(\d+) kB", f.read(), re.M)
    assert m is not None
    return int(m.group(1))


def test_idle_memory_of_an_extra_worker(fleet: Fleet, echo: None) -> None:
    totals = {}
    for workers in (1, 2):
        proxy = fleet.proxy(client_alone(ZTUNNEL_WORKER_THREADS=str(workers)))
        try:
            proxy.start()
            assert exchange(CLIENT, b"warm") == b"warm"
            # Idle: the workload's certificate made (asked for at start-up) and the helper that made
            # it gone.
            eventually(
                lambda p=proxy: [c["state"] for c in p.config_dump()["certificates"]] == ["Available"],
                "the workload's certificate",
            )
            eventually(lambda p=proxy: not p.cert_helpers(), "the certificate helper to exit")
            pids = [proxy.pid, *proxy.workers()]
            assert len(pids) == workers + 1
            totals[workers] = sum(pss_kib(p) for p in pids)
        finally:
            proxy.stop()
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


def code_resident_kib(pid: int) -> dict[str, int]:
    """KiB of each shared object's code (its executable mappings) that `pid` has in memory, by the
    object's name up to its first dot: only what that process ran or read of it since it began."""
    resident: dict[str, int] = {}
    name = None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            fields = line.split()
            if not fields[0].endswith(":"):  # a mapping's first line: range, permissions, ..., path
                path = fields[5] if len(fields) > 5 else ""
                name = os.path.basename(path).split(".")[0] if ".so" in path and "x" in fields[1] else None
                if name is not None:
                    resident.setdefault(name, 0)
            elif name is not None and fields[0] == "Rss:":
                resident[name] += int(fields[1])
    return resident


def test_workers_share_the_control_side_and_never_run_it(fleet: Fleet, control_plane: ControlPlane) -> None:
    """With xDS and the CA over gRPC, the parent holds protobuf and PyYAML, but neither grpcio (its
    gRPC client is our own, on the HTTP/2 core) nor cryptography (its certificate helper has it).
    It imports them before it forks the workers, which so map them too, shared, but never run them:
    none of their code is in a worker's memory. And the parent loads no native module after the
    fork (importing after it made the parent copy pages of the shared memory)."""
    proxy = fleet.proxy({**control_plane.wire(client_alone()), "LOCAL_XDS": CLIENT_ONLY})
    try:
        proxy.start()
        # The workload's certificate came from the CA, keyed and checked by the helper.
        eventually(
            lambda: [c["state"] for c in proxy.config_dump()["certificates"]] == ["Available"],
            "the certificate",
        )
        assert control_side_in(proxy.pid) == ["PyYAML", "protobuf"]
        helpers = proxy.workers()
        assert len(helpers) == 2  # the two workers
        assert {pid: control_side_in(pid) for pid in helpers} == {
            pid: ["PyYAML", "protobuf"] for pid in helpers
        }
        for pid in helpers:
            code = code_resident_kib(pid)
            assert (code["_message"], code["_yaml"]) == (0, 0), pid
            assert mapped_libraries(proxy.pid) <= mapped_libraries(pid), pid
        # Nor grpcio's Python side: nothing of the proxy imports it.
        for pid in (proxy.pid, *helpers):
            with open(f"/proc/{pid}/maps") as f:
                assert not [line for line in f if "cygrpc" in line], pid
    finally:
        proxy.stop()


def test_a_proxy_without_a_control_plane_never_loads_grpc(fleet: Fleet, echo: None) -> None:
    proxy = fleet.proxy(client_alone())
    try:
        proxy.start()
        assert exchange(CLIENT, b"no control plane") == b"no control plane"
        for pid in (proxy.pid, *proxy.workers()):
            assert not {"gRPC", "protobuf"} & set(control_side_in(pid)), pid
    finally:
        proxy.stop()


@pytest.mark.parametrize("optimize", [None, "0"], ids=["default", "PYTHONOPTIMIZE=0"])
def test_every_process_runs_without_docstrings_unless_told(
    fleet: Fleet, echo: None, optimize: str | None
) -> None:
    """`ztunnel proxy` re-executes itself as `python -OO` (its docstrings are memory it never uses),
    and its workers are forked from it; `PYTHONOPTIMIZE` set leaves the interpreter as started."""
    proxy = fleet.proxy(client_alone() if optimize is None else client_alone(PYTHONOPTIMIZE=optimize))
    try:
        proxy.start()
        assert exchange(CLIENT, b"served") == b"served"
        processes = [proxy.pid, *proxy.workers()]
        assert len(processes) == 3
        assert {pid: "-OO" in cmdline(pid) for pid in processes} == {
            pid: optimize is None for pid in processes
        }
    finally:
        proxy.stop()


def test_starts_in_a_row_with_xds(fleet: Fleet, control_plane: ControlPlane) -> None:
    """Start-up never fails on a race with gRPC (fork before any gRPC thread): N starts in a row."""
    runs = int(os.environ.get("ZTUNNEL_TEST_STARTS", "5"))
    for i in range(runs):
        proxy = fleet.proxy(control_plane.wire(client_alone()))
        try:
            proxy.start()
        finally:
            code = proxy.stop()
        assert code == 0, f"start {i + 1} of {runs}: exit {code}"
        assert "Check failed" not in proxy.log() and "skipping fork()" not in proxy.log()


def test_the_worker_count_follows_the_cpu_limit_by_default(fleet: Fleet, echo: None) -> None:
    env = client_alone(ZTUNNEL_CPU_LIMIT="12")
    del env["ZTUNNEL_WORKER_THREADS"]
    proxy = fleet.proxy(env)
    try:
        proxy.start()
        workers = proxy.worker_entries()
        assert [w["index"] for w in workers] == [0, 1, 2]  # 25 % of 12 CPUs
        assert all(w["state"] == "ready" for w in workers)
    finally:
        proxy.stop()
