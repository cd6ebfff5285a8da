"""The life cycle of an HBONE stream: one state enum and one transition table (as h11 does for
HTTP/1.1), pure values that `hbone.stream.HboneStream` changes only through `TRANSITIONS`."""

from __future__ import annotations

import enum


class StreamState(enum.Enum):
    """Where a stream is in its life; each value says (closing, local ended, remote ended, EOF pending).

    "Local ended": our END_STREAM or RST_STREAM went out (or can no longer). "Remote ended": the
    peer's END_STREAM arrived. "EOF pending": that end still waits to be handed to the protocol
    (it is paused or not set yet). "Closing": `close()` was called, or the stream is over; its reads
    are dropped and `is_closing()` is true.
    """

    OPEN = (False, False, False, False)
    SEND_ENDED = (False, True, False, False)
    RECV_ENDED = (False, False, True, True)
    RECV_DONE = (False, False, True, False)  # the EOF was delivered; the protocol kept writing
    BOTH_ENDED = (False, True, True, True)  # both ends on the wire; the EOF still to deliver
    CLOSING = (True, False, False, False)
    CLOSING_SENT = (True, True, False, False)
    CLOSING_RECEIVED = (True, False, True, False)
    CLOSED = (True, True, True, False)

    def __init__(self, closing: bool, local_ended: bool, remote_ended: bool, eof_pending: bool) -> None:
        # Plain attributes: read on every write and every received chunk.
        self.closing = closing
        self.local_ended = local_ended
        self.remote_ended = remote_ended
        self.eof_pending = eof_pending


class StreamEvent(enum.Enum):
    SEND_END = enum.auto()  # END_STREAM sent, or nothing more can be sent
    RECV_END = enum.auto()  # the peer's END_STREAM
    EOF_DELIVERED = enum.auto()  # the protocol's eof_received was called
    CLOSE = enum.auto()  # close(): stop reading, end once both directions ended
    RESET = enum.auto()  # a clean RST_STREAM (NO_ERROR, CANCEL): both directions end at once


S, E = StreamState, StreamEvent
# Every allowed change of state; resets, a lost connection and a refusing response go straight to
# CLOSED (`_finish`). An event absent for a state changes nothing (e.g. `close()` twice).
TRANSITIONS: dict[tuple[StreamState, StreamEvent], StreamState] = {
    (S.OPEN, E.SEND_END): S.SEND_ENDED,
    (S.OPEN, E.RECV_END): S.RECV_ENDED,
    (S.OPEN, E.CLOSE): S.CLOSING,
    (S.SEND_ENDED, E.RECV_END): S.BOTH_ENDED,
    (S.SEND_ENDED, E.CLOSE): S.CLOSING_SENT,
    (S.RECV_ENDED, E.SEND_END): S.BOTH_ENDED,
    (S.RECV_ENDED, E.EOF_DELIVERED): S.RECV_DONE,
    (S.RECV_ENDED, E.CLOSE): S.CLOSING_RECEIVED,  # the undelivered EOF is dropped with the reads
    (S.RECV_DONE, E.SEND_END): S.CLOSED,
    (S.RECV_DONE, E.CLOSE): S.CLOSING_RECEIVED,
    (S.BOTH_ENDED, E.EOF_DELIVERED): S.CLOSED,
    (S.BOTH_ENDED, E.CLOSE): S.CLOSED,
    (S.CLOSING, E.SEND_END): S.CLOSING_SENT,
    (S.CLOSING, E.RECV_END): S.CLOSING_RECEIVED,
    (S.CLOSING_SENT, E.RECV_END): S.CLOSED,
    (S.CLOSING_RECEIVED, E.SEND_END): S.CLOSED,
    (S.OPEN, E.RESET): S.BOTH_ENDED,
    (S.SEND_ENDED, E.RESET): S.BOTH_ENDED,
    (S.RECV_ENDED, E.RESET): S.BOTH_ENDED,
    (S.RECV_DONE, E.RESET): S.CLOSED,
    (S.CLOSING, E.RESET): S.CLOSED,
    (S.CLOSING_SENT, E.RESET): S.CLOSED,
    (S.CLOSING_RECEIVED, E.RESET): S.CLOSED,
}
del S, E
