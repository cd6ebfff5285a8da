"""What `/metrics` of a live `ztunnel proxy` (a supervisor and its worker processes)
says of the whole proxy, checked against what the OS and the traffic say: `process_*` summed over
every process, a worker killed outright leaving every gauge, the event loops' own figures per
worker, and the `H2_HANDSHAKE_FAILURE` flag of an HBONE upstream that never speaks HTTP/2."""

from __future__ import annotations

import os
import re
import signal
import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from hbone.identity import Identity
from tests.apps import echo_server, loopback_net, socks5, socks5_reply
from tests.harness import Fleet, Proxy, proxy_env
from tests.procs import open_fds, proportional_memory
from tests.waiting import eventually
from ztunnel.identity.certificates import FakeCA

pytestmark = pytest.mark.timeout(180)

NET = loopback_net()
PROXY, SERVER, PLAIN = f"{NET}.2", f"{NET}.3", f"{NET}.4"

MESH = f"""
workloads:
  - uid: k//v1/Pod/demo/client
    name: client
    namespace: demo
    serviceAccount: client
    trustDomain: cluster.local
    workloadIps: ["{PROXY}"]
    protocol: HBONE
  - uid: k//v1/Pod/demo/server
    name: server
    namespace: demo
    serviceAccount: server
    trustDomain: cluster.local
    workloadIps: ["{SERVER}"]
    protocol: HBONE
"""

Samples = list[tuple[str, dict[str, str], float]]


def scrape(proxy: Proxy) -> Samples:
    out: Samples = []
    for line in proxy.metrics_text().splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)$", line)
        if m:
            labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
            out.append((m.group(1), labels, float(m.group(3))))
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    return sum(v for n, have, v in samples if n == name and all(have.get(k) == w for k, w in labels.items()))


def workers(proxy: Proxy) -> list[dict[str, object]]:
    return list(proxy.worker_entries())


@pytest.fixture(scope="module")
def proxy(module_fleet: Fleet) -> Iterator[Proxy]:
    with echo_server(PLAIN, 7000):
        [p] = module_fleet.start_all(proxy_env(PROXY, "demo/client/client", MESH))
        yield p


def test_process_families_cover_every_process_and_leave_with_a_killed_worker(proxy: Proxy) -> None:
    """40 connections held through the proxy (each a socket accepted and one dialled, in a worker):
    `process_open_fds` grows by both; it is what the kernel lists for the proxy's processes; a worker
    killed outright takes its sockets out of every gauge, and the CPU seconds never go back."""
    # The workload's certificate, asked for at start-up, is made by a helper process, counted while
    # it runs: the figures are compared with the kernel's once it has left (2 s after its work).
    eventually(lambda: not proxy.cert_helpers() and not proxy.exiting(), "the certificate helper to leave")
    base = scrape(proxy)
    base_fds = value(base, "process_open_fds")
    assert base_fds == pytest.approx(open_fds(proxy.pids()), abs=4)
    held = [socks5(PROXY, PLAIN, 7000) for _ in range(40)]
    try:
        eventually(lambda: value(scrape(proxy), "istio_tcp_sockets_open", reporter="source") == 40, "40 open")
        loaded = scrape(proxy)
        # Both sockets of each (80, not 40), give or take the few a process opens and closes on its own
        # (the same slack as the comparison with the kernel's count).
        assert value(loaded, "process_open_fds") >= base_fds + 80 - 4
        assert value(loaded, "process_open_fds") == pytest.approx(open_fds(proxy.pids()), abs=4)
        # Memory: more than the supervisor's own; CPU: at least what the workers spent.
        memory = value(loaded, "process_resident_memory_bytes")
        assert memory > proportional_memory([proxy.pid])
        assert memory == pytest.approx(proportional_memory(proxy.pids()), rel=0.1)
        ticks = os.sysconf("SC_CLK_TCK")
        spent = 0.0
        for p in proxy.pids():
            parts = Path(f"/proc/{p}/stat").read_bytes().rpartition(b")")[2].split()
            spent += (int(parts[11]) + int(parts[12])) / ticks
        assert value(scrape(proxy), "process_cpu_seconds_total") >= spent - 0.05
        assert value(loaded, "process_cpu_seconds_total") >= value(base, "process_cpu_seconds_total")

        # Kill the worker holding the most, as the OOM killer would.
        listed = workers(proxy)
        victim = max(listed, key=lambda w: int(str(w["connectionsOpened"])))
        killed = int(str(victim["connectionsOpened"]))
        assert killed > 0
        before_cpu = value(scrape(proxy), "process_cpu_seconds_total")
        os.kill(int(str(victim["pid"])), signal.SIGKILL)
        survivors = 40 - killed

        def settled() -> bool:
            now = scrape(proxy)
            return (
                value(now, "istio_tcp_sockets_open", reporter="source") == survivors
                and value(now, "process_open_fds") <= value(loaded, "process_open_fds") - 2 * killed + 30
            )

        eventually(settled, "the killed worker's sockets gone from the gauges", timeout=20)
        # The replacement is a new interpreter, opening its files while it starts: the gauge and
        # the kernel's list are compared until they meet, each read as the other is.
        eventually(
            lambda: abs(value(scrape(proxy), "process_open_fds") - open_fds(proxy.pids())) <= 4,
            "process_open_fds to match the fds the kernel lists for the proxy's processes",
        )
        after = scrape(proxy)
        assert value(after, "process_cpu_seconds_total") >= before_cpu  # its CPU stays counted
        assert int(str(victim["pid"])) not in proxy.pids()
    finally:
        for s in held:
            s.close()
    eventually(lambda: value(scrape(proxy), "istio_tcp_sockets_open", reporter="source") == 0, "all closed")


