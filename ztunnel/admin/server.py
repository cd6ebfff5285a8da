"""The admin (:15000), stats (:15020) and readiness (:15021) HTTP servers, and readiness tracking.

A deliberately small HTTP/1.1 server on asyncio streams: one request per connection (`Connection:
close`), headers read within 2 s and at most 8 KiB, routes matched on the exact path.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import inspect
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qs, urlsplit

from ztunnel.admin import profiling
from ztunnel.logs import lines as logs
from ztunnel.metrics.families import Metrics

log = logging.getLogger("ztunnel.admin")

HEADER_TIMEOUT = 2.0
MAX_HEADER_BYTES = 8 * 1024
MAX_BODY_BYTES = 64 * 1024
TEXT = "text/plain; charset=utf-8"


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: Mapping[str, list[str]]  # `?reset` gives {"reset": [""]}
    headers: Mapping[str, str]  # lower-case names; repeated headers joined with ", "
    body: bytes = b""


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes = b""
    content_type: str = TEXT
    headers: tuple[tuple[str, str], ...] = ()
    after: Callable[[], object] | None = None  # run once the response has been written


Handler = Callable[[Request], Response | Awaitable[Response]]


@dataclass(frozen=True)
class HttpEndpoint:
    handler: Handler
    methods: frozenset[str] | None = None  # None: any method
    description: str = ""


POST = frozenset({"POST"})
GET = frozenset({"GET"})


class _BadRequest(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


class HttpServer:
    """An HTTP/1.1 server answering one request per connection from an exact-path routing table."""

    def __init__(
        self,
        name: str,
        routes: Mapping[str, HttpEndpoint],
        *,
        header_timeout: float = HEADER_TIMEOUT,
        max_header_bytes: int = MAX_HEADER_BYTES,
    ) -> None:
        self.name = name
        self.routes = dict(routes)
        self._header_timeout = header_timeout
        self._max_header_bytes = max_header_bytes
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._background: set[asyncio.Task[Any]] = set()

    async def start(self, host: str, port: int) -> tuple[str, int]:
        """Bind and serve; return the bound address (the port is the real one when `port` is 0)."""
        self._server = await asyncio.start_server(self._accept, host, port, limit=self._max_header_bytes)
        bound = self._server.sockets[0].getsockname()
        log.info("%s server listening on %s:%s", self.name, bound[0], bound[1])
        return bound[0], bound[1]

    async def close(self, grace: float = 1.0) -> None:
        """Stop accepting, give in-flight requests `grace` seconds, then cancel the rest."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        if self._connections:
            _, pending = await asyncio.wait(self._connections, timeout=grace)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.get_running_loop().create_task(self._serve(reader, writer))
        self._connections.add(task)
        task.add_done_callback(self._connections.discard)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                request = await self._read_request(reader)
            except _BadRequest as e:
                await self._write(writer, Response(e.status, f"{e}\n".encode()))
                return
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            response = await self._dispatch(request)
            await self._write(writer, response)
            if response.after is not None:
                self._run_after(response.after)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, asyncio.CancelledError):
                await writer.wait_closed()

    async def _read_request(self, reader: asyncio.StreamReader) -> Request:
        try:
            async with asyncio.timeout(self._header_timeout):
                head = await reader.readuntil(b"\r\n\r\n")
        except TimeoutError:
            raise _BadRequest(408, "request header read timeout") from None
        except (asyncio.LimitOverrunError, ValueError):
            raise _BadRequest(431, "request header too large") from None
        lines = head[:-4].decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise _BadRequest(400, "malformed request line")
        method, target, _ = parts
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep or not name or name != name.strip():
                raise _BadRequest(400, "malformed header")
            key = name.lower()
            headers[key] = f"{headers[key]}, {value.strip()}" if key in headers else value.strip()
        body = b""
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                raise _BadRequest(400, "malformed content-length")
            if int(length) > MAX_BODY_BYTES:
                raise _BadRequest(413, "request body too large")
            try:
                async with asyncio.timeout(self._header_timeout):
                    body = await reader.readexactly(int(length))
            except TimeoutError:
                raise _BadRequest(408, "request body read timeout") from None
        url = urlsplit(target)
        return Request(method, url.path or "/", parse_qs(url.query, keep_blank_values=True), headers, body)

    async def _dispatch(self, request: Request) -> Response:
        route = self.routes.get(request.path)
        if route is None:
            return Response(404)
        if route.methods is not None and request.method not in route.methods:
            return Response(405, headers=(("Allow", ", ".join(sorted(route.methods))),))
        try:
            result = route.handler(request)
            if inspect.isawaitable(result):
                result = await result
            assert isinstance(result, Response)
            return result
        except Exception as e:
            log.exception("%s server: handler for %s failed", self.name, request.path)
            return Response(500, f"{e}\n".encode())

    async def _write(self, writer: asyncio.StreamWriter, response: Response) -> None:
        try:
            reason = HTTPStatus(response.status).phrase
        except ValueError:
            reason = ""
        head = [
            f"HTTP/1.1 {response.status} {reason}",
            f"Content-Type: {response.content_type}",
            f"Content-Length: {len(response.body)}",
            "Connection: close",
        ]
        head.extend(f"{k}: {v}" for k, v in response.headers)
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + response.body)
        await writer.drain()

    def _run_after(self, callback: Callable[[], object]) -> None:
        result = callback()
        if inspect.isawaitable(result):
            task = asyncio.ensure_future(result)
            # Keep a reference: the loop only holds weak ones.
            self._background.add(task)
            task.add_done_callback(self._background.discard)


