"""What an operator reads about connections: the open-sockets gauge, the access log's `connection
opened` line and cluster fields, and one trace id per connection shared by both proxies' logs
(the client proxy's `traceparent`), in the plain and the JSON format, of two `ztunnel proxy`
processes."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator

import pytest

from tests.apps import echo_roundtrip, loopback_net, socks5_connect, start_echo, workload_yaml
from tests.harness import Fleet, Proxy, proxy_env
from tests.waiting import eventually_async

NET = loopback_net()
SERVER, CLIENT = f"{NET}.3", f"{NET}.2"

CLUSTER_EAST, CLUSTER_WEST = "\n    clusterId: east", "\n    clusterId: west"
CONFIG = f"""
workloads:{workload_yaml("server", SERVER, extra=CLUSTER_EAST)}{workload_yaml("client", CLIENT, extra=CLUSTER_WEST)}
"""


@pytest.fixture(params=["plain"])
def log_format(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def pair(fleet: Fleet, log_format: str) -> AsyncIterator[tuple[Proxy, Proxy]]:
    echo = await start_echo(SERVER, 8080)
    try:
        extra = {"LOG_FORMAT": log_format, "RUST_LOG": "debug"}
        server, client = await fleet.start(
            proxy_env(SERVER, "demo/server/server", CONFIG, **extra),
            proxy_env(CLIENT, "demo/client/client", CONFIG, **extra),
        )
        yield server, client
    finally:
        echo.server.close()


def sockets_open(proxy: Proxy, reporter: str) -> float:
    return proxy.metric("istio_tcp_sockets_open", reporter=reporter)


async def test_sockets_open_moves_with_accepts_and_closes(pair: tuple[Proxy, Proxy]) -> None:
    server, client = pair
    assert sockets_open(client, "source") == 0
    code, reader, writer = await socks5_connect((CLIENT, 15080), SERVER, 8080)
    assert code == 0
    writer.write(b"ping")
    assert await asyncio.wait_for(reader.readexactly(4), 5) == b"ping"
    # Held open: one SOCKS5 socket at the client's proxy, one HBONE connection at the server's.
    assert sockets_open(client, "source") == 1
    assert sockets_open(server, "destination") == 1
    second = await socks5_connect((CLIENT, 15080), SERVER, 8080)
    assert second[0] == 0
    await eventually_async(lambda: sockets_open(client, "source") == 2, "two sockets open", blocking=True)
    # Each client worker pools its own connections: the streams share one when both connections were
    # accepted by the same worker, else each worker's pool holds one.
    pooled = sockets_open(server, "destination")
    assert pooled in (1, 2), pooled
    writer.close()
    second[2].close()
    await eventually_async(lambda: sockets_open(client, "source") == 0, "the sockets closed", blocking=True)
    # The pooled HBONE connection outlives its streams; closing the pool (the client proxy drained,
    # as SIGTERM does) closes it.
    assert sockets_open(server, "destination") == pooled
    assert await client.aterminate() == 0
    await eventually_async(
        lambda: sockets_open(server, "destination") == 0, "the HBONE connection closed", blocking=True
    )


def both_logs(pair: tuple[Proxy, Proxy]) -> str:
    return "".join(proxy.log() for proxy in pair)


def lines(pair: tuple[Proxy, Proxy], message: str) -> list[str]:
    return [line for line in both_logs(pair).splitlines() if f'"{message}"' in line]


async def test_access_log_opened_line_clusters_and_shared_trace_id(pair: tuple[Proxy, Proxy]) -> None:
    assert (await echo_roundtrip((CLIENT, 15080), SERVER, 8080, b"hello")).code == 0
    await eventually_async(lambda: len(lines(pair, "connection complete")) == 2, "both access logs")
    opened = lines(pair, "connection opened")
    assert len(opened) == 2
    for line in opened:
        assert "\tdebug\taccess:" in line
        assert "bytes_sent" not in line and "duration" not in line
        assert 'src.cluster="west"' in line and 'dst.cluster="east"' in line
    done = lines(pair, "connection complete")
    for line in done:
        assert 'src.cluster="west"' in line and 'dst.cluster="east"' in line
    [out] = [line for line in done if 'direction="outbound"' in line]
    [inb] = [line for line in done if 'direction="inbound"' in line]
    out_id = re.search(r'access:outbound\{id="([0-9a-f]{32})"\}', out)
    in_span = re.search(r'access:inbound\{id="([0-9a-f]{32})" peer=([0-9.:]+)\}', inb)
    assert out_id and in_span, (out, inb)
    assert out_id.group(1) == in_span.group(1)  # the server took the client's traceparent
    assert in_span.group(2) == re.search(r"src.addr=(\S+)", inb).group(1)  # type: ignore[union-attr]
    # Two connections, two traces.
    assert (await echo_roundtrip((CLIENT, 15080), SERVER, 8080, b"again")).code == 0
    await eventually_async(lambda: len(lines(pair, "connection complete")) == 4, "the second access logs")
    ids = {m.group(1) for m in re.finditer(r'\{id="([0-9a-f]{32})"', both_logs(pair))}
    assert len(ids) == 2


@pytest.mark.parametrize("log_format", ["json"], indirect=True)
async def test_json_logs_carry_the_spans(pair: tuple[Proxy, Proxy]) -> None:
    assert (await echo_roundtrip((CLIENT, 15080), SERVER, 8080, b"hello")).code == 0

    def complete() -> list[dict[str, object]]:
        out = []
        for line in both_logs(pair).splitlines():
            doc = json.loads(line)
            if doc.get("message") == "connection complete":
                out.append(doc)
        return out

    await eventually_async(lambda: len(complete()) == 2, "both access logs")
    [out] = [d for d in complete() if d["direction"] == "outbound"]
    [inb] = [d for d in complete() if d["direction"] == "inbound"]
    assert out["scope"] == inb["scope"] == "access"
    assert out["src.cluster"] == "west" and inb["dst.cluster"] == "east"
    assert isinstance(out["outbound"], dict) and isinstance(inb["inbound"], dict)
    assert out["outbound"]["id"] == inb["inbound"]["id"]
    assert re.fullmatch(r"[0-9a-f]{32}", str(inb["inbound"]["id"]))
    assert inb["inbound"]["peer"] == inb["src.addr"]