def _tls_then_no_http2(tmp: Path) -> tuple[socket.socket, threading.Thread]:
    """A server on the destination's HBONE port that completes TLS 1.3 (ALPN h2, the server's own
    identity from the mesh's CA) and then closes without ever sending its HTTP/2 SETTINGS."""
    cert = FakeCA().issue(Identity("cluster.local", "demo", "server"))
    (tmp / "cert.pem").write_bytes(b"".join(cert.chain_pem))
    (tmp / "key.pem").write_bytes(cert.key_pem)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(tmp / "cert.pem", tmp / "key.pem")
    ctx.set_alpn_protocols(["h2"])
    listener = socket.create_server((SERVER, 15008))

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            try:
                with ctx.wrap_socket(conn, server_side=True) as tls:
                    tls.unwrap()  # close_notify right after the handshake: no SETTINGS
            except (OSError, ssl.SSLError):
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener, thread


def test_an_http2_handshake_failure_is_flagged(proxy: Proxy, tmp_path: Path) -> None:
    """TLS succeeds but no HTTP/2 connection follows: `H2_HANDSHAKE_FAILURE` on the closed and failed
    counters, and the access log's error says what failed."""
    listener, _ = _tls_then_no_http2(tmp_path)
    try:
        s, code = socks5_reply(PROXY, SERVER, 8080)
        s.close()
        assert code != 0
        flagged = {"reporter": "source", "response_flags": "H2_HANDSHAKE_FAILURE"}
        eventually(
            lambda: value(scrape(proxy), "istio_tcp_connections_failed_total", **flagged) == 1, "the failure"
        )
        samples = scrape(proxy)
        assert value(samples, "istio_tcp_connections_closed_total", **flagged) == 1
        assert value(samples, "istio_tcp_connections_failed_total", destination_workload="server") == 1

        def logged() -> list[str]:
            return [
                line
                for line in proxy.log().splitlines()
                if '"connection complete"' in line and "http2 handshake error" in line
            ]

        eventually(logged, "the access log line")
        [line] = logged()
        assert "\terror\taccess" in line and 'dst.workload="server"' in line, line
    finally:
        listener.close()


def test_each_workers_event_loop_reports_its_lag_tasks_and_busy_time(proxy: Proxy) -> None:
    """Per worker index: a worker stopped for a second (SIGSTOP) shows a tick that late, the other
    none; a connection being set up is a task; the loops' busy time is part of the proxy's CPU."""
    # The module's proxy may still be replacing the worker an earlier test killed: both ready first.
    eventually(lambda: [w["state"] for w in workers(proxy)] == ["ready", "ready"], "both workers ready")
    listed = {int(str(w["index"])): int(str(w["pid"])) for w in workers(proxy)}
    assert sorted(listed) == [0, 1]
    eventually(lambda: value(scrape(proxy), "ztunnel_event_loop_lag_seconds_count", worker="1") >= 4, "ticks")

    def late(samples: Samples, worker: str) -> float:
        """Ticks more than half a second late."""
        every = value(samples, "ztunnel_event_loop_lag_seconds_count", worker=worker)
        return every - value(samples, "ztunnel_event_loop_lag_seconds_bucket", worker=worker, le="0.5")

    before = scrape(proxy)
    os.kill(listed[1], signal.SIGSTOP)
    try:
        threading.Event().wait(1.2)  # the stimulus: the worker stopped this long, not a wait
    finally:
        os.kill(listed[1], signal.SIGCONT)
    eventually(lambda: late(scrape(proxy), "1") == late(before, "1") + 1, "worker 1's late tick")
    assert late(scrape(proxy), "0") == late(before, "0")

    # A connection is a task while its handler runs (here: SOCKS5 clients that have not spoken yet);
    # once carried it is callbacks only, counted by `istio_tcp_sockets_open`.
    idle = scrape(proxy)
    silent = [socket.create_connection((PROXY, 15080)) for _ in range(20)]
    try:

        def tasks(samples: Samples) -> float:
            return value(samples, "ztunnel_event_loop_tasks")

        eventually(lambda: tasks(scrape(proxy)) >= tasks(idle) + 20, "a task per silent client")
        samples = scrape(proxy)
        for index in listed:
            assert (
                value(samples, "ztunnel_event_loop_tasks", worker=str(index)) >= 2
            )  # its own reader, pusher
            assert value(samples, "ztunnel_event_loop_busy_seconds_total", worker=str(index)) > 0
        # A worker index's busy time includes its killed predecessors' (a counter): all of it is
        # part of the proxy's CPU time.
        busy = value(samples, "ztunnel_event_loop_busy_seconds_total")
        assert busy <= value(samples, "process_cpu_seconds_total")
    finally:
        for s in silent:
            s.close()
    eventually(lambda: tasks(scrape(proxy)) <= tasks(idle) + 2, "the tasks done")