# --- admin -------------------------------------------------------------------------------------

LOGGING_HELP = """usage: POST /logging\t\t\t\t\t\t(To list current level)
usage: POST /logging?level=<level>\t\t\t\t(To change global levels)
usage: POST /logging?level={mod1}={level1},{mod2}={level2}\t(To change specific mods' logging level)
usage: POST /logging?reset[&level=...]\t\t\t\t(To reset to the startup levels first)

hint: loglevel:\terror|warn|info|debug|trace|off
hint: mod_name:\tthe module name, i.e. ztunnel::proxy or access
"""


def _logging(request: Request, on_change: Callable[[str], object] | None = None) -> Response:
    level = request.query.get("level")
    reset = "reset" in request.query
    spec = level[-1] if level else ""
    # An empty level without `reset` lists, as no level does (`istioctl ztunnel-config log` with no
    # flags posts `?level=`).
    if not spec and not reset:
        return Response(200, f"current log level is {logs.current_filter()}\n".encode())
    try:
        new = logs.set_filter(spec, reset)
    except ValueError as e:
        return Response(400, f"Invalid level provided: {spec}: {e}\n{LOGGING_HELP}".encode())
    if on_change is not None:
        on_change(new)
    return Response(200, f"current log level is {new}\n".encode())


CpuProfiler = Callable[[float, int], Awaitable[profiling.Profile]]
HeapProfiler = Callable[[float], Awaitable[profiling.Profile]]
PPROF = "application/octet-stream"


def _query_int(request: Request, name: str, default: int, low: int, high: int) -> int:
    values = request.query.get(name)
    if not values:
        return default
    text = values[-1]
    if not text.isdigit() or not low <= int(text) <= high:
        raise _BadRequest(400, f"invalid {name}={text}: expected an integer in {low}-{high}")
    return int(text)


def _pprof_reply(profile: profiling.Profile, name: str) -> Response:
    disposition = ("Content-Disposition", f'attachment; filename="{name}.pb.gz"')
    return Response(200, profiling.encode(profile), PPROF, (disposition,))


