"""XDS_ON_DEMAND=true end to end: the client proxy (a `ztunnel proxy` process, as are the others)
starts knowing only its own workload (local file) and asks the development control plane, over
real gRPC, for each destination it does not know."""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.apps import Echo, echo_roundtrip, sha, start_echo
from tests.harness import ControlPlane, Fleet, Proxy, proxy_env
from tests.waiting import eventually_async

NET = f"127.{random.randint(16, 250)}.{random.randint(0, 250)}"
SERVER, CLIENT, STRANGER, CP_HOST = f"{NET}.3", f"{NET}.2", f"{NET}.77", f"{NET}.10"
INLINE_WP, VIP = f"{NET}.21", f"{NET}.100"

CLIENT_WORKLOAD = f"""
  - uid: x//v1/Pod/demo/client
    name: client
    namespace: demo
    serviceAccount: client
    trustDomain: cluster.local
    workloadIps: ["{CLIENT}"]
    protocol: HBONE
"""
MESH = f"""
workloads:
  - uid: x//v1/Pod/demo/server
    name: server
    namespace: demo
    serviceAccount: server
    trustDomain: cluster.local
    workloadIps: ["{SERVER}"]
    protocol: HBONE
  - uid: x//v1/Pod/demo/inline-wp
    name: inline-wp
    namespace: demo
    serviceAccount: inline-wp
    trustDomain: cluster.local
    workloadIps: ["{INLINE_WP}"]
    protocol: HBONE
{CLIENT_WORKLOAD}
services:
  - name: inline
    namespace: demo
    hostname: inline.demo.svc.cluster.local
    vips: ["/{VIP}"]
    ports:
      9080: 9080
    waypoint:
      destination: "/{INLINE_WP}"
"""


@dataclass
class Mesh:
    cp: ControlPlane
    server: Proxy
    client: Proxy
    stranger: Echo

    def logs(self) -> str:
        return self.client.log() + self.server.log() + self.waypoint.log()

    waypoint: Proxy


def known_ips(proxy: Proxy) -> set[str]:
    return {ip for w in proxy.config_dump()["workloads"] for ip in w.get("workloadIps", [])}


@pytest.fixture
async def mesh(tmp_path: Path, fleet: Fleet) -> AsyncIterator[Mesh]:
    cp = await asyncio.to_thread(fleet.control_plane, tmp_path, CP_HOST, MESH)
    echo = await start_echo(SERVER, 8080)
    stranger = await start_echo(STRANGER, 9090)
    behind_waypoint = await start_echo(INLINE_WP, 9080)
    xds = {"XDS_ADDRESS": f"http://{cp.address}", "CA_ADDRESS": f"http://{cp.address}"}
    try:
        envs = []
        for name, ip in (("server", SERVER), ("inline-wp", INLINE_WP)):
            env = proxy_env(ip, f"demo/{name}/{name}", "", RUST_LOG="debug", **xds)
            del env["FAKE_CA"], env["LOCAL_XDS"]
            envs.append(env)
        env = proxy_env(
            CLIENT,
            "demo/client/client",
            f"workloads:\n{CLIENT_WORKLOAD}",
            XDS_ON_DEMAND="true",
            ISTIO_META_DNS_CAPTURE="false",
            RUST_LOG="debug",
            **xds,
        )
        del env["FAKE_CA"]
        server, waypoint, client = await fleet.start(*envs, env)
        yield Mesh(cp, server, client, stranger, waypoint)
    finally:
        echo.server.close()
        stranger.server.close()
        behind_waypoint.server.close()
        cp.stop()


async def test_an_unknown_destination_is_fetched_then_reached_over_hbone(mesh: Mesh) -> None:
    assert SERVER not in known_ips(mesh.client)  # subscribed to nothing but what it asks for
    assert SERVER in known_ips(mesh.server)  # a wildcard proxy has everything
    payload = os.urandom(64 * 1024)
    ex = await asyncio.wait_for(echo_roundtrip((CLIENT, 15080), SERVER, 8080, payload), 4)
    assert (ex.code, ex.digest) == (0, sha(payload))
    assert SERVER in known_ips(mesh.client)
    # Log lines reach the file through each process's writer thread, a few ms after the fact.
    await eventually_async(
        lambda: f'"sending demand request"\tkey="/{SERVER}"' in mesh.logs(), "the demand request's log line"
    )
    # Reached through the tunnel: the server's proxy saw the client's identity.
    await eventually_async(
        lambda: (
            'src.identity="spiffe://cluster.local/ns/demo/sa/client"' in mesh.logs()
            and 'direction="inbound"' in mesh.logs()
        ),
        "the server proxy's inbound access log",
    )


async def test_an_address_the_control_plane_does_not_know_goes_on_at_once(mesh: Mesh) -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()
    ex = await echo_roundtrip((CLIENT, 15080), STRANGER, 9090, b"hello")
    took = loop.time() - start
    assert (ex.code, ex.digest) == (0, sha(b"hello"))  # passthrough TCP, as for any unknown address
    assert took < 4.0, f"waited {took:.1f}s: the control plane's removal should end the wait"
    await eventually_async(
        lambda: f'"on demand ready"\tkey="/{STRANGER}" found=false' in mesh.logs(), "the not-found log line"
    )


async def test_without_an_answer_the_wait_ends_after_five_seconds(mesh: Mesh) -> None:
    mesh.cp.stop()  # nothing answers any more
    loop = asyncio.get_running_loop()
    start = loop.time()
    ex = await asyncio.wait_for(echo_roundtrip((CLIENT, 15080), STRANGER, 9090, b"late"), 15)
    took = loop.time() - start
    assert (ex.code, ex.digest) == (0, sha(b"late"))
    assert 4.5 <= took < 10, took
    await eventually_async(
        lambda: f'"on-demand request timed out"\tkey="/{STRANGER}"' in mesh.logs(), "the timeout's log line"
    )


async def test_a_service_and_its_waypoint_are_both_fetched(mesh: Mesh) -> None:
    assert INLINE_WP not in known_ips(mesh.client)
    ex = await asyncio.wait_for(echo_roundtrip((CLIENT, 15080), VIP, 9080, b"via the waypoint"), 4)
    assert (ex.code, ex.digest) == (0, sha(b"via the waypoint"))
    # Log lines reach the file through each process's writer thread, a few ms after the fact.
    wanted = (
        f'"sending demand request"\tkey="/{VIP}"',
        f'"sending demand request"\tkey="/{INLINE_WP}"',
        # The tunnel went to the waypoint, naming the service address as dialled.
        f"dst.addr={INLINE_WP}:15008 dst.hbone_addr={VIP}:9080",
    )
    await eventually_async(
        lambda: all(line in mesh.logs() for line in wanted), "both demand requests and the access log"
    )
