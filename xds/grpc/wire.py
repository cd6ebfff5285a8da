"""gRPC over HTTP/2 without I/O: message framing, the request's headers, the status of a call.

A message is a 5-byte prefix (a compressed flag, always 0 here, and a big-endian length) and the
serialized protobuf. A response is HEADERS (`:status 200`, `content-type: application/grpc…`),
messages as DATA, then trailers holding `grpc-status` and a percent-encoded `grpc-message`; or a
"trailers-only" response, one HEADERS block ending the stream that holds all of it. `CallState`
takes what the HTTP/2 core reports for one stream and returns the messages received and, once the
call is over, its `Status`: from the trailers, from the HTTP status when there is no `grpc-status`
(one other than 200 ends the call on the response's HEADERS), or from what ended the stream
otherwise (RST_STREAM, GOAWAY, the connection's end), as gRPC's own clients map them. A stream that
ends inside a message ends the call with INTERNAL, OK trailers or not.
"""

from __future__ import annotations

import enum
import math
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from urllib.parse import unquote

PREFIX = struct.Struct(">BI")  # compressed flag, length
CONTENT_TYPE = "application/grpc"


class StatusCode(enum.IntEnum):
    """gRPC's status codes, named as every gRPC library names them."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


@dataclass(frozen=True)
class Status:
    code: StatusCode
    details: str = ""

    def __str__(self) -> str:
        return f"{self.code.name}: {self.details}" if self.details else self.code.name


OK = Status(StatusCode.OK)


class RpcError(Exception):
    """A call ended with a status other than OK."""

    def __init__(self, status: Status) -> None:
        super().__init__(str(status))
        self.status = status

    @property
    def code(self) -> StatusCode:
        return self.status.code

    @property
    def details(self) -> str:
        return self.status.details


# HTTP/2 error codes of RST_STREAM (RFC 9113 §7) -> gRPC status, as gRPC's clients map them.
_RESET_CODES = {
    0x0: StatusCode.INTERNAL,  # NO_ERROR before the trailers: the response is cut short
    0x7: StatusCode.UNAVAILABLE,  # REFUSED_STREAM: never processed, safe to retry
    0x8: StatusCode.CANCELLED,
    0xB: StatusCode.RESOURCE_EXHAUSTED,  # ENHANCE_YOUR_CALM
    0xC: StatusCode.PERMISSION_DENIED,  # INADEQUATE_SECURITY
}
# HTTP status of a response without grpc-status -> gRPC status (gRPC's "HTTP to gRPC" table).
_HTTP_CODES = {
    400: StatusCode.INTERNAL,
    401: StatusCode.UNAUTHENTICATED,
    403: StatusCode.PERMISSION_DENIED,
    404: StatusCode.UNIMPLEMENTED,
    429: StatusCode.UNAVAILABLE,
    502: StatusCode.UNAVAILABLE,
    503: StatusCode.UNAVAILABLE,
    504: StatusCode.UNAVAILABLE,
}


def reset_status(error_code: int) -> Status:
    code = _RESET_CODES.get(error_code, StatusCode.INTERNAL)
    return Status(code, f"stream reset by the server with HTTP/2 error code {error_code}")


def frame_message(payload: bytes) -> bytes:
    """One length-prefixed, uncompressed message."""
    return PREFIX.pack(0, len(payload)) + payload


def encode_timeout(seconds: float) -> str:
    """`grpc-timeout`: at most 8 digits and a unit; rounded up, so a deadline is never shortened."""
    nanos = max(0, math.ceil(round(seconds * 1e9, 3)))
    for unit, size in (("n", 1), ("u", 1_000), ("m", 1_000_000), ("S", 10**9), ("M", 60 * 10**9)):
        value = -(-nanos // size)
        if value < 100_000_000:
            return f"{value}{unit}"
    return f"{min(99_999_999, -(-nanos // (3600 * 10**9)))}H"


def request_headers(
    authority: str,
    path: str,
    *,
    tls: bool,
    timeout: float | None = None,
    metadata: Iterable[tuple[str, str]] = (),
) -> list[tuple[str, str]]:
    """A call's HEADERS: the pseudo-headers, gRPC's own fields, then the caller's metadata (names
    lowercased; gRPC's reserved names and pseudo-headers are not the caller's to set)."""
    headers = [
        (":method", "POST"),
        (":scheme", "https" if tls else "http"),
        (":path", path),
        (":authority", authority),
        ("content-type", CONTENT_TYPE),
        ("te", "trailers"),
    ]
    if timeout is not None:
        headers.append(("grpc-timeout", encode_timeout(timeout)))
    for name, value in metadata:
        name = name.lower()
        if name.startswith(":") or name in _RESERVED:
            raise ValueError(f"metadata {name!r} is reserved by gRPC")
        headers.append((name, value))
    return headers


_RESERVED = frozenset({"content-type", "te", "grpc-timeout", "grpc-encoding", "grpc-status", "grpc-message"})


def status_from(headers: Sequence[tuple[str, str]], http_status: int | None = None) -> Status:
    """The status in trailers (or a trailers-only response, with its `:status`)."""
    fields = dict(headers)
    raw = fields.get("grpc-status")
    if raw is None:
        if http_status is not None and http_status != 200:
            return http_status_error(http_status)
        return Status(StatusCode.UNKNOWN, "the server sent no grpc-status")
    try:
        code = StatusCode(int(raw))
    except ValueError:
        return Status(StatusCode.UNKNOWN, f"invalid grpc-status {raw!r}")
    return Status(code, unquote(fields.get("grpc-message", ""), errors="replace"))


def http_status_error(http_status: int) -> Status:
    code = _HTTP_CODES.get(http_status, StatusCode.UNKNOWN)
    return Status(code, f"the server answered HTTP status {http_status}")


class MessageReader:
    """Cuts received DATA into messages; a message over `max_length`, or a compressed one (we never
    offer a compression), ends the call."""

    def __init__(self, max_length: int) -> None:
        self.max_length = max_length
        self._buffer = bytearray()
        self._want: int | None = None  # the length of the message being read, once its prefix is in

    @property
    def partial(self) -> bool:
        return bool(self._buffer) or self._want is not None

    def feed(self, data: bytes) -> list[bytes]:
        """The messages `data` completes; raises RpcError."""
        buffer = self._buffer
        buffer += data
        messages: list[bytes] = []
        while True:
            if self._want is None:
                if len(buffer) < PREFIX.size:
                    return messages
                flag, length = PREFIX.unpack_from(buffer)
                if flag & 1:
                    raise RpcError(Status(StatusCode.INTERNAL, "a compressed message, none was negotiated"))
                if length > self.max_length:
                    raise RpcError(
                        Status(
                            StatusCode.RESOURCE_EXHAUSTED,
                            f"received message larger than max ({length} vs. {self.max_length})",
                        )
                    )
                del buffer[: PREFIX.size]
                self._want = length
            if len(buffer) < self._want:
                return messages
            messages.append(bytes(buffer[: self._want]))
            del buffer[: self._want]
            self._want = None


class CallState:
    """One call's response side without I/O: the HTTP/2 core's events for its stream in, messages
    and then its final `Status` out. `status` is None while the call goes on."""

    def __init__(self, max_message: int) -> None:
        self._reader = MessageReader(max_message)
        self.http_status: int | None = None
        self.status: Status | None = None

    def response(self, headers: Sequence[tuple[str, str]], end_stream: bool) -> None:
        """The response's HEADERS (`end_stream`: a trailers-only response)."""
        if self.status is not None:
            return
        fields = dict(headers)
        raw = fields.get(":status", "")
        status = int(raw) if raw.isascii() and raw.isdigit() else 0  # the core checked it: 3 digits
        self.http_status = status
        if end_stream:
            self.status = status_from(headers, status)
        elif status != 200:
            self.status = http_status_error(status)
        elif not fields.get("content-type", "").startswith(CONTENT_TYPE):
            self.status = Status(StatusCode.UNKNOWN, f"content-type {fields.get('content-type')!r}")

    def data(self, data: bytes) -> list[bytes]:
        if self.status is not None:
            return []
        try:
            return self._reader.feed(data)
        except RpcError as e:
            self.status = e.status
            return []

    def trailers(self, headers: Sequence[tuple[str, str]]) -> None:
        """The trailers; an OK status after part of a message is an error: the message is cut."""
        if self.status is not None:
            return
        status = status_from(headers, self.http_status)
        if status.code is StatusCode.OK and self._reader.partial:
            status = Status(StatusCode.INTERNAL, "the trailers arrived inside a message: it is cut short")
        self.status = status

    def ended(self) -> None:
        """END_STREAM: a stream ended without trailers is an error."""
        if self.status is None:
            if self._reader.partial:
                self.status = Status(StatusCode.INTERNAL, "the stream ended inside a message")
            else:
                self.status = Status(StatusCode.INTERNAL, "the stream ended without trailers")

    def reset(self, error_code: int) -> None:
        if self.status is None:
            self.status = reset_status(error_code)

    def lost(self, status: Status) -> None:
        """The connection ended (GOAWAY, closed, keepalive timeout), or the caller gave up."""
        if self.status is None:
            self.status = status
