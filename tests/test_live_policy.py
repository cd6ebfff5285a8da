"""Late rejection: a policy change closes the open inbound connections it now denies."""

from __future__ import annotations

import asyncio

from policy.model import Action, Authorization, Match, Scope, StringMatch, StringMatchKind
from tests.mesh import loopback_net, proxy_env, socks5_connect, start_echo, start_proxy, workload_yaml
from tests.waiting import eventually_async

NET = loopback_net()
SERVER, CLIENT = f"{NET}.3", f"{NET}.2"

CONFIG = f"""
workloads:{workload_yaml("server", SERVER, uid="l//v1/Pod")}{workload_yaml("client", CLIENT, uid="l//v1/Pod")}
"""


async def test_policy_change_closes_a_connection_it_now_denies(proxy_logs) -> None:  # type: ignore[no-untyped-def]
    echo = await start_echo(SERVER, 8080)
    server = await start_proxy(proxy_env("demo", "server", "server", SERVER, CONFIG))
    client = await start_proxy(proxy_env("demo", "client", "client", CLIENT, CONFIG))
    try:
        code, reader, writer = await socks5_connect((CLIENT, 15080), SERVER, 8080)
        assert code == 0
        writer.write(b"before")
        assert await asyncio.wait_for(reader.readexactly(6), 5) == b"before"

        # A policy that allows someone else: the open connection's client is no longer allowed.
        only_other = Authorization(
            name="only-other",
            namespace="demo",
            scope=Scope.NAMESPACE,
            action=Action.ALLOW,
            rules=(
                (
                    (
                        Match(
                            principals=(StringMatch(StringMatchKind.EXACT, "cluster.local/ns/demo/sa/other"),)
                        ),
                    ),
                ),
            ),
        )
        server.state.upsert_policy(only_other)

        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the server proxy
        writer.close()

        def closed_lines() -> list[str]:
            body, _ = server.metrics.render(None)
            return [
                line
                for line in body.decode().splitlines()
                if line.startswith("istio_tcp_connections_closed_total") and 'reporter="destination"' in line
            ]

        # Logged and counted once the server proxy is done with the connection.
        await eventually_async(
            lambda: "connection closed due to policy change" in proxy_logs.text() and closed_lines(),
            "the closure's log line and metric",
        )
        logs = proxy_logs.text()
        assert "connection closed due to policy change" in logs
        closed = closed_lines()
        assert len(closed) == 1 and 'response_flags="DENY"' in closed[0], closed
        code, reader, writer = await socks5_connect((CLIENT, 15080), SERVER, 8080)
        assert code == 2  # and new connections are refused (401)
        writer.close()
    finally:
        await client.drain()
        await server.drain()
        echo.server.close()
