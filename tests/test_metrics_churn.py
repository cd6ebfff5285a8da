"""Pod churn and metric series: thousands of pods pass through the state (the development control
plane's file rewritten, round after round) while a live proxy (two worker processes) opens a
connection to each and `/metrics` is scraped. The series of pods that have left the state and carry
no connection are dropped after `METRICS_STALE_SERIES_GRACE_PERIOD`, so their number stays bounded;
the counters of workloads still present never go backwards, and a connection held to a pod that
has left keeps its series until it closes."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.apps import echo_server, loopback_net, socks5, socks5_reply
from tests.harness import Fleet, Proxy, proxy_env
from tests.test_metrics_live import Samples, scrape, value
from tests.waiting import eventually

pytestmark = pytest.mark.timeout(300)

NET = loopback_net()
PROXY, SERVER, CP_HOST, HELD, PROBE = f"{NET}.2", f"{NET}.3", f"{NET}.4", f"{NET}.250", f"{NET}.249"
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


def mesh(pods: list[str], held: bool = False, probe: str = "") -> str:
    """The state of a round: the stable workloads, its pods, and last its probe (see `known_to_every_worker`)."""
    stable = workload("client", PROXY, "HBONE") + workload("server", SERVER)
    churned = "".join(workload(name, pod_ip(i)) for i, name in enumerate(pods))
    last = (workload("pod-held", HELD) if held else "") + (workload(probe, PROBE) if probe else "")
    return "workloads:" + stable + churned + last + "\n"


OPENED = "istio_tcp_connections_opened_total"


def holder(pids: list[int], remote: tuple[str, int]) -> int | None:
    """Which of `pids` holds the TCP connection to `remote` (what /proc lists of their sockets)."""
    owners: dict[str, int] = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("socket:["):
                        owners[target[8:-1]] = pid
    ip, port = remote
    wanted = f"{socket.inet_aton(ip)[::-1].hex().upper()}:{port:04X}"
    with open("/proc/net/tcp") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return next((owners[r[9]] for r in rows if r[2] == wanted and r[9] in owners), None)


def known_to_every_worker(proxy: Proxy, probe: str) -> None:
    """Until each worker has carried a connection to the round's probe workload (the last of the
    round's state) labelled as that workload: each worker then holds the whole round (its copy
    follows the supervisor's in order). The kernel picks the worker of each connection; one held
    open says which it was, its series which name it was given (`unknown`: not known yet)."""
    labelled: set[int] = set()

    def one_more() -> bool:
        samples = scrape(proxy)
        mine = value(samples, OPENED, destination_workload=probe)
        seen = mine + value(samples, OPENED, destination_workload="unknown")
        with socks5(PROXY, PROBE, APP_PORT) as s:
            s.sendall(b"p")
            assert s.recv(1) == b"p"
            worker = holder(proxy.workers(), (PROBE, APP_PORT))
            eventually(
                lambda: (
                    value(now := scrape(proxy), OPENED, destination_workload=probe)
                    + value(now, OPENED, destination_workload="unknown")
                    > seen
                ),
                "the probe counted",
            )
            if worker is not None and value(scrape(proxy), OPENED, destination_workload=probe) > mine:
                labelled.add(worker)
        return labelled >= set(proxy.workers())

    eventually(one_more, f"every worker to know {probe}", timeout=60)


@dataclass
class Scene:
    proxy: Proxy
    config: Path


def write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.rename(path)  # the control plane reads a whole file


@pytest.fixture(scope="module")
def scene(tmp_path_factory: pytest.TempPathFactory, module_fleet: Fleet) -> Iterator[Scene]:
    cp = module_fleet.control_plane(tmp_path_factory.mktemp("churn"), CP_HOST, mesh([]))
    with echo_server(SERVER, APP_PORT), echo_server(HELD, APP_PORT), echo_server(PROBE, APP_PORT):
        # Workloads over xDS, certificates from the fake CA.
        env = proxy_env(
            PROXY, "demo/client/client", XDS_ADDRESS=cp.url, METRICS_STALE_SERIES_GRACE_PERIOD=f"{GRACE}s"
        )
        [proxy] = module_fleet.start_all(env)
        yield Scene(proxy, cp.config)


def pod_series(samples: Samples) -> int:
    return sum(1 for _, labels, _ in samples if labels.get("destination_workload", "").startswith("pod-"))


def workloads_known(proxy: Proxy, names: list[str]) -> bool:
    status, body = proxy.get("admin", "/config_dump")
    return status == 200 and all(f'"name": "{n}"' in body.decode() for n in names)


def test_series_of_churned_pods_stay_bounded_and_present_counters_never_go_back(scene: Scene) -> None:
    proxy = scene.proxy
    stable = {"destination_workload": "server", "response_flags": "-"}
    to_server = 0
    last_stable = 0.0
    most = 0
    held: socket.socket | None = None
    for r in range(ROUNDS):
        pods = [f"pod-{r}-{i}" for i in range(PODS)]
        write(scene.config, mesh(pods, held=r == 0, probe=f"probe-{r}"))
        eventually(
            lambda pods=pods: workloads_known(proxy, pods), f"round {r}'s pods in the state", timeout=20
        )
        known_to_every_worker(proxy, f"probe-{r}")
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
