"""What the core keeps of a stream: `Stream` while it is open, how it ended once closed."""

from __future__ import annotations

from typing import Final

# Closed streams remembered, to judge frames still in flight on them (RFC 9113 §5.1 "closed").
MAX_CLOSED_STREAMS: Final = 4096

# How a closed stream ended, as remembered.
CLOSED_BY_US: Final = 1  # we reset it (or GOAWAY refused it): the peer's late frames are ignored
CLOSED_BY_PEER: Final = 2  # the peer's RST_STREAM
CLOSED_ENDED: Final = 3  # END_STREAM both ways
CLOSED_UNKNOWN: Final = 4  # below the highest id, not remembered (forgotten, or skipped by the peer)


class Stream:
    """One open stream (open or half-closed, RFC 9113 §5.1)."""

    __slots__ = (
        "expected_length",
        "headers_received",
        "local_ended",
        "received_length",
        "recv_window",
        "remote_ended",
        "responded",
        "send_window",
        "stream_id",
        "unacked",
    )

    def __init__(self, stream_id: int, send_window: int, recv_window: int) -> None:
        self.stream_id = stream_id
        self.send_window = send_window
        self.recv_window = recv_window  # what the peer may still send
        self.unacked = 0  # consumed, not yet given back with WINDOW_UPDATE
        self.local_ended = False
        self.remote_ended = False
        self.headers_received = False  # client side: the final response arrived
        self.responded = False  # server side: our response HEADERS went out
        self.expected_length: int | None = None  # content-length, when the peer gave one
        self.received_length = 0
