"""Pod churn and metric series: thousands of pods pass through the state (the development control
plane's file rewritten, round after round) while a live proxy (two worker processes) opens a
connection to each and `/metrics` is scraped. The series of pods that have left the state and carry
no connection are dropped after `METRICS_STALE_SERIES_GRACE_PERIOD`, so their number stays bounded;
the counters of workloads still present never go backwards, and a connection held to a pod that
has left keeps its series until it closes."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.liveproxy import (
    LiveProxy,
    Output,
    echo_server,
    live_proxy,
    loopback_net,
    proxy_env,
    socks5,
    socks5_reply,
)
from tests.test_metrics_live import Samples, scrape, value
from tests.waiting import eventually

pytestmark = pytest.mark.timeout(300)

NET = loopback_net()
PROXY, SERVER, CP_HOST, HELD = f"{NET}.2", f"{NET}.3", f"{NET}.4", f"{NET}.250"
APP_PORT, CLOSED_PORT = 7000, 7001  # the server's echo; a port nothing listens on
ROUNDS, PODS = 20, 100  # 2000 pods through the state, a connection to each
GRACE = 1.0
FAMILIES = 5  # a refused connection's series: opened, closed and failed (CONNECT), both byte counters


def workload(name: str, ip: str, protocol: str = "TCP") -> str:
    return f"""
  - uid: k//v1/Pod/demo/{name}
    name: {name}
    namespace: demo
    serviceAccount: {name}
    trustDomain: cluster.local
    workloadIps: ["{ip}"]
    protocol: {protocol}"""


def pod_ip(i: int) -> str:
    return f"{NET}.{10 + i}"


def mesh(pods: list[str], held: bool = False) -> str:
    stable = workload("client", PROXY, "HBONE") + workload("server", SERVER)
    churned = "".join(workload(name, pod_ip(i)) for i, name in enumerate(pods))
    return "workloads:" + stable + churned + (workload("pod-held", HELD) if held else "") + "\n"


@dataclass
class Scene:
    proxy: LiveProxy
    config: Path


def write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.rename(path)  # the control plane reads a whole file


@pytest.fixture(scope="module")
def scene(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scene]:
    tmp = tmp_path_factory.mktemp("churn")
    config = tmp / "mesh.yaml"
    write(config, mesh([]))
    with socket.socket() as s:
        s.bind((CP_HOST, 0))
        address = f"{CP_HOST}:{s.getsockname()[1]}"
    with ExitStack() as stack:
        process = subprocess.Popen(
            [sys.executable, "-m", "ztunnel", "control-plane",
             "--config", str(config), "--listen", address, "--ca-dir", str(tmp / "ca")],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        stack.callback(lambda: (process.terminate(), process.wait(timeout=10)))
        assert process.stdout is not None
        seen: list[str] = []
        while not any("root certificate:" in line for line in seen):
            line = process.stdout.readline()
            assert line, "control plane exited: " + "".join(seen)
            seen.append(line)
        Output(process.stdout)
        stack.enter_context(echo_server(SERVER, APP_PORT))
        stack.enter_context(echo_server(HELD, APP_PORT))
        env = proxy_env(
            "demo/client/client",
            PROXY,
            "",
            XDS_ADDRESS=f"http://{address}",
            METRICS_STALE_SERIES_GRACE_PERIOD=f"{GRACE}s",
        )
        yield Scene(stack.enter_context(live_proxy(env)), config)


def pod_series(samples: Samples) -> int:
    return sum(1 for _, labels, _ in samples if labels.get("destination_workload", "").startswith("pod-"))


def workloads_known(proxy: LiveProxy, names: list[str]) -> bool:
    status, body = proxy.get(15000, "/config_dump")
    return status == 200 and all(f'"name": "{n}"' in body for n in names)


def test_series_of_churned_pods_stay_bounded_and_present_counters_never_go_back(scene: Scene) -> None:
    proxy = scene.proxy
    stable = {"destination_workload": "server", "response_flags": "-"}
    to_server = 0
    last_stable = 0.0
    most = 0
    held: socket.socket | None = None
    for r in range(ROUNDS):
        pods = [f"pod-{r}-{i}" for i in range(PODS)]
        write(scene.config, mesh(pods, held=r == 0))
        eventually(
            lambda pods=pods: workloads_known(proxy, pods), f"round {r}'s pods in the state", timeout=20
        )
        time.sleep(0.2)  # the workers' copies follow the supervisor's on the same channel
        before: Samples = scrape(proxy)
        for i in range(PODS):
            s, code = socks5_reply(PROXY, pod_ip(i), CLOSED_PORT)
            s.close()
            assert code != 0  # refused: nothing listens there, the series still count it
        if r == 0:  # held through every round: its pod leaves the state after this one
            held = socks5(PROXY, HELD, APP_PORT)
        with socks5(PROXY, SERVER, APP_PORT) as s:
            s.sendall(b"x")
            assert s.recv(1) == b"x"
        to_server += 1
        last = f"pod-{r}-{PODS - 1}"
        eventually(
            lambda last=last: value(
                scrape(proxy), "istio_tcp_connections_opened_total", destination_workload=last
            ),
            "the round's connections counted",
        )
        samples = scrape(proxy)
        # Without dropping there would be (r + 1) * PODS * FAMILIES series of pods by now; with a
        # grace period of a second, a few rounds' worth at most.
        assert pod_series(samples) <= 4 * PODS * FAMILIES, (r, pod_series(samples))
        most = max(most, pod_series(samples))
        # The stable workload's counters only grow; this round's pods' too, while present.
        now_stable = value(samples, "istio_tcp_connections_opened_total", **stable)
        assert now_stable >= last_stable
        last_stable = now_stable
        for i in (0, PODS // 2, PODS - 1):
            mine = {"destination_workload": f"pod-{r}-{i}"}
            assert value(samples, "istio_tcp_connections_opened_total", **mine) >= value(
                before, "istio_tcp_connections_opened_total", **mine
            )
            assert value(samples, "istio_tcp_connections_opened_total", **mine) == 1
    # The pod of the held connection left the state long ago: its series stay while it is open.
    assert held is not None
    assert value(scrape(proxy), "istio_tcp_connections_opened_total", destination_workload="pod-held") == 1
    held.sendall(b"y")
    assert held.recv(1) == b"y"
    held.close()
    assert most >= PODS * FAMILIES  # this round's own, at least
    write(scene.config, mesh([]))
    eventually(lambda: workloads_known(proxy, []) and pod_series(scrape(proxy)) == 0, "the pods' series gone")
    samples = scrape(proxy)
    assert value(samples, "istio_tcp_connections_opened_total", **stable) == to_server
    assert value(samples, "istio_tcp_connections_opened_total", destination_workload="client") == 0
