"""HBONE abuse and faults, black-box against two real `ztunnel proxy` processes on 127.x.y.z: a
client proxy (SOCKS5 in) and a server proxy (HBONE :15008 in, an echo app behind it).

* Rapid reset from a mesh identity closes the attacker's connection with GOAWAY(ENHANCE_YOUR_CALM)
  and a warning, while an unrelated tunnel through both proxies keeps echoing every byte.
* A server proxy killed: its tunnels fail fast on the client (long before the keepalive timeout),
  and once it is back the next connection is dialled anew (the pool forgot the dead one).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from hbone.identity import Identity
from hbone.tls import WorkloadCertificate
from tests import h2peer
from tests.apps import Echo, loopback_net, socks5_connect, start_echo, workload_yaml
from tests.h2peer import RawH2, rst
from tests.harness import Fleet, Proxy, proxy_env
from tests.waiting import eventually_async
from ztunnel.identity.certificates import FakeCA

pytestmark = pytest.mark.timeout(120)

NET = loopback_net()
CLIENT, SERVER = f"{NET}.2", f"{NET}.3"
APP_PORT = 8080

CONFIG = f"""
workloads:{workload_yaml("server", SERVER, uid="p//v1/Pod")}{workload_yaml("client", CLIENT, uid="p//v1/Pod")}
"""


@dataclass
class Pair:
    client: Proxy
    server: Proxy
    echo: Echo


@pytest.fixture
async def pair(fleet: Fleet) -> AsyncIterator[Pair]:
    echo = await start_echo(SERVER, APP_PORT)
    try:
        server, client = await fleet.start(
            proxy_env(SERVER, "demo/server/server", CONFIG), proxy_env(CLIENT, "demo/client/client", CONFIG)
        )
        yield Pair(client, server, echo)
    finally:
        echo.server.close()


class Tunnel:
    """One connection through both proxies to the echo app, echoing in a loop: every byte checked."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.sent = self.received = 0
        self.longest_wait = 0.0
        self._stop = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    @classmethod
    async def open(cls) -> Tunnel:
        code, reader, writer = await socks5_connect((CLIENT, 15080), SERVER, APP_PORT)
        assert code == 0
        return cls(reader, writer)

    async def roundtrip(self, size: int = 1024, timeout: float = 10.0) -> None:
        chunk = os.urandom(size)
        started = time.monotonic()
        self.writer.write(chunk)
        echoed = await asyncio.wait_for(self.reader.readexactly(size), timeout)
        assert echoed == chunk
        self.sent += size
        self.received += size
        self.longest_wait = max(self.longest_wait, time.monotonic() - started)

    def keep_echoing(self) -> None:
        async def run() -> None:
            while not self._stop.is_set():
                await self.roundtrip()
                await asyncio.sleep(0.01)  # pacing the bystander's traffic, not a wait

        self.task = asyncio.create_task(run())

    async def stop(self) -> None:
        self._stop.set()
        assert self.task is not None
        await asyncio.wait_for(self.task, 15)

    def close(self) -> None:
        self.writer.close()


def open_fds(proxy: Proxy) -> int:
    return len(os.listdir(f"/proc/{proxy.pid}/fd"))


def attacker_cert() -> WorkloadCertificate:
    # The proxies' fake CA (FAKE_CA=true) signs with one embedded root: a mesh identity of ours.
    return FakeCA().issue(Identity("cluster.local", "demo", "attacker"))


async def test_rapid_reset_closes_the_attacker_and_spares_an_unrelated_tunnel(pair: Pair) -> None:
    bystander = await Tunnel.open()
    await bystander.roundtrip()
    bystander.keep_echoing()
    fds_before = open_fds(pair.server)
    peer = await RawH2.connect((SERVER, 15008), attacker_cert())
    try:
        sid = 1
        sent_pairs = 0
        goaway = None
        for _ in range(80):  # up to 20,000 HEADERS(CONNECT) + RST_STREAM(CANCEL) pairs
            burst = b"".join(
                peer.connect_headers(s, f"{SERVER}:{APP_PORT}") + rst(s) for s in range(sid, sid + 500, 2)
            )
            sid += 500
            try:
                peer.send(burst)
                await asyncio.wait_for(peer.writer.drain(), 5)
            except (ConnectionError, TimeoutError):
                break
            sent_pairs += 250
            if any(f.type == h2peer.GOAWAY for f in peer.received) or peer.reader.at_eof():
                break
            try:
                goaway = await peer.read_until(lambda f: f.type == h2peer.GOAWAY, 0.01)
                break
            except TimeoutError:
                pass
        if goaway is None:
            goaway = await peer.goaway(10)
    finally:
        peer.close()
    assert goaway.error_code == h2peer.ENHANCE_YOUR_CALM
    assert sent_pairs >= 1000  # the limit (1000 per 10 s) was passed, not merely approached
    # No dial, no descriptor, no task kept for the reset streams: the server is back to its idle fds.
    # (Waited on this loop, which also runs the bystander's echo app.)
    await eventually_async(
        lambda: open_fds(pair.server) <= fds_before + 2, "the server proxy's fds to settle", 10
    )
    await eventually_async(
        lambda: "rapid reset" in pair.server.log(), "the server proxy to log the attack", 5
    )
    await bystander.stop()
    assert bystander.received == bystander.sent
    assert bystander.longest_wait < 5.0
    fresh = await Tunnel.open()  # new tunnels are served
    await fresh.roundtrip()
    fresh.close()
    bystander.close()


async def test_killed_peer_fails_its_tunnels_fast_and_the_next_connection_dials_anew(pair: Pair) -> None:
    tunnels = [await Tunnel.open() for _ in range(3)]  # pooled: one HBONE connection carries all
    for t in tunnels:
        await t.roundtrip()
    started = time.monotonic()
    pair.server.send(signal.SIGKILL)
    await pair.server.await_exit()
    for t in tunnels:
        try:
            rest = await asyncio.wait_for(t.reader.read(), 5.0)  # EOF, long before the 20 s keepalive
            assert rest == b""
        except ConnectionResetError:
            pass
        t.close()
    assert time.monotonic() - started < 5.0
    await pair.server.akill()  # what is left of its group
    await pair.server.astart()
    fresh = await Tunnel.open()
    await fresh.roundtrip(64 * 1024)
    fresh.close()
