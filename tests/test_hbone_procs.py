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
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from hbone.identity import Identity
from hbone.tls import WorkloadCertificate
from tests import h2peer
from tests.h2peer import RawH2, rst
from tests.mesh import Echo, loopback_net, proxy_env, socks5_connect, start_echo, workload_yaml
from tests.waiting import eventually
from ztunnel.identity.certificates import FakeCA

pytestmark = pytest.mark.timeout(120)

NET = loopback_net()
CLIENT, SERVER = f"{NET}.2", f"{NET}.3"
APP_PORT = 8080

CONFIG = f"""
workloads:{workload_yaml("server", SERVER, uid="p//v1/Pod")}{workload_yaml("client", CLIENT, uid="p//v1/Pod")}
"""


@dataclass
class Proxy:
    name: str
    ip: str
    process: subprocess.Popen[bytes]
    log: list[str] = field(default_factory=list)

    def text(self) -> str:
        return "".join(self.log)


def ready(ip: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{ip}:15021/healthz/ready", timeout=1) as r:
            return bool(r.status == 200)
    except (OSError, urllib.error.HTTPError):
        return False


def start(name: str, ip: str) -> Proxy:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZTUNNEL_", "PROXY_", "XDS_", "CA_"))}
    env.update(proxy_env("demo", name, name, ip, CONFIG, RUST_LOG="info"))
    process = subprocess.Popen(
        [sys.executable, "-m", "ztunnel", "proxy"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    proxy = Proxy(name, ip, process)

    def drain() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            proxy.log.append(line.decode(errors="replace"))

    threading.Thread(target=drain, daemon=True).start()
    eventually(lambda: ready(ip) or process.poll() is not None, f"{name} proxy readiness", 30)
    assert process.poll() is None, proxy.text()
    return proxy


def stop(proxy: Proxy) -> None:
    if proxy.process.poll() is None:
        proxy.process.send_signal(signal.SIGTERM)
        try:
            proxy.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proxy.process.kill()
            proxy.process.wait()
    print(f"--- {proxy.name} proxy ---\n{proxy.text()}")


@dataclass
class Pair:
    client: Proxy
    server: Proxy
    echo: Echo


@pytest.fixture
async def pair() -> AsyncIterator[Pair]:
    echo = await start_echo(SERVER, APP_PORT)
    loop = asyncio.get_running_loop()
    server = await loop.run_in_executor(None, start, "server", SERVER)
    client = await loop.run_in_executor(None, start, "client", CLIENT)
    p = Pair(client, server, echo)
    try:
        yield p
    finally:
        for proxy in (p.client, p.server):
            await loop.run_in_executor(None, stop, proxy)
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
                await asyncio.sleep(0.01)

        self.task = asyncio.create_task(run())

    async def stop(self) -> None:
        self._stop.set()
        assert self.task is not None
        await asyncio.wait_for(self.task, 15)

    def close(self) -> None:
        self.writer.close()


def open_fds(proxy: Proxy) -> int:
    return len(os.listdir(f"/proc/{proxy.process.pid}/fd"))


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
    eventually(lambda: open_fds(pair.server) <= fds_before + 2, "the server proxy's fds to settle", 10)
    eventually(lambda: "rapid reset" in pair.server.text(), "the server proxy to log the attack", 5)
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
    pair.server.process.send_signal(signal.SIGKILL)
    pair.server.process.wait()
    for t in tunnels:
        try:
            rest = await asyncio.wait_for(t.reader.read(), 5.0)  # EOF, long before the 20 s keepalive
            assert rest == b""
        except ConnectionResetError:
            pass
        t.close()
    assert time.monotonic() - started < 5.0
    pair.server = await asyncio.get_running_loop().run_in_executor(None, start, "server", SERVER)
    fresh = await Tunnel.open()
    await fresh.roundtrip(64 * 1024)
    fresh.close()
