"""What `H2Core.receive` (and `H2Core.timer`) report: one small object per happening, in order."""

from __future__ import annotations

from typing import ClassVar

Headers = list[tuple[str, str]]


class Event:
    # The fields of `__repr__` and `__eq__`: `__slots__` itself is not kept by a compiled class.
    FIELDS: ClassVar[tuple[str, ...]] = ()
    __slots__ = ()

    def __repr__(self) -> str:
        names = self.FIELDS
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in names)
        return f"{type(self).__name__}({fields})"

    def __eq__(self, other: object) -> bool:
        names = self.FIELDS
        return type(other) is type(self) and all(getattr(self, n) == getattr(other, n) for n in names)

    __hash__ = None  # type: ignore[assignment]


class RequestReceived(Event):
    """Server side: a new stream's request header block (validated; names lowercase)."""

    FIELDS = ("end_stream", "headers", "stream_id")
    __slots__ = FIELDS

    def __init__(self, stream_id: int, headers: Headers, end_stream: bool) -> None:
        self.stream_id = stream_id
        self.headers = headers
        self.end_stream = end_stream


class ResponseReceived(Event):
    """Client side: the final (non-1xx) response header block of a stream we opened."""

    FIELDS = ("end_stream", "headers", "stream_id")
    __slots__ = FIELDS

    def __init__(self, stream_id: int, headers: Headers, end_stream: bool) -> None:
        self.stream_id = stream_id
        self.headers = headers
        self.end_stream = end_stream


class TrailersReceived(Event):
    """A header block after the response or request (trailers; it ends the stream: `StreamEnded`
    follows). gRPC's status travels in them."""

    FIELDS = ("headers", "stream_id")
    __slots__ = FIELDS

    def __init__(self, stream_id: int, headers: Headers) -> None:
        self.stream_id = stream_id
        self.headers = headers


class DataReceived(Event):
    """DATA payload bytes; `flow_length` of the receive windows they used (padding included).

    A large frame may arrive as several of these, as its bytes arrive. The windows come back
    when the consumer calls `H2Core.ack(stream_id, flow_length)`.
    """

    FIELDS = ("data", "flow_length", "stream_id")
    __slots__ = FIELDS

    def __init__(self, stream_id: int, data: bytes, flow_length: int) -> None:
        self.stream_id = stream_id
        self.data = data
        self.flow_length = flow_length


class StreamEnded(Event):
    """The peer's END_STREAM: its direction of the stream is over."""

    FIELDS = ("stream_id",)
    __slots__ = FIELDS

    def __init__(self, stream_id: int) -> None:
        self.stream_id = stream_id


class StreamReset(Event):
    """The stream is over, abruptly: the peer's RST_STREAM (`by_peer`), or ours for a stream error
    its frames caused (RFC 9113 §5.4.2; the RST_STREAM is already queued)."""

    FIELDS = ("by_peer", "error_code", "stream_id")
    __slots__ = FIELDS

    def __init__(self, stream_id: int, error_code: int, by_peer: bool) -> None:
        self.stream_id = stream_id
        self.error_code = error_code
        self.by_peer = by_peer


class WindowUpdated(Event):
    """A send window grew (`stream_id` 0: the connection's; also after a larger INITIAL_WINDOW_SIZE)."""

    FIELDS = ("stream_id",)
    __slots__ = FIELDS

    def __init__(self, stream_id: int) -> None:
        self.stream_id = stream_id


class SettingsReceived(Event):
    """The peer's SETTINGS, applied and acknowledged; `first` for the one that ends its preface."""

    FIELDS = ("changed", "first")
    __slots__ = FIELDS

    def __init__(self, changed: dict[int, int], first: bool) -> None:
        self.changed = changed
        self.first = first


class SettingsAcked(Event):
    __slots__ = ()


class PingAcked(Event):
    FIELDS = ("opaque",)
    __slots__ = FIELDS

    def __init__(self, opaque: bytes) -> None:
        self.opaque = opaque


class GoAwayReceived(Event):
    """The peer's GOAWAY. `refused`: the streams we opened above `last_stream_id`, which the peer
    did not and will not process (closed here without a reset); the others go on."""

    FIELDS = ("debug", "error_code", "last_stream_id", "refused")
    __slots__ = FIELDS

    def __init__(self, error_code: int, last_stream_id: int, debug: bytes, refused: list[int]) -> None:
        self.error_code = error_code
        self.last_stream_id = last_stream_id
        self.debug = debug
        self.refused = refused


class ConnectionTerminated(Event):
    """A connection error of the peer's making (or a timeout): GOAWAY(`error_code`) is queued and
    the core takes no more input. `limit` when it broke one of our abuse limits."""

    FIELDS = ("error_code", "limit", "message")
    __slots__ = FIELDS

    def __init__(self, error_code: int, message: str, limit: bool) -> None:
        self.error_code = error_code
        self.message = message
        self.limit = limit
