"""Servers for the gRPC client's tests: a grpcio server whose methods misbehave on purpose (statuses,
trailers-only answers, a stall, an oversized message, a stream the server ends), and an HTTP/2
server of `h2`'s that does what grpcio never does (RST_STREAM, GOAWAY, a close mid-stream, a peer
that stops reading). Messages are raw bytes: no protobuf needed to tell what went where."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio
import h2.config
import h2.connection
import h2.events

from xds.grpc.wire import frame_message

SERVICE = "test.Misbehaving"


def method(name: str) -> str:
    return f"/{SERVICE}/{name}"


async def _unary(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
    """`echo:<x>` answers x; `abort:<code>:<details>` answers that status alone (trailers-only);
    `stall` never answers; `big:<n>` answers n bytes; `meta` answers the request's metadata."""
    verb, _, rest = request.partition(b":")
    if verb == b"echo":
        return rest
    if verb == b"abort":
        code, _, details = rest.decode().partition(":")
        await context.abort(grpc.StatusCode[code], details)
    if verb == b"stall":
        await asyncio.sleep(3600)  # a peer that never answers: the stimulus
    if verb == b"big":
        return b"b" * int(rest)
    if verb == b"meta":
        return repr(sorted((m.key, m.value) for m in context.invocation_metadata() or ())).encode()
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown verb {verb!r}")
    raise AssertionError


async def _chat(
    requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]
) -> AsyncIterator[bytes]:
    """Echoes every message; `end` ends the call OK, `fail:<code>:<details>` after the messages so far."""
    async for request in requests:
        verb, _, rest = request.partition(b":")
        if verb == b"end":
            return
        if verb == b"fail":
            code, _, details = rest.decode().partition(":")
            await context.abort(grpc.StatusCode[code], details)
        yield request


@dataclass
class GrpcioPeer:
    server: grpc.aio.Server
    port: int

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.port}"


async def start_grpcio_peer(credentials: grpc.ServerCredentials | None = None) -> GrpcioPeer:
    server = grpc.aio.server(options=[("grpc.max_send_message_length", 64 * 1024 * 1024)])
    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(_unary),
        "Chat": grpc.stream_stream_rpc_method_handler(_chat),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    if credentials is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", credentials)
    await server.start()
    return GrpcioPeer(server, port)


# --- an HTTP/2 server that misbehaves below gRPC --------------------------------------------------


class _RawProtocol(asyncio.Protocol):
    """Per request path: `/raw/Reset/<code>` answers HEADERS and a message, then RST_STREAM(code);
        `/raw/GoAway/<code>` the same, then GOAWAY(code) and the close; `/raw/Close` a message, then the
        connection closes; `/raw/Deaf` stops reading (PINGs go unanswered); `/raw/Ok` a message and OK;
        `/raw/Status/<code>` HEADERS with that HTTP status, the stream left open; `/raw/Half` half a
        message, then OK trailers. The answer starts once the request has ended (as a unary server's
    does)."""

    def __init__(self, peer: RawPeer) -> None:
        self.peer = peer
        self.h2 = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=False, header_encoding="utf-8")
        )
        self.transport: asyncio.Transport | None = None
        self.paths: dict[int, str] = {}

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.peer.connections.append(self)
        self.h2.initiate_connection()
        self.flush()

    def flush(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(self.h2.data_to_send())

    def data_received(self, data: bytes) -> None:
        for event in self.h2.receive_data(data):
            if isinstance(event, h2.events.RequestReceived):
                headers = dict(event.headers)  # type: ignore[arg-type]
                self.peer.requests.append(headers)  # type: ignore[arg-type]
                self.paths[event.stream_id] = str(headers[":path"])
            elif isinstance(event, h2.events.DataReceived):
                self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, h2.events.StreamEnded):  # the whole request is in: answer it
                self.answer(event.stream_id, self.paths.pop(event.stream_id))
        self.flush()

    def answer(self, sid: int, path: str) -> None:
        assert self.transport is not None
        _, _, verb, arg = [*path.split("/"), ""][:4]
        if verb == "Deaf":
            self.transport.pause_reading()
            return
        if verb == "Status":  # an HTTP status that is not 200, and nothing after it
            self.h2.send_headers(sid, [(":status", arg), ("content-type", "application/grpc")])
            return
        if verb == "Half":  # half a message, then OK trailers
            self.h2.send_headers(sid, [(":status", "200"), ("content-type", "application/grpc")])
            self.h2.send_data(sid, frame_message(b"first message")[:9])
            self.h2.send_headers(sid, [("grpc-status", "0")], end_stream=True)
            return
        self.h2.send_headers(sid, [(":status", "200"), ("content-type", "application/grpc")])
        self.h2.send_data(sid, frame_message(b"first"))
        if verb == "Reset":
            self.h2.reset_stream(sid, int(arg))
        elif verb == "GoAway":
            self.h2.close_connection(error_code=int(arg), last_stream_id=sid)
            self.flush()
            self.transport.close()
        elif verb == "Close":
            self.flush()
            self.transport.close()
        elif verb == "Ok":
            self.h2.send_headers(sid, [("grpc-status", "0")], end_stream=True)


@dataclass
class RawPeer:
    server: asyncio.Server | None = None
    port: int = 0
    connections: list[_RawProtocol] = field(default_factory=list)
    requests: list[dict[str, str]] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def close(self) -> None:
        for c in self.connections:
            if c.transport is not None:
                c.transport.abort()
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                await self.server.wait_closed()


async def start_raw_peer() -> RawPeer:
    peer = RawPeer()
    loop = asyncio.get_running_loop()
    peer.server = await loop.create_server(lambda: _RawProtocol(peer), "127.0.0.1", 0)
    peer.port = peer.server.sockets[0].getsockname()[1]
    return peer
