"""Late rejection: a policy change closes the open inbound connections it now denies (the policy
pushed by the development control plane to two `ztunnel proxy` processes)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.apps import loopback_net, socks5_connect, start_echo, workload_yaml
from tests.harness import Fleet, proxy_env
from tests.waiting import eventually_async

NET = loopback_net()
SERVER, CLIENT, CP_HOST = f"{NET}.3", f"{NET}.2", f"{NET}.10"

CONFIG = f"""
workloads:{workload_yaml("server", SERVER, uid="l//v1/Pod")}{workload_yaml("client", CLIENT, uid="l//v1/Pod")}
"""

# A policy that allows someone else: the open connection's client is no longer allowed.
ONLY_OTHER = """
policies:
  - name: only-other
    namespace: demo
    scope: Namespace
    action: Allow
    dryRun: false
    rules:
      - - - principals: [!Exact "cluster.local/ns/demo/sa/other"]
"""


async def test_policy_change_closes_a_connection_it_now_denies(fleet: Fleet, tmp_path: Path) -> None:
    echo = await start_echo(SERVER, 8080)
    cp = await asyncio.to_thread(fleet.control_plane, tmp_path / "cp", CP_HOST, CONFIG)
    try:
        server, _client = await fleet.start(
            cp.wire(proxy_env(SERVER, "demo/server/server", CONFIG)),
            cp.wire(proxy_env(CLIENT, "demo/client/client", CONFIG)),
        )
        code, reader, writer = await socks5_connect((CLIENT, 15080), SERVER, 8080)
        assert code == 0
        writer.write(b"before")
        assert await asyncio.wait_for(reader.readexactly(6), 5) == b"before"

        cp.push(CONFIG + ONLY_OTHER)

        assert await asyncio.wait_for(reader.read(), 10) == b""  # closed by the server proxy
        writer.close()

        def closed() -> list[tuple[dict[str, str], float]]:
            return [
                (labels, value)
                for name, labels, value in server.samples()
                if name == "istio_tcp_connections_closed_total" and labels.get("reporter") == "destination"
            ]

        # Logged and counted once the server proxy is done with the connection.
        await eventually_async(
            lambda: "connection closed due to policy change" in server.log() and closed(),
            "the closure's log line and metric",
            blocking=True,
        )
        assert "connection closed due to policy change" in server.log()
        series = closed()
        assert len(series) == 1 and series[0][0]["response_flags"] == "DENY" and series[0][1] == 1, series
        code, reader, writer = await socks5_connect((CLIENT, 15080), SERVER, 8080)
        assert code == 2  # and new connections are refused (401)
        writer.close()
    finally:
        cp.stop()
        echo.server.close()