def pprof_routes(
    cpu_profile: CpuProfiler = profiling.collect_cpu_profile,
    heap_profile: HeapProfiler = profiling.collect_heap_profile,
) -> dict[str, HttpEndpoint]:
    """`/debug/pprof/*`. With worker processes the parent passes profilers that ask every worker
    (each runs `profiling.collect_cpu_profile`) and return `profiling.merge` of their answers."""

    async def cpu(request: Request) -> Response:
        try:
            seconds = _query_int(request, "seconds", profiling.DEFAULT_SECONDS, 1, profiling.MAX_SECONDS)
            frequency = _query_int(
                request, "frequency", profiling.DEFAULT_FREQUENCY, 1, profiling.MAX_FREQUENCY
            )
        except _BadRequest as e:
            return Response(e.status, f"{e}\n".encode())
        try:
            profile = await cpu_profile(seconds, frequency)
        except profiling.ProfileBusy as e:
            return Response(409, f"{e}\n".encode())
        return _pprof_reply(profile, "profile")

    async def heap(request: Request) -> Response:
        try:
            seconds = _query_int(request, "seconds", profiling.DEFAULT_SECONDS, 1, profiling.MAX_SECONDS)
        except _BadRequest as e:
            return Response(e.status, f"{e}\n".encode())
        return _pprof_reply(await heap_profile(seconds), "heap")

    def heap_toggle(request: Request) -> Response:
        values = request.query.get("activate")
        if values is None:
            state = "active" if profiling.heap_profiling_active() else "inactive"
            return Response(200, f"heap profiling is {state}\n".encode())
        if values[-1] not in ("true", "false"):
            return Response(400, f"invalid activate={values[-1]}: expected true or false\n".encode())
        active = profiling.set_heap_profiling(values[-1] == "true")
        return Response(200, f"heap profiling is {'active' if active else 'inactive'}\n".encode())

    return {
        "/debug/pprof/profile": HttpEndpoint(
            cpu, None, "CPU profile (pprof, gzip): ?seconds=1-300 (10), ?frequency=1-1000 Hz (100)"
        ),
        "/debug/pprof/heap": HttpEndpoint(
            heap, None, "heap profile of live allocations (pprof, gzip); ?seconds=N of tracing if off"
        ),
        "/debug/pprof/heap/profiling": HttpEndpoint(
            heap_toggle, None, "?activate=true|false: keep allocation tracing on or off"
        ),
    }


def dump_json(doc: Mapping[str, Any]) -> bytes:
    """`/config_dump`'s document as JSON: a key per line, and each entry of a list on a line of its
    own (the C encoder's compact form: 100,000 workloads in a second, where `json`'s indenting
    encoder, pure Python, takes four). A value that is a function is called for what it renders
    (`ProxyState.dump_deferred`)."""
    encode = json.JSONEncoder(separators=(", ", ": ")).encode
    items = [(key, value() if callable(value) else value) for key, value in doc.items()]
    lines = ["{"]
    for i, (key, value) in enumerate(items):
        comma = "," if i < len(items) - 1 else ""
        if isinstance(value, list) and value:
            lines.append(f"  {encode(key)}: [")
            lines.append(",\n".join(["    " + encode(v) for v in value]))
            lines.append(f"  ]{comma}")
        else:
            lines.append(f"  {encode(key)}: {encode(value)}{comma}")
    lines.append("}\n")
    return "\n".join(lines).encode()


