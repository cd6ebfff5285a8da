"""In-pod mode's `/config_dump` lists each pod's open connections under `workloadState` (root: a
real pod namespace, its outbound traffic redirected to the pod's 15001 by iptables), from a
`ztunnel proxy` process whose workers hold them."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.harness import Proxy
from tests.netns import Netns, require_root
from tests.test_inpod_manager import Agent, http_get, node, open_netns, pods, readiness  # noqa: F401
from tests.waiting import eventually_async
from xds import zds

pytestmark = [pytest.mark.timeout(60), pytest.mark.root]

APP = "10.66.0.9"

# Inside the pod: an app listening on APP:9999 and a client holding one connection to it (through
# the pod's proxy), until its stdin closes.
HOLDER = textwrap.dedent(
    f"""
    import socket, sys, threading
    srv = socket.create_server(("{APP}", 9999))
    def serve():
        conn, _ = srv.accept()
        while data := conn.recv(65536):
            conn.sendall(data)
    threading.Thread(target=serve, daemon=True).start()
    c = socket.create_connection(("{APP}", 9999), timeout=10)
    c.sendall(b"ping")
    assert c.recv(4) == b"ping"
    print("held", flush=True)
    sys.stdin.read()
    """
)


def workload_state(ip: str) -> dict[str, Any]:
    _, dump = http_get(f"http://{ip}:15000/config_dump")
    state: dict[str, Any] = json.loads(dump)["workloadState"]
    return state


async def test_workload_state_lists_a_pods_connections(
    node: tuple[Proxy, Agent, str],  # noqa: F811
    pods: list[Netns],  # noqa: F811
    tmp_path: Path,
) -> None:
    require_root("iptables")
    _proxy, agent, ip = node
    pod = Netns("pod")
    pods.append(pod)
    pod.exec("ip", "addr", "add", f"{APP}/32", "dev", "lo")
    # The pod's own redirection, as the node agent writes it: the proxy's marked sockets pass.
    pod.exec(
        "iptables", "-t", "nat", "-A", "OUTPUT", "-p", "tcp", "-d", APP, "--dport", "9999",
        "-m", "mark", "!", "--mark", "1337", "-j", "REDIRECT", "--to-ports", "15001",
    )  # fmt: skip
    await agent.accept()
    assert await agent.request(zds.add("uid-a", "pod-a", "ns", "sa-a"), [open_netns(pod)]) == ""
    assert await agent.request(zds.snapshot_sent()) == ""
    await eventually_async(readiness(ip, 200), "readiness 200", blocking=True)
    empty = {"inbound": [], "outbound": []}
    assert (await asyncio.to_thread(workload_state, ip))["uid-a"]["connections"] == empty

    holder = subprocess.Popen(
        ["ip", "netns", "exec", pod.name, sys.executable, "-c", HOLDER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert await asyncio.wait_for(asyncio.to_thread(holder.stdout.readline), 15) == "held\n"
        state = await asyncio.to_thread(workload_state, ip)
        [conn] = state["uid-a"]["connections"]["outbound"]
        assert conn["originalDst"] == f"{APP}:9999"
        assert conn["actualDst"] == f"{APP}:9999"  # an address the mesh does not know: passthrough
        assert conn["protocol"] == "TCP"
        assert conn["src"].startswith(f"{APP}:")
        assert state["uid-a"]["connections"]["inbound"] == []
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(10)

    await eventually_async(
        lambda: workload_state(ip)["uid-a"]["connections"] == empty,
        "the closed connection gone from the dump",
        blocking=True,
    )
