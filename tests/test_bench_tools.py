"""The harness's C load tools (`benches/tools.c`), run for real on loopback: the `paced` command
sends the rate it was asked for, open loop (a stalled server shows in the latency of every request
it delayed, not only of the one in flight), reports what went wrong when the server is gone, and
refuses arguments it cannot honour."""

from __future__ import annotations

import json
import random
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benches import ctools
from tests.netns import require_tools


@pytest.fixture(scope="module")
def tools() -> Path:
    require_tools("gcc", hint="apt-get install gcc libc6-dev")
    return ctools.build()


def _free_address() -> tuple[str, int]:
    host = f"127.{random.randint(1, 254)}.{random.randint(1, 254)}.{random.randint(1, 254)}"
    with socket.socket() as s:
        s.bind((host, 0))
        return host, s.getsockname()[1]


@pytest.fixture
def echo(tools: Path) -> Iterator[tuple[subprocess.Popen[str], str, int]]:
    host, port = _free_address()
    proc = subprocess.Popen([str(tools), "echo", host, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield proc, host, port
    finally:
        proc.send_signal(signal.SIGCONT)  # a test may leave it stopped
        proc.kill()
        proc.wait()


def _paced(
    tools: Path, host: str, port: int, rate: float, seconds: float, conns: int = 4, size: int = 1024
) -> subprocess.Popen[str]:
    argv = [str(tools), "paced", host, str(port), str(rate), str(seconds), str(conns), str(size)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen[str]) -> tuple[int, dict[str, Any], str]:
    out, err = proc.communicate(timeout=30)
    return proc.returncode, json.loads(out) if out.strip() else {}, err


def _check_percentiles(res: dict[str, Any]) -> None:
    assert 0 < res["p50_us"] <= res["p90_us"] <= res["p99_us"] <= res["max_us"], res
    assert 0 < res["mean_us"] <= res["max_us"], res


def test_paced_sends_the_asked_rate_over_its_connections(tools: Path, echo: Any) -> None:
    _, host, port = echo
    for rate, seconds in ((1000, 1.0), (400, 0.5)):
        t0 = time.monotonic()
        rc, res, err = _result(_paced(tools, host, port, rate, seconds))
        wall = time.monotonic() - t0
        assert rc == 0, err
        expected = rate * seconds
        assert res["planned"] == pytest.approx(expected, abs=4), res
        assert res["count"] == res["planned"] and res["errors"] == 0 and res["unsent"] == 0, res
        assert res["per_s"] == pytest.approx(rate, rel=0.01) and res["asked_per_s"] == rate
        assert res["connections"] == 4 and res["size"] == 1024
        # Paced, not as fast as it can: the window lasts what was asked, and so does the run.
        assert res["end_mono"] - res["start_mono"] == pytest.approx(seconds, abs=1e-3)
        assert t0 < res["start_mono"] < res["last_mono"] and wall >= seconds
        _check_percentiles(res)


def test_paced_counts_latency_from_each_request_intended_time(tools: Path, echo: Any) -> None:
    """The echo server stopped for 300 ms: a closed-loop client would see 4 slow requests (one per
    connection) and a clean p90; the open-loop one charges every request due during the stall."""
    server, host, port = echo
    stall: list[float] = []

    def stop_for_a_while() -> None:
        # When and how long the server stops is the stimulus (a machine too slow to overlap it with
        # the run is told apart below), not a wait.
        time.sleep(0.5)
        server.send_signal(signal.SIGSTOP)
        stall.append(time.monotonic())
        time.sleep(0.3)
        server.send_signal(signal.SIGCONT)
        stall.append(time.monotonic())

    proc = _paced(tools, host, port, 1000, 1.5)
    t = threading.Thread(target=stop_for_a_while)
    t.start()
    rc, res, err = _result(proc)
    t.join()
    assert rc == 0, err
    overlap = min(stall[1], res["end_mono"]) - max(stall[0], res["start_mono"])
    if overlap < 0.2:
        pytest.skip(f"the machine was too slow to stop the server inside the run ({overlap:.3f}s)")
    # Nothing is lost: the backlog goes once the server answers again.
    assert res["count"] == res["planned"] == 1500 and res["errors"] == 0, res
    _check_percentiles(res)
    assert res["max_us"] >= 0.8 * overlap * 1e6, res
    # overlap x 1,000 requests were due during the stall, waiting from 0 to `overlap`: the slowest
    # 10 % of the run (150 requests) all waited at least a quarter of it.
    assert res["p90_us"] >= 0.25 * overlap * 1e6, (res, overlap)


def established_to(port: int) -> int:
    """The established IPv4 TCP connections whose local port is `port` (what /proc/net/tcp lists)."""
    with open("/proc/net/tcp") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return sum(1 for r in rows if int(r[1].rsplit(":", 1)[1], 16) == port and r[3] == "01")


def test_paced_reports_a_dead_server(tools: Path, echo: Any) -> None:
    host, port = _free_address()
    rc, res, _ = _result(_paced(tools, host, port, 100, 0.5))
    assert rc == 1 and res == {"error": "connect: Connection refused"}

    server, host, port = echo
    proc = _paced(tools, host, port, 1000, 1.0)
    # The server dies once the run has begun (the client says so once its connections are up and
    # warmed: one refused before is a failure to start, exit 1), most of the run still due.
    assert proc.stderr is not None and proc.stderr.readline() == "running\n"
    assert established_to(port) == 4
    server.kill()
    server.wait()
    rc, res, err = _result(proc)
    assert rc == 0, err
    # Every request due after the server died failed (each reconnection refused); none is counted
    # as answered, and none was left out of the count.
    assert res["errors"] > 100 and res["count"] < res["planned"], res
    assert res["count"] + res["errors"] + res["unsent"] == res["planned"], res
    assert res["first_error"].startswith(("recv", "send", "connect")), res


def test_paced_refuses_arguments_it_cannot_honour(tools: Path) -> None:
    for args in (["0", "1", "4", "1024"], ["100", "1", "0", "1024"], ["100", "1", "4", "8"]):
        done = subprocess.run(
            [str(tools), "paced", "127.0.0.1", "9", *args], capture_output=True, text=True, timeout=10
        )
        assert done.returncode == 2 and done.stdout == "", args
        assert "1 <= CONNS <= 256" in done.stderr, args
