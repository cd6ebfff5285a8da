"""A CONNECT the client gives up on while the server proxy still dials the app: the dial is cancelled
at once (not left to its 10 s timeout) and the connection is still recorded as closed. The server
proxy is a `ztunnel proxy` process; the client is this test, speaking HBONE with a mesh identity."""

from __future__ import annotations

import asyncio
import socket

import pytest

from hbone.client import HboneConnection
from hbone.identity import Identity
from hbone.settings import H2Settings
from hbone.tls import TlsCredentials
from tests.mesh import Fleet, Proxy, loopback_net, proxy_env, workload_yaml
from tests.waiting import eventually_async
from ztunnel.identity.certificates import FakeCA

pytestmark = pytest.mark.timeout(60)

NET = loopback_net()
SERVER = f"{NET}.3"

CONFIG = f"""
workloads:{workload_yaml("server", SERVER, uid="a//v1/Pod")}
"""


@pytest.fixture
async def server(fleet: Fleet) -> Proxy:
    [proxy] = await fleet.start(proxy_env("demo", "server", "server", SERVER, CONFIG))
    return proxy


def closed_total(proxy: Proxy) -> float:
    return proxy.metric("istio_tcp_connections_closed_total")


async def test_client_reset_during_the_app_dial_cancels_it_and_records_the_close(server: Proxy) -> None:
    # An app whose accept queue is full: the proxy's connect to it hangs (its SYNs are dropped).
    app = socket.socket()
    app.bind((SERVER, 8080))
    app.listen(0)
    fillers = []
    for _ in range(4):
        s = socket.socket()
        s.setblocking(False)
        try:
            s.connect((SERVER, 8080))
        except BlockingIOError:
            pass
        fillers.append(s)
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setblocking(False)
    await loop.sock_connect(sock, (SERVER, 15008))
    creds = TlsCredentials.build(FakeCA().issue(Identity("cluster.local", "demo", "client")))
    server_id = Identity("cluster.local", "demo", "server")
    conn = await HboneConnection.open(sock, creds, [server_id], H2Settings())
    try:
        before = await asyncio.to_thread(closed_total, server)
        connecting = asyncio.create_task(conn.connect(f"{SERVER}:8080"))
        # Admission is immediate here; give the request time to reach the hanging dial (a cancel
        # that came earlier would create no record, and the log awaited below would never come).
        await asyncio.sleep(0.3)
        assert not connecting.done()
        connecting.cancel()  # RST_STREAM(CANCEL)
        await eventually_async(
            lambda: "cancelled, the stream was reset" in server.log(),
            "the abandoned dial to be cancelled and logged",
            3.0,  # long before the 10 s connect timeout
        )
        await eventually_async(
            lambda: closed_total(server) == before + 1, "the close to be counted", 3.0, blocking=True
        )
    finally:
        conn.abort()
        for s in fillers:
            s.close()
        app.close()
