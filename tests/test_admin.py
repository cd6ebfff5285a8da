"""The admin, stats and readiness servers over real loopback HTTP/1.1."""

from __future__ import annotations

import asyncio
import gzip
import io
import json
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import pytest

from ztunnel.admin.server import (
    HttpEndpoint,
    HttpServer,
    Readiness,
    Response,
    admin_server,
    dump_json,
    readiness_server,
    stats_server,
)
from ztunnel.logs import lines as logs
from ztunnel.metrics.exposition import OPENMETRICS_CONTENT_TYPE
from ztunnel.metrics.families import Metrics
from ztunnel.metrics.traffic import TrafficLabels


class Reply:
    def __init__(self, raw: bytes) -> None:
        head, _, self.body = raw.partition(b"\r\n\r\n")
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        self.status = int(status_line.split(" ")[1])
        self.status_line = status_line
        self.headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}

    @property
    def text(self) -> str:
        return self.body.decode()


async def send(port: int, raw: bytes) -> Reply:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    return Reply(data)


async def request(port: int, method: str, path: str, headers: Mapping[str, str] | None = None) -> Reply:
    lines = [f"{method} {path} HTTP/1.1", "Host: localhost"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return await send(port, ("\r\n".join(lines) + "\r\n\r\n").encode())


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[HttpServer], Any]]:
    servers: list[HttpServer] = []

    async def start(server: HttpServer) -> int:
        servers.append(server)
        host, port = await server.start("127.0.0.1", 0)
        assert host == "127.0.0.1" and port > 0
        return port

    yield start
    for s in servers:
        await s.close()
    logs.reset_logging()


# --- admin ---


async def test_dashboard_lists_endpoints(serve: Any) -> None:
    port = await serve(admin_server(lambda: {}, lambda: None))
    r = await request(port, "GET", "/")
    assert r.status == 200
    assert r.headers["content-type"] == "text/html; charset=utf-8"
    for path in ("/config_dump", "/logging", "/quitquitquit"):
        assert f'href="{path}"' in r.text


async def test_config_dump(serve: Any) -> None:
    dump = {
        "workloads": [],
        "certificates": [{"identity": "spiffe://td/ns/a/sa/b"}],
        "config": {"proxyMode": "shared"},
    }
    port = await serve(admin_server(lambda: dump, lambda: None))
    for method in ("GET", "POST"):
        r = await request(port, method, "/config_dump")
        assert r.status == 200
        assert r.headers["content-type"] == "application/json"
        assert json.loads(r.body) == dump
        assert '\n  "workloads": []' in r.text
        assert int(r.headers["content-length"]) == len(r.body)


async def test_handler_error_is_500_with_the_text(serve: Any) -> None:
    def broken() -> dict[str, Any]:
        raise RuntimeError("state lock poisoned")

    port = await serve(admin_server(broken, lambda: None))
    r = await request(port, "GET", "/config_dump")
    assert r.status == 500
    assert r.text == "state lock poisoned\n"


async def test_logging_endpoint(serve: Any) -> None:
    logs.setup_logging("plain", "info", stream=io.StringIO())
    port = await serve(admin_server(lambda: {}, lambda: None))
    r = await request(port, "POST", "/logging")
    assert (r.status, r.text) == (200, "current log level is info\n")
    r = await request(port, "POST", "/logging?level=access=debug")
    assert (r.status, r.text) == (200, "current log level is info,access=debug\n")
    r = await request(port, "POST", "/logging?level=warn")
    assert (r.status, r.text) == (200, "current log level is warn,access=debug\n")
    r = await request(port, "POST", "/logging?reset")
    assert (r.status, r.text) == (200, "current log level is info\n")
    r = await request(port, "POST", "/logging?reset&level=debug")
    assert (r.status, r.text) == (200, "current log level is debug\n")
    r = await request(port, "POST", "/logging?level=loud")
    assert r.status == 400
    assert r.text.startswith("Invalid level provided: loud")
    assert "error|warn|info|debug|trace|off" in r.text
    assert logs.current_filter() == "debug"
    # What `istioctl ztunnel-config log` posts with no flags: the current level, unchanged.
    r = await request(port, "POST", "/logging?level=")
    assert (r.status, r.text) == (200, "current log level is debug\n")
    assert (await request(port, "POST", "/logging?level=,")).status == 400
    assert logs.current_filter() == "debug"
    r = await request(port, "GET", "/logging")
    assert r.status == 405
    assert r.headers["allow"] == "POST"


