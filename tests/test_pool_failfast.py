"""The HBONE pool as a user meets it, in a network namespace of its own: a client proxy and a server
proxy (two workers each) on loopback, an echo app beside the server, and a third workload whose
HBONE port drops every SYN (iptables), as a NetworkPolicy would.

Connections to the silent peer fail together after one connect timeout (not one timeout per
connection queued behind another's dial), a connection to the live peer goes through meanwhile,
and under a storm of connections each worker of the client holds at most one HBONE connection to
the peer."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.apps import workload_yaml
from tests.harness import Proxy, clean_env, proxy_env
from tests.netns import Netns, require_root
from tests.procs import end_all
from ztunnel.proxy.context import CONNECT_TIMEOUT

pytestmark = pytest.mark.timeout(120)

CLIENT, SERVER, SILENT = "127.0.1.2", "127.0.1.3", "127.0.1.9"
WORKERS = 2

CONFIG = f"""
workloads:{workload_yaml("client", CLIENT)}{workload_yaml("server", SERVER)}{workload_yaml("silent", SILENT)}
"""

ECHO = textwrap.dedent(
    """
    import asyncio, sys

    async def handle(reader, writer):
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        writer.close()

    async def main():
        server = await asyncio.start_server(handle, sys.argv[1], int(sys.argv[2]))
        await server.serve_forever()

    asyncio.run(main())
    """
)

# Runs inside the namespace: SOCKS5 CONNECTs through the client proxy; prints one JSON line.
SOCKS = textwrap.dedent(
    """
    import asyncio, ipaddress, json, subprocess, sys, time

    PROXY = (sys.argv[1], 15080)
    START = time.monotonic()

    async def socks5(host, port):
        reader, writer = await asyncio.open_connection(*PROXY)
        writer.write(b"\\x05\\x01\\x00")
        assert await reader.readexactly(2) == b"\\x05\\x00"
        writer.write(b"\\x05\\x01\\x00\\x01" + ipaddress.ip_address(host).packed + port.to_bytes(2, "big"))
        head = await reader.readexactly(4)
        await reader.readexactly(6)
        return head[1], reader, writer

    async def echo(host, port, payload):
        reply, reader, writer = await socks5(host, port)
        if reply:
            writer.close()
            return {"reply": reply, "at": time.monotonic() - START}
        writer.write(payload)
        got = await reader.readexactly(len(payload))
        return {"reply": 0, "echoed": got == payload, "at": time.monotonic() - START, "w": writer}

    async def within(seconds, coro):  # no answer by then: reply None (the test reads why)
        try:
            return await asyncio.wait_for(coro, seconds)
        except asyncio.TimeoutError:
            return {"reply": None, "at": time.monotonic() - START}

    async def silent_and_live(silent, live):
        dead = [asyncio.ensure_future(within(22, echo(silent, 8080, b"x"))) for _ in range(5)]
        await asyncio.sleep(0.5)  # the live peer asked half a second later: the stimulus
        alive = await within(9, echo(live, 8080, b"through"))
        if "w" in alive:
            alive.pop("w").close()
        results = [await d for d in dead]
        return {"silent": results, "live": alive}

    async def storm(live, n, ss_filter):
        results = await asyncio.gather(*(echo(live, 8080, b"%d" % i) for i in range(n)))
        out = subprocess.run(["ss", "-tnpH", "state", "established", ss_filter], capture_output=True, text=True)
        for r in results:
            r.pop("w").close()
        return {"replies": [r["reply"] for r in results], "echoed": all(r["echoed"] for r in results),
                "ss": out.stdout}

    mode = sys.argv[2]
    if mode == "silent":
        print(json.dumps(asyncio.run(silent_and_live(sys.argv[3], sys.argv[4]))))
    else:
        print(json.dumps(asyncio.run(storm(sys.argv[3], int(sys.argv[4]), sys.argv[5]))))
    """
)


@dataclass
class Box:
    ns: Netns
    tmp: Path
    logs: dict[str, Path]

    def socks(self, *args: str) -> dict:
        out = self.ns.exec(sys.executable, str(self.tmp / "socks.py"), CLIENT, *args).stdout.decode()
        return json.loads(out)


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Box]:
    require_root("ip", "iptables", "ss", "curl")
    tmp = tmp_path_factory.mktemp("pool")
    ns = Netns("ztpool")
    procs: list[subprocess.Popen[bytes]] = []
    proxies: list[Proxy] = []
    try:
        # The silent peer: every SYN to its HBONE port is dropped, so a connect only times out.
        ns.exec(
            "iptables", "-A", "OUTPUT", "-p", "tcp", "-d", SILENT, "--dport", "15008", "--syn", "-j", "DROP"
        )
        (tmp / "echo.py").write_text(ECHO)
        (tmp / "socks.py").write_text(SOCKS)
        procs.append(
            ns.popen(
                [sys.executable, str(tmp / "echo.py"), SERVER, "8080"], clean_env(), str(tmp / "echo.log")
            )
        )
        for name, ip in (("server", SERVER), ("client", CLIENT)):
            env = proxy_env(ip, f"demo/{name}/{name}", CONFIG, ZTUNNEL_WORKER_THREADS=str(WORKERS))
            proxies.append(Proxy(env, tmp / f"{name}.log", netns=ns.name))
            proxies[-1].spawn()
        for proxy in proxies:
            proxy.wait_ready()
        yield Box(ns, tmp, {p.name: p.log_path for p in proxies})
    finally:
        for proxy in proxies:
            proxy.stop()
        end_all(procs)
        ns.delete()


def test_connections_to_a_silent_peer_fail_within_one_connect_timeout_and_others_go_through(box: Box) -> None:
    out = box.socks("silent", SILENT, SERVER)
    silent, live = out["silent"], out["live"]
    # All five refused as unreachable (SOCKS5 reply 4: timed out), each after the connect timeout
    # (the SYNs really went unanswered) and within one: no connection waited for another's dial.
    assert [r["reply"] for r in silent] == [4] * 5, out
    failed_at = [r["at"] for r in silent]
    assert min(failed_at) >= CONNECT_TIMEOUT - 0.5, out
    assert max(failed_at) < CONNECT_TIMEOUT + 3.0, out
    # The live peer, asked half a second later, answered while the silent one's dials still waited.
    assert live["reply"] == 0 and live["echoed"], out
    assert live["at"] < min(failed_at) - 1.0, out
    log = box.logs["client"].read_text()
    assert log.count("connection timed out, maybe a NetworkPolicy is blocking HBONE port 15008") >= 5


def test_a_storm_opens_at_most_one_hbone_connection_per_worker_to_a_peer(box: Box) -> None:
    # 60 connections at once: fewer than one connection's 100 streams even if one worker takes all.
    out = box.socks("storm", SERVER, "60", f"( src {CLIENT} and dst {SERVER}:15008 )")
    assert out["replies"] == [0] * 60 and out["echoed"], out
    lines = out["ss"].splitlines()
    per_process: dict[str, int] = {}
    for line in lines:
        pid = line.split("pid=")[1].split(",")[0]
        per_process[pid] = per_process.get(pid, 0) + 1
    assert 1 <= len(lines) <= WORKERS, out["ss"]
    assert all(n == 1 for n in per_process.values()), out["ss"]  # one per worker, not per stream
