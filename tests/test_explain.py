"""`GET /debug/explain` against what real connections then do: for each (source, destination) of a
table, the endpoint's answer (route, protocol, decision, reason) and the outcome of an actual
connection through the source's proxy (its SOCKS5 reply and the access logs) must agree. The
proxies are `ztunnel proxy` processes, started once for the module."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.apps import ONLY_FRONTEND, echo_roundtrip, loopback_net, sha, start_echo, workload_yaml
from tests.harness import Fleet, Proxy, proxy_env
from tests.waiting import eventually_async

NET = loopback_net()
SERVER, FRONTEND, INTRUDER, LEGACY, STRANGER = (f"{NET}.{i}" for i in (3, 2, 4, 5, 9))
VIP, EMPTY_VIP = f"{NET}.100", f"{NET}.101"
DENIED = "connection closed due to policy rejection: allow policies exist, but none allowed"


CONFIG = f"""
workloads:{
    workload_yaml(
        "server",
        SERVER,
        extra='''
    services:
      "demo/echo.demo.svc.cluster.local":
        80: 8080''',
    )
}{workload_yaml("frontend", FRONTEND)}{workload_yaml("intruder", INTRUDER)}{
    workload_yaml("legacy", LEGACY, ns="legacy", protocol="TCP")
}
services:
  - name: echo
    namespace: demo
    hostname: echo.demo.svc.cluster.local
    vips: ["/{VIP}"]
    ports:
      80: 8080
  - name: empty
    namespace: demo
    hostname: empty.demo.svc.cluster.local
    vips: ["/{EMPTY_VIP}"]
    ports:
      80: 8080{ONLY_FRONTEND}"""


@pytest.fixture(scope="module")
def proxies(module_fleet: Fleet) -> list[Proxy]:
    names = (("server", SERVER), ("frontend", FRONTEND), ("intruder", INTRUDER))
    return module_fleet.start_all(*(proxy_env(ip, f"demo/{name}/{name}", CONFIG) for name, ip in names))


@pytest.fixture
async def mesh(proxies: list[Proxy]) -> AsyncIterator[list[Proxy]]:
    """The proxies, their logs read from here on."""
    echoes = [
        await start_echo(SERVER, 8080),
        await start_echo(LEGACY, 8080),
        await start_echo(STRANGER, 9090),
    ]
    try:
        for proxy in proxies:
            proxy.mark()
        yield proxies
    finally:
        for echo in echoes:
            echo.server.close()


def logs(mesh: list[Proxy]) -> str:
    """What the proxies logged during this test."""
    return "".join(proxy.log_since_mark() for proxy in mesh)


def get(url: str, method: str = "GET") -> tuple[int, Any]:
    req = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        body = e.read()
        return e.code, json.loads(body) if body.startswith(b"{") else body


async def ask(proxy_ip: str, src: str, dst: str) -> dict[str, Any]:
    status, body = await asyncio.to_thread(get, f"http://{proxy_ip}:15000/debug/explain?src={src}&dst={dst}")
    assert status == 200, body
    assert isinstance(body, dict)
    return body


@dataclass(frozen=True)
class Case:
    src: str
    dst: str
    result: str  # "route" or "no route"
    protocol: str | None
    decision: str | None  # None: nothing authorizes (passthrough, no route)
    picked: str | None = None


CASES = [
    Case(FRONTEND, f"{SERVER}:8080", "route", "HBONE", "allow", "t//v1/Pod/demo/server"),
    Case(INTRUDER, f"{SERVER}:8080", "route", "HBONE", "deny", "t//v1/Pod/demo/server"),
    Case(FRONTEND, f"{VIP}:80", "route", "HBONE", "allow", "t//v1/Pod/demo/server"),
    Case(INTRUDER, f"{VIP}:80", "route", "HBONE", "deny", "t//v1/Pod/demo/server"),
    Case(FRONTEND, f"{STRANGER}:9090", "route", "TCP", None),
    Case(FRONTEND, f"{LEGACY}:8080", "route", "TCP", "allow", "t//v1/Pod/legacy/legacy"),
    Case(FRONTEND, f"{EMPTY_VIP}:80", "no route", None, None),
]
# What a SOCKS5 client is told: 0 connected, 2 denied by policy, 4 unreachable.
SOCKS5_REPLY = {"allow": 0, "deny": 2, None: 0}


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.src.rsplit('.', 1)[1]}->{c.dst.split('.', 3)[3]}")
async def test_explain_agrees_with_a_real_connection(mesh: list[Proxy], case: Case) -> None:
    answer = await ask(FRONTEND, case.src, case.dst)  # any proxy answers for any source
    r = answer["route"]
    assert r["result"] == case.result, answer
    assert r.get("protocol") == case.protocol, answer
    assert r.get("picked") == case.picked, answer
    authz = answer["authorization"]
    decision = authz.get("decision") if authz else None
    assert decision == case.decision, answer
    if case.decision == "deny":
        assert authz["status"] == 401 and authz["reason"] == DENIED
        assert authz["policies"] == [
            {
                "policy": "demo/only-frontend",
                "action": "ALLOW",
                "dryRun": False,
                "matched": False,
                "matchedRule": None,
            }
        ]
    if case.decision == "allow" and case.picked == "t//v1/Pod/demo/server":
        assert authz["policies"][0]["matched"] is True and authz["policies"][0]["matchedRule"] == 0
        assert authz["identity"] == "spiffe://cluster.local/ns/demo/sa/frontend"
    if "service" in r:  # the candidates the endpoint was drawn from
        expected = [] if case.dst.startswith(EMPTY_VIP) else ["t//v1/Pod/demo/server"]
        assert [c["workload"] for c in r["candidates"]] == expected

    # Now the real thing, through the source's own proxy.
    host, port = case.dst.rsplit(":", 1)
    ex = await echo_roundtrip((case.src, 15080), host, int(port), b"explain")
    if case.result == "no route":
        assert ex.code == 4
        await eventually_async(
            lambda: f'error="{r["reason"]}"' in logs(mesh), "the outbound failure with the same reason"
        )
        assert r["reason"] == f"no healthy upstream: {EMPTY_VIP}:80"
        return
    assert ex.code == SOCKS5_REPLY[case.decision], (answer, ex)
    if case.decision != "deny":
        assert ex.digest == sha(b"explain")
    else:
        # The destination's proxy recorded the denial with the very reason explain gave.
        await eventually_async(
            lambda: any(
                f"src.addr={case.src}:" in line
                and f'error="{DENIED}"' in line
                and 'direction="inbound"' in line
                for line in logs(mesh).splitlines()
            ),
            "the server's denial",
        )

    # The protocol explain named is the one the connection used: HBONE ones name their authority.
    def outbound() -> list[str]:
        return [
            line
            for line in logs(mesh).splitlines()
            if '"connection complete"' in line and 'direction="outbound"' in line
        ]

    await eventually_async(outbound, "the source's access log")
    [line] = outbound()
    assert ("dst.hbone_addr=" in line) == (case.protocol == "HBONE"), line
    assert f"dst.addr={r['nextHop']}" in line


async def test_bad_questions_get_400_with_the_reason(mesh: list[Proxy]) -> None:
    base = f"http://{FRONTEND}:15000/debug/explain"
    for query, error in (
        ("", "usage: /debug/explain?src=IP&dst=IP:PORT"),
        (f"src={FRONTEND}", "usage: /debug/explain?src=IP&dst=IP:PORT"),
        (f"src=nope&dst={SERVER}:80", "invalid src=nope: expected an IP address"),
        (f"src={FRONTEND}&dst={SERVER}", f"invalid dst={SERVER}: expected IP:PORT ([IPv6]:PORT)"),
        (
            f"src={STRANGER}&dst={SERVER}:80",
            f"no workload has address /{STRANGER}: the source must be a mesh workload",
        ),
    ):
        status, body = await asyncio.to_thread(get, f"{base}?{query}")
        assert (status, body) == (400, {"error": error})
    status, _ = await asyncio.to_thread(get, f"{base}?src={FRONTEND}&dst={SERVER}:8080", "POST")
    assert status == 405