# What `html.escape` replaces, without the html package (its entity tables are ~0.4 MiB of a
# proxy's memory, for a page listing a dozen routes).
_HTML_ESCAPES = str.maketrans({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#x27;"})


def _escape(text: str) -> str:
    return text.translate(_HTML_ESCAPES)


def admin_server(
    config_dump: Callable[[], Mapping[str, Any]],
    shutdown: Callable[[], object],
    on_log_filter: Callable[[str], object] | None = None,
    *,
    extra_routes: Mapping[str, HttpEndpoint] | None = None,
    before_dump: Callable[[], Awaitable[None]] | None = None,
) -> HttpServer:
    """The admin server. `config_dump` builds the `/config_dump` document; `shutdown` is called once the
    `/quitquitquit` reply is written (an awaitable result is run as a task); `on_log_filter` gets the
    new filter after `/logging` changed it (with data-plane workers: to pass it on to them).
    `extra_routes` replaces or adds endpoints (the default `/debug/pprof/*` profile this process only);
    `before_dump` is awaited before the document is built (with workers: their current connections)."""

    async def dump(_: Request) -> Response:
        if before_dump is not None:
            await before_dump()
        doc = config_dump()  # taken here, on the loop; the big sections rendered beside it
        return Response(200, await asyncio.to_thread(dump_json, doc), "application/json")

    def quit_(_: Request) -> Response:
        return Response(200, b"shutdown now\n", after=shutdown)

    routes: dict[str, HttpEndpoint] = {
        "/config_dump": HttpEndpoint(dump, None, "dump the current ztunnel configuration"),
        "/logging": HttpEndpoint(lambda r: _logging(r, on_log_filter), POST, "query/change logging levels"),
        "/quitquitquit": HttpEndpoint(quit_, POST, "shut down the server"),
        **pprof_routes(),
        **(extra_routes or {}),
    }

    def dashboard(_: Request) -> Response:
        rows = "\n".join(
            f'<tr><td><a href="{_escape(path)}">{_escape(path)}</a></td>'
            f"<td>{_escape(route.description)}</td></tr>"
            for path, route in routes.items()
        )
        page = (
            "<!DOCTYPE html>\n<html><head><title>ztunnel admin</title></head><body>\n"
            f"<h1>ztunnel admin</h1>\n<table>\n{rows}\n</table>\n</body></html>\n"
        )
        return Response(200, page.encode(), "text/html; charset=utf-8")

    return HttpServer("admin", {"/": HttpEndpoint(dashboard, None, "this page"), **routes})


# --- stats -------------------------------------------------------------------------------------


def _accepts_gzip(accept_encoding: str | None) -> bool:
    if not accept_encoding:
        return False
    for entry in accept_encoding.split(","):
        coding, _, params = entry.strip().partition(";")
        if coding.strip().lower() not in ("gzip", "x-gzip"):
            continue
        q = params.strip()
        if q.startswith("q="):
            try:
                return float(q[2:]) > 0
            except ValueError:
                return False
        return True
    return False


def stats_server(metrics: Metrics, refresh: Callable[[], Awaitable[None]] | None = None) -> HttpServer:
    """`/metrics` and `/stats/prometheus`, negotiated from `Accept` and gzipped when accepted.

    `refresh` runs before each scrape (with data-plane workers: collect their current counters)."""

    async def scrape(request: Request) -> Response:
        if refresh is not None:
            await refresh()
        body, content_type = metrics.render(request.headers.get("accept"))
        if _accepts_gzip(request.headers.get("accept-encoding")):
            return Response(200, gzip.compress(body, 6), content_type, (("Content-Encoding", "gzip"),))
        return Response(200, body, content_type)

    route = HttpEndpoint(scrape, None, "Prometheus metrics")
    return HttpServer("stats", {"/metrics": route, "/stats/prometheus": route})


# --- readiness ---------------------------------------------------------------------------------


class ReadinessHandle:
    """One registration of a task that blocks readiness until released."""

    __slots__ = ("_name", "_readiness")

    def __init__(self, readiness: Readiness, name: str) -> None:
        self._readiness = readiness
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    def release(self) -> None:
        self._readiness._release(self)

    def __enter__(self) -> ReadinessHandle:
        return self

    def __exit__(self, *_: object) -> None:
        self.release()


class Readiness:
    """Named start-up tasks (`state manager`, `proxy`, …); ready once none is pending."""

    def __init__(self) -> None:
        self._pending: dict[str, set[ReadinessHandle]] = {}
        self._waiting: dict[str, str] = {}  # what a pending task waits for, by name

    def waiting_for(self, task_name: str, what: str) -> None:
        """Say what a pending task waits for (shown under the task names by `/healthz/ready`, until
        the task is done)."""
        if task_name in self._pending:
            self._waiting[task_name] = what

    def details(self) -> list[str]:
        """`<task>: <what it waits for>` for each pending task that said."""
        return [f"{name}: {self._waiting[name]}" for name in self.pending() if name in self._waiting]

    def register(self, task_name: str) -> ReadinessHandle:
        handle = ReadinessHandle(self, task_name)
        self._pending.setdefault(task_name, set()).add(handle)
        return handle

    def ready(self, task_name: str) -> None:
        """Mark every registration of `task_name` done."""
        self._pending.pop(task_name, None)
        self._waiting.pop(task_name, None)

    def pending(self) -> list[str]:
        return sorted(self._pending)

    def is_ready(self) -> bool:
        return not self._pending

    def _release(self, handle: ReadinessHandle) -> None:
        handles = self._pending.get(handle.name)
        if handles is None:
            return
        handles.discard(handle)
        if not handles:
            del self._pending[handle.name]
            self._waiting.pop(handle.name, None)


def readiness_server(readiness: Readiness) -> HttpServer:
    """`GET /healthz/ready`: 200 `ready` or 500 naming the pending tasks (the reference's line), then
    a line per task that said what it waits for."""

    def ready(_: Request) -> Response:
        pending = readiness.pending()
        if not pending:
            return Response(200, b"ready\n")
        lines = [f"not ready, pending: {', '.join(pending)}", *readiness.details()]
        return Response(500, "".join(f"{line}\n" for line in lines).encode())

    return HttpServer("readiness", {"/healthz/ready": HttpEndpoint(ready, GET, "readiness")})
