"""In-pod mode when the node agent comes after ztunnel (root: a node made of a network namespace,
tests/cninode.py): `ztunnel proxy` (PROXY_MODE=shared) starts first and says, in its readiness
answer, what it waits for; the real `ztunnel cni-agent` starts later, and readiness turns 200 within
seconds, without a restart. Also an agent's socket that accepts nothing (an old agent still holding
its listener while a new one took the path): the proxy does not wait in its backlog for good."""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cninode import Cluster, Node
from tests.harness import Proxy
from tests.inpod_mesh import ztunnel_env
from tests.netns import require_root
from tests.waiting import eventually

pytestmark = pytest.mark.timeout(120)

LOCAL = "workloads: []\n"
# A generous bound; what keeps it short is the proxy looking for the agent every second.
READY_AFTER_AGENT = 10.0


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    require_root("ip", "curl")
    cluster = Cluster(tmp_path)
    try:
        yield cluster.node()
    finally:
        cluster.close()


@pytest.fixture
def ztunnel(node: Node) -> Iterator[Proxy]:
    # At debug, each failed connect to the agent is a line.
    env = ztunnel_env(node, "", LOCAL_XDS=LOCAL, LOG_LEVEL="info,ztunnel.inpod=debug")
    zt = Proxy(env, node.dir / "ztunnel.log", netns=node.ns.name)
    try:
        yield zt
    finally:
        zt.stop()
        sys.stdout.write(f"--- ztunnel log (tail) ---\n{zt.tail(3000)}\n")


def readiness(zt: Proxy) -> tuple[int, str]:
    return zt.readiness_answer()


def wait_answer(zt: Proxy, status: int, text: str, timeout: float = 30) -> str:
    """The readiness body once it has `status` and contains `text`."""
    seen: list[tuple[int, str]] = []

    def check() -> bool:
        seen[:] = [readiness(zt)]
        return seen[0][0] == status and text in seen[0][1]

    eventually(check, lambda: f"readiness {status} with {text!r} (last: {seen})", timeout)
    return seen[0][1]


def attempts(zt: Proxy) -> int:
    """Failed connects to the agent so far."""
    return zt.log().count("cannot connect to the node agent at")


def ready_within(zt: Proxy, node: Node, started: float) -> float:
    eventually(zt.ready, lambda: f"readiness 200 (last: {readiness(zt)})\n{node.agent_output()[-2000:]}", 30)
    return time.monotonic() - started


def test_a_late_agent_makes_the_proxy_ready_without_a_restart(node: Node, ztunnel: Proxy) -> None:
    ztunnel.spawn()  # not ready before its node agent
    # Once the workers serve, the node agent is all it waits for.
    body = wait_answer(ztunnel, 500, "not ready, pending: workload proxy manager\n")
    assert body.splitlines() == [
        "not ready, pending: workload proxy manager",
        f"workload proxy manager: no node agent at {node.zds_socket} yet (No such file or directory)",
    ]
    # Long after start (a backoff doubling to 15 s would be past 10 s by now), the proxy still
    # looks for the agent every second or so.
    time.sleep(12)  # when it is looked at (the stimulus), not a wait
    before = attempts(ztunnel)
    time.sleep(4)  # the window its attempts are counted in
    assert attempts(ztunnel) - before >= 3
    assert readiness(ztunnel)[0] == 500
    node.start_agent()
    started = time.monotonic()
    took = ready_within(ztunnel, node, started)
    assert took < READY_AFTER_AGENT, f"ready {took:.1f}s after the agent started"
    assert ztunnel.running() and ztunnel.starts == 1  # the same process
    assert "connected to the node agent" in ztunnel.log()


def test_an_agent_socket_that_never_answers_does_not_hold_readiness(node: Node, ztunnel: Proxy) -> None:
    # An old agent's listener, still open, that accepts nothing: connecting to it succeeds (the
    # kernel queues the connection) and then nothing comes.
    stuck = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    stuck.bind(str(node.zds_socket))
    stuck.listen(16)
    try:
        ztunnel.spawn()  # not ready before its node agent
        wait_answer(ztunnel, 500, "waiting for its snapshot")
        # A new agent takes the path (the old one's file removed, its listener still open).
        node.zds_socket.unlink()
        node.start_agent()
        started = time.monotonic()
        took = ready_within(ztunnel, node, started)
        assert "sent nothing for 10s before its snapshot; connecting again" in ztunnel.log()
        assert took < 10 + READY_AFTER_AGENT, f"ready {took:.1f}s after the new agent started"
    finally:
        stuck.close()
