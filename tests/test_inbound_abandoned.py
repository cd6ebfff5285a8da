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
from tests.apps import loopback_net, workload_yaml
from tests.harness import Fleet, Proxy, proxy_env
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
    [proxy] = await fleet.start(proxy_env(SERVER, "demo/server/server", CONFIG))
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
        opened = await server.ametric("istio_tcp_connections_opened_total", reporter="destination")
        connecting = asyncio.create_task(conn.connect(f"{SERVER}:8080"))
        # The request reached the hanging dial once its record exists (counted as opened; a cancel
        # that came earlier would create no record, and the log awaited below would never come).
        await eventually_async(
            lambda: server.metric("istio_tcp_connections_opened_total", reporter="destination") > opened,
            "the request's record on the server",
            blocking=True,
        )
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