async def test_quitquitquit(serve: Any) -> None:
    calls: list[str] = []
    port = await serve(admin_server(lambda: {}, lambda: calls.append("shutdown")))
    r = await request(port, "GET", "/quitquitquit")
    assert r.status == 405
    assert calls == []
    r = await request(port, "POST", "/quitquitquit")
    assert (r.status, r.text) == (200, "shutdown now\n")
    assert calls == ["shutdown"]


async def test_quitquitquit_with_async_shutdown(serve: Any) -> None:
    done = asyncio.Event()

    async def shutdown() -> None:
        done.set()

    port = await serve(admin_server(lambda: {}, shutdown))
    r = await request(port, "POST", "/quitquitquit")
    assert r.status == 200
    await asyncio.wait_for(done.wait(), 2)


async def test_admin_unknown_path_is_404(serve: Any) -> None:
    port = await serve(admin_server(lambda: {}, lambda: None))
    assert (await request(port, "GET", "/debug/nothing")).status == 404
    assert (await request(port, "POST", "/config_dump/x")).status == 404


# --- stats ---


async def test_metrics_endpoints(serve: Any) -> None:
    metrics = Metrics("1.24.0", process_metrics=False)
    metrics.open_connection(TrafficLabels(reporter="source")).close()
    port = await serve(stats_server(metrics))
    a = await request(port, "GET", "/metrics")
    b = await request(port, "GET", "/stats/prometheus")
    assert a.status == b.status == 200
    assert a.body == b.body
    assert a.headers["content-type"] == "text/plain; charset=utf-8"
    assert 'istio_tcp_connections_closed_total{reporter="source",' in a.text
    assert 'istio_build{component="ztunnel",tag="1.24.0"} 1' in a.text
    assert a.text.endswith("# EOF\n")
    assert "content-encoding" not in a.headers


async def test_metrics_openmetrics_and_gzip(serve: Any) -> None:
    metrics = Metrics(process_metrics=False)
    port = await serve(stats_server(metrics))
    plain = await request(port, "GET", "/metrics")
    r = await request(
        port,
        "GET",
        "/metrics",
        {
            "Accept": "application/openmetrics-text;version=1.0.0,text/plain;q=0.5",
            "Accept-Encoding": "gzip, br",
        },
    )
    assert r.status == 200
    assert r.headers["content-type"] == OPENMETRICS_CONTENT_TYPE
    assert r.headers["content-encoding"] == "gzip"
    assert gzip.decompress(r.body) == plain.body
    refused = await request(port, "GET", "/metrics", {"Accept-Encoding": "gzip;q=0"})
    assert "content-encoding" not in refused.headers


async def test_stats_unknown_path_is_404(serve: Any) -> None:
    port = await serve(stats_server(Metrics(process_metrics=False)))
    assert (await request(port, "GET", "/")).status == 404
    assert (await request(port, "GET", "/metrics/x")).status == 404


# --- readiness ---


async def test_readiness(serve: Any) -> None:
    readiness = Readiness()
    proxy = readiness.register("proxy")
    readiness.register("state manager")
    port = await serve(readiness_server(readiness))
    r = await request(port, "GET", "/healthz/ready")
    assert (r.status, r.text) == (500, "not ready, pending: proxy, state manager\n")
    proxy.release()
    proxy.release()
    r = await request(port, "GET", "/healthz/ready")
    assert (r.status, r.text) == (500, "not ready, pending: state manager\n")
    readiness.ready("state manager")
    r = await request(port, "GET", "/healthz/ready")
    assert (r.status, r.text) == (200, "ready\n")
    assert (await request(port, "POST", "/healthz/ready")).status == 405
    assert (await request(port, "GET", "/healthz/live")).status == 404


