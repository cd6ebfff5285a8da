"""Splicing two transports together: the bidirectional copy of a proxied connection.

Both ends are asyncio transports: a TCP socket's, or an `HboneStream` (which behaves like one). Bytes
are written through as they arrive; an EOF on one side becomes a half-close on the other; flow control
is the transports' own: when one side's write buffer passes its high-water mark, the other side stops
reading until it drains (a socket relayed with an HBONE stream at 1 MiB, `APP_HIGH_WATER`, so that
a received batch of DATA does not pause the stream every time). The copy is done when both
directions have ended or either side is lost.

`Inbox` is the protocol of a connection that is accepted but not yet relayed: it holds what arrives
(so a handshake such as SOCKS5 can read from it) until `start_relay` takes the transport over. What
was taken out of it to be sent on ahead of the relay (`forward_early`: an HBONE CONNECT's early data)
is counted by the relay as if it had carried it. The counts are kept in a `RelayCounts` the caller
may give, and read when it likes (the metrics read them when scraped): nothing is called per read.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from mypy_extensions import mypyc_attr

from hbone.stream import HboneStream

# Accepted-but-not-yet-relayed connections hold at most this much before reading is paused.
INBOX_LIMIT = 256 * 1024
# Write-buffer high-water mark of a socket relayed with an HBONE stream: a received batch of DATA
# (up to 256 KiB) written to it must not pause the stream each time (the default mark is 64 KiB).
APP_HIGH_WATER = 1024 * 1024


# Subclassed by the proxy's accept protocol (an interpreted class, when this module is compiled).
@mypyc_attr(allow_interpreted_subclasses=True)
class Inbox(asyncio.Protocol):
    """Buffers an accepted connection's bytes until it is relayed; `wait_data` lets a handshake wait for them."""

    __slots__ = ("_paused", "_waiter", "buffer", "eof", "error", "forwarded", "lost", "transport")

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.eof = False
        self.lost = False
        self.error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        self.forwarded = 0  # bytes taken by `forward_early`, counted when the relay starts

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement the interface without subclassing asyncio.Transport.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if len(self.buffer) >= INBOX_LIMIT and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake()
        return True  # keep the transport open: the other direction may still flow

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.error = exc
        self._wake()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        self._waiter = asyncio.get_running_loop().create_future()
        await self._waiter

    async def wait_data(self) -> None:
        """Wait until some bytes are buffered; raise EOFError if the connection ends first."""
        while not self.buffer:
            if self.eof or self.lost:
                raise EOFError("connection ended")
            await self._wait()

    def take(self) -> bytes:
        data = bytes(self.buffer)
        self.buffer.clear()
        return data

    def forward_early(self) -> bytes:
        """Take what is buffered to send it on before the relay starts; the relay still counts it."""
        data = self.take()
        self.forwarded += len(data)
        return data


class RelayCounts:
    """Bytes copied so far each way, as the relay copies them: `a_to_b` from side a to side b."""

    __slots__ = ("a_to_b", "b_to_a")

    def __init__(self) -> None:
        self.a_to_b = 0
        self.b_to_a = 0


@dataclass(slots=True)
class RelayResult:
    """Bytes copied each way. A reset or a broken pipe ends a copy as normally as an EOF does (TCP
    has no other way to say "gone"), so how it ended is not part of the result."""

    a_to_b: int
    b_to_a: int


class _End(asyncio.Protocol):
    """The protocol installed on one side of a relay."""

    __slots__ = ("counts", "eof", "from_a", "lost", "peer", "relay", "transport", "write_peer")

    def __init__(self, relay: _Relay, transport: asyncio.Transport, counts: RelayCounts, from_a: bool):
        self.relay = relay
        self.transport = transport
        self.peer: _End
        self.write_peer: Callable[[bytes], None]  # the other side's `transport.write`, bound once
        self.counts = counts
        self.from_a = from_a  # which of the counts this side's bytes add to
        self.eof = False
        self.lost = False

    def data_received(self, data: bytes) -> None:
        # The hot path of the relay: one write through, one count; nothing per chunk else.
        if self.from_a:
            self.counts.a_to_b += len(data)
        else:
            self.counts.b_to_a += len(data)
        self.write_peer(data)

    def count(self, n: int) -> None:
        if self.from_a:
            self.counts.a_to_b += n
        else:
            self.counts.b_to_a += n

    def eof_received(self) -> bool:
        self.eof = True
        peer = self.peer.transport
        if not peer.is_closing():
            if peer.can_write_eof():
                peer.write_eof()
            else:
                peer.close()
        self.relay.maybe_done()
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.relay.lost(self, exc)

    def pause_writing(self) -> None:
        self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        self.peer.transport.resume_reading()


class _Relay:
    __slots__ = ("a", "b", "counts", "done")

    def __init__(self, counts: RelayCounts) -> None:
        self.done: asyncio.Future[RelayResult] = asyncio.get_running_loop().create_future()
        self.counts = counts
        self.a: _End
        self.b: _End

    def _finish(self) -> None:
        if not self.done.done():
            self.done.set_result(RelayResult(self.counts.a_to_b, self.counts.b_to_a))

    def maybe_done(self) -> None:
        if self.a.eof and self.b.eof:
            for end in (self.a, self.b):
                if not end.transport.is_closing():
                    end.transport.close()
            self._finish()

    def lost(self, end: _End, exc: Exception | None) -> None:
        other = end.peer
        if not other.lost and not other.transport.is_closing():
            if exc is not None:
                other.transport.abort()
            else:
                other.transport.close()
        if other.lost or exc is not None or (self.a.eof and self.b.eof):
            self._finish()
        elif not end.eof:
            # Lost without an EOF first (reset, or the stream was torn down): nothing more will
            # come from this side, so the copy ends when the other side goes too.
            end.eof = True
            self.maybe_done()


def start_relay(
    a: asyncio.Transport,
    b: asyncio.Transport,
    *,
    a_inbox: Inbox | None = None,
    b_inbox: Inbox | None = None,
    counts: RelayCounts | None = None,
) -> asyncio.Future[RelayResult]:
    """Start copying bytes between two transports until both directions end; the future's result is
    the byte counts, which `counts` (if given) holds live meanwhile.

    An `Inbox` given for a side is the protocol that side had until now: what it holds (bytes, an
    EOF, the loss of the connection) is replayed first. Both transports are closed when the copy
    ends. Nothing waits in a coroutine meanwhile: a held connection is this future and two
    protocols. Cancelling the future ends the copy; the caller then aborts both transports.
    """
    if counts is None:
        counts = RelayCounts()
    r = _Relay(counts)
    end_a = _End(r, a, counts, True)
    end_b = _End(r, b, counts, False)
    end_a.peer, end_b.peer = end_b, end_a
    end_a.write_peer, end_b.write_peer = b.write, a.write
    r.a, r.b = end_a, end_b
    a.set_protocol(end_a)
    b.set_protocol(end_b)
    for side, other in ((a, b), (b, a)):
        if isinstance(other, HboneStream) and not isinstance(side, HboneStream):
            side.set_write_buffer_limits(high=APP_HIGH_WATER)
    for end, inbox in ((end_a, a_inbox), (end_b, b_inbox)):
        if inbox is None:
            continue
        if inbox.forwarded:
            end.count(inbox.forwarded)
        if inbox.buffer:
            end.data_received(inbox.take())
        if inbox.eof:
            end.eof_received()
        if inbox.lost:
            end.connection_lost(inbox.error if isinstance(inbox.error, Exception) else None)
    if not r.done.done():
        a.resume_reading()
        b.resume_reading()
    return r.done
