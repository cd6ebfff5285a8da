"""A proxy holding 100,000 workloads reconnects to a restarted development control plane, which, as
istiod, takes at most 4 MiB in one message: the list of what the proxy holds is over it, so the
proxy lists what fits, gets the rest again, and drops what went away while it was gone (the scale
bench's mesh, `benches/scalemesh.py`).

The restart is a rollout, as istiod's: the proxy reaches its control plane through a TCP hop that
stands for istiod's Service; the new control plane (already holding the changed mesh) is up when the
old one stops, so the proxy reconnects at once rather than after its backoff, and a control plane's
start at this scale is paid once in the test's time."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from benches.scalemesh import PROXY_WORKLOAD, ScaleMesh
from tests.apps import free_port
from tests.harness import ControlPlane, Fleet, Proxy, proxy_env
from tests.waiting import eventually_async

NET = f"127.{random.randint(16, 250)}.{random.randint(0, 250)}"
PROXY_IP, SINK_IP, CP_HOST = f"{NET}.2", f"{NET}.3", f"{NET}.1"
WORKLOADS = 100_000
GONE = 10  # the last bulk workloads, deleted while the proxy is away (and so their service)
CHANGED = WORKLOADS - 2 * GONE  # a workload changed meanwhile: its revision is v2
START = 120.0  # a control plane or a proxy with the whole mesh, on a busy machine

CUT = re.compile(
    r'"initial request cut to the message limit[^"]*"\ttype_url="\S+Address" resources=(\d+) held=(\d+)'
)
SENT = re.compile(r"subscribed to Address: sending (\d+) resource\(s\), (\d+) removal\(s\), (\d+) unchanged")


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    try:
        while data := await src.read(1 << 16):
            dst.write(data)
            await dst.drain()
    except ConnectionError:
        pass
    finally:
        dst.close()


class Service:
    """A TCP hop to whichever control plane `target` names when a connection arrives."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.writers: set[asyncio.StreamWriter] = set()
        self.carrying: set[asyncio.Future[tuple[None, None]]] = set()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        host, _, port = self.target.rpartition(":")
        try:
            up_reader, up_writer = await asyncio.open_connection(host, int(port))
        except OSError:
            writer.close()
            return
        both = asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        self.writers.update((writer, up_writer))
        self.carrying.add(both)
        try:
            await both
        finally:
            self.writers.difference_update((writer, up_writer))
            self.carrying.discard(both)

    async def close(self) -> None:
        """Cut what it carries and wait until its pipes have ended."""
        for writer in list(self.writers):
            writer.close()
        if self.carrying:
            await asyncio.wait(list(self.carrying), timeout=10)


@contextlib.asynccontextmanager
async def service(host: str, target: str) -> AsyncIterator[tuple[Service, str]]:
    hop = Service(target)
    server = await asyncio.start_server(hop.serve, host, 0)
    try:
        yield hop, f"{host}:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await hop.close()


def uid(i: int) -> str:
    return f"Kubernetes//Pod/ns{i // 100}/w{i}"


def matched(pattern: re.Pattern[str], text: str) -> tuple[int, ...]:
    found = pattern.search(text)
    assert found is not None, pattern.pattern
    return tuple(map(int, found.groups()))


@pytest.mark.timeout(600)
async def test_100000_workloads_come_back_whole_after_a_control_plane_restart(
    tmp_path: Path, fleet: Fleet
) -> None:
    before = ScaleMesh(WORKLOADS, PROXY_IP, SINK_IP, (8080, 8081))
    after = ScaleMesh(WORKLOADS - GONE, PROXY_IP, SINK_IP, (8080, 8081))
    texts = await asyncio.gather(
        asyncio.to_thread(before.render), asyncio.to_thread(after.render, "v2", frozenset({CHANGED}))
    )
    ca = ("--ca-dir", str(tmp_path / "ca"))  # one CA, as istiod's replicas share theirs
    old, new = (
        fleet.adopt(ControlPlane(tmp_path / name, f"{CP_HOST}:{free_port(CP_HOST)}", text, *ca))
        for name, text in zip(("old", "new"), texts, strict=True)
    )
    old.spawn()
    new.spawn()  # starting with the changed mesh while the proxy starts from the old one
    await old.await_ready(START)
    async with service(CP_HOST, old.address) as (hop, address):
        ns, name, sa = PROXY_WORKLOAD
        env = proxy_env(PROXY_IP, f"{ns}/{name}/{sa}")
        del env["FAKE_CA"], env["LOCAL_XDS"]
        proxy: Proxy = fleet.proxy(
            {**env, "XDS_ADDRESS": f"http://{address}", "CA_ADDRESS": f"http://{address}"}
        )
        await proxy.astart(START)  # ready: every workload applied and in every worker
        await new.await_ready(START)
        proxy.mark()
        hop.target = new.address
        await old.astop()

        # The proxy's list of 110,003 resources does not fit in 4 MiB: it sent what did.
        await eventually_async(
            lambda: CUT.search(proxy.log_since_mark()), "the request cut to the limit", START
        )
        listed, held = matched(CUT, proxy.log_since_mark())
        assert held == before.total_workloads + before.services + 1  # and the probe's service
        assert 50_000 < listed < held
        # The new control plane kept what the proxy listed and sent the rest. It named no removal:
        # what went was among what the proxy left out (the last names: the list is in the order
        # they came, sorted), so the proxy drops it itself.
        await eventually_async(lambda: SENT.search(new.log()), "the control plane's answer", START)
        assert matched(SENT, new.log()) == (held - listed - GONE - 1, 0, listed)
        await eventually_async(
            lambda: "the control plane no longer has" in proxy.log_since_mark(), "the answer applied", START
        )
        # /config_dump is served on the loop that applied it: a request from now on sees it applied.
        status, body = await asyncio.to_thread(proxy.get, "admin", "/config_dump", timeout=START)
        assert status == 200
        workloads = {w["uid"]: w for w in json.loads(body)["workloads"]}
    assert len(workloads) == after.total_workloads
    assert {uid(i) for i in range(after.workloads)} <= set(workloads)
    assert not {uid(i) for i in range(after.workloads, WORKLOADS)} & set(workloads)
    assert (workloads[uid(CHANGED)]["canonicalRevision"], workloads[uid(0)]["canonicalRevision"]) == (
        "v2",
        "v1",
    )
    assert "RESOURCE_EXHAUSTED" not in proxy.log()