async def test_readiness_says_what_a_task_waits_for(serve: Any) -> None:
    readiness = Readiness()
    readiness.register("state manager")
    manager = readiness.register("workload proxy manager")
    readiness.waiting_for("workload proxy manager", "no node agent at /run/zds.sock yet")
    readiness.waiting_for("dns proxy", "never registered: not shown")
    port = await serve(readiness_server(readiness))
    r = await request(port, "GET", "/healthz/ready")
    assert (r.status, r.text) == (
        500,
        "not ready, pending: state manager, workload proxy manager\n"
        "workload proxy manager: no node agent at /run/zds.sock yet\n",
    )
    manager.release()
    readiness.register("workload proxy manager")  # pending again: what it said before is gone
    r = await request(port, "GET", "/healthz/ready")
    assert r.text == "not ready, pending: state manager, workload proxy manager\n"


def test_readiness_handles_of_one_name() -> None:
    readiness = Readiness()
    a = readiness.register("proxy")
    with readiness.register("proxy"):
        a.release()
        assert readiness.pending() == ["proxy"]
    assert readiness.is_ready()


# --- the server itself ---


async def test_header_timeout_closes_the_connection(serve: Any) -> None:
    port = await serve(HttpServer("t", {}, header_timeout=0.2))
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.1\r\n")
    data = await asyncio.wait_for(reader.read(), 3)
    assert data.startswith(b"HTTP/1.1 408 ")
    writer.close()


async def test_oversized_headers_are_refused(serve: Any) -> None:
    port = await serve(HttpServer("t", {"/": HttpEndpoint(lambda _: Response(200))}))
    r = await send(port, b"GET / HTTP/1.1\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n")
    assert r.status == 431
    ok = await send(port, b"GET / HTTP/1.1\r\nX-Fits: " + b"a" * 7000 + b"\r\n\r\n")
    assert ok.status == 200


async def test_malformed_request_is_400(serve: Any) -> None:
    port = await serve(HttpServer("t", {}))
    assert (await send(port, b"HELLO\r\n\r\n")).status == 400


async def test_post_body_is_read_and_connection_closes(serve: Any) -> None:
    seen: list[bytes] = []

    def handler(req: Any) -> Response:
        seen.append(req.body)
        return Response(200, b"ok")

    port = await serve(HttpServer("t", {"/x": HttpEndpoint(handler, frozenset({"POST"}))}))
    r = await send(port, b"POST /x HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello")
    assert (r.status, r.text, r.headers["connection"]) == (200, "ok", "close")
    assert seen == [b"hello"]


async def test_close_stops_accepting() -> None:
    server = HttpServer("t", {})
    _, port = await server.start("127.0.0.1", 0)
    await server.close()
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", port)


def test_the_dump_is_the_document_with_each_list_entry_on_a_line_of_its_own() -> None:
    """`/config_dump` as an operator reads it (`less`, `grep`, `jq`): a key per line, a workload per
    line; the same JSON as the document, its deferred sections rendered."""
    workloads = [
        {"uid": f"w{i}", "workloadIps": ["10.0.0.1"], "services": {"ns/s": {"80": 8080}}} for i in range(3)
    ]
    doc = {
        "workloads": lambda: workloads,
        "services": [],
        "certificates": [{"identity": "spiffe://td/ns/a/sa/b", "state": "Available"}],
        "config": {"proxyMode": "dedicated", "nested": {"a": [1, 2]}},
        "version": "1.0 \u00e9",
    }
    text = dump_json(doc).decode()
    assert json.loads(text) == {**doc, "workloads": workloads}
    lines = text.splitlines()
    assert lines[0] == "{" and lines[-1] == "}"
    for w in workloads:
        assert f"    {json.dumps(w)}," in lines or f"    {json.dumps(w)}" in lines
    assert '  "config": {"proxyMode": "dedicated", "nested": {"a": [1, 2]}},' in lines
