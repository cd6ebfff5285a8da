"""Messages (and fds) over a `SOCK_SEQPACKET` socket pair, standard library only.

The framing is its own sans-IO part: `encode` cuts a pickled message into packets of at most
`CHUNK` bytes plus a one-byte header (`MORE` or `LAST`); a `Reassembler` is fed packets and returns
the message on the last one. File descriptors travel on the last packet of their message. `Channel`
runs that over a non-blocking socket in an event loop. A message that cannot be read, or whose fds
the kernel dropped (out of descriptors), is an error of its own (`MessageLost`, `FdsLost`): the peer
is not gone, and the next message is read as usual.
"""

from __future__ import annotations

import asyncio
import functools
import os
import pickle
import socket
from collections.abc import Callable, Sequence
from typing import TypeVar

CHUNK = 60 * 1024
MORE, LAST = b"\x01", b"\x00"
MAX_FDS = 4

T = TypeVar("T")


class ChannelError(ConnectionError):
    """A packet that breaks the framing (truncated, or without a header)."""


class MessageLost(ChannelError):
    """A message that could not be read (a packet cut short, one without a header, or bytes that do
    not unpickle); the channel goes on with the next one."""


class FdsLost(ChannelError):
    """A whole message whose fds did not all arrive (this process was out of descriptors: the
    kernel dropped them); `message` and `fds` are what did."""

    def __init__(self, message: object, fds: list[int]) -> None:
        super().__init__(f"{type(message).__name__}: its file descriptors were lost (out of descriptors?)")
        self.message = message
        self.fds = fds


def encode(message: object) -> list[bytes]:
    """The packets of one message, in order (at least one)."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    chunks = [data[i : i + CHUNK] for i in range(0, len(data), CHUNK)] or [b""]
    return [(LAST if i == len(chunks) - 1 else MORE) + c for i, c in enumerate(chunks)]


class Reassembler:
    """Packets in, whole messages out."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    @property
    def partial(self) -> bool:
        """A message has begun and not ended."""
        return bool(self._parts)

    def feed(self, packet: bytes) -> tuple[bool, object]:
        """(True, message) on a message's last packet, else (False, None); `MessageLost` for a
        packet without a header (the message under way is dropped) or a message that does not
        unpickle."""
        header, body = packet[:1], packet[1:]
        if header not in (MORE, LAST):
            self._parts.clear()
            raise MessageLost(f"bad packet header {header!r} on the worker channel")
        self._parts.append(body)
        if header == MORE:
            return False, None
        data, self._parts = b"".join(self._parts), []
        try:
            return True, pickle.loads(data)
        except Exception as e:  # what unpickling raises is open-ended
            raise MessageLost(f"a message that does not unpickle: {type(e).__name__}: {e}") from None


def recv_packet(sock: socket.socket) -> tuple[bytes, list[int], bool]:
    """One packet, its fds, and whether fds were lost on the way (b"" once the peer is gone); a
    packet cut short is `MessageLost`."""
    data, fds, flags, _ = socket.recv_fds(sock, CHUNK + 1, MAX_FDS, socket.MSG_CMSG_CLOEXEC)
    if flags & socket.MSG_TRUNC:
        close_fds(fds)
        raise MessageLost("truncated packet on the worker channel")
    return data, fds, bool(flags & socket.MSG_CTRUNC)


def close_fds(fds: Sequence[int]) -> None:
    for fd in fds:
        os.close(fd)


class Channel:
    """`encode` and `Reassembler` over a non-blocking SOCK_SEQPACKET socket in the running loop."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        sock.setblocking(False)
        self._lock = asyncio.Lock()
        self._reassembler = Reassembler()
        self.closed = False

    async def send(
        self, message: object, fds: Sequence[int] = (), packets: list[bytes] | None = None
    ) -> None:
        """Send `message` (`packets`: its `encode`, made once for several channels)."""
        if packets is None:
            packets = encode(message)
        async with self._lock:  # one message's packets are never interleaved with another's
            for i, packet in enumerate(packets):
                last = list(fds) if i == len(packets) - 1 else []
                await self._io(functools.partial(socket.send_fds, self.sock, [packet], last), writable=True)

    async def recv(self) -> tuple[object, list[int]] | None:
        """The next message and its fds; None once the peer is gone. A message that could not be read
        is `MessageLost`, one whose fds were lost `FdsLost`: the next call goes on after it."""
        lost = False
        while True:
            data, fds, fds_lost = await self._io(lambda: recv_packet(self.sock), writable=False)
            if not data:
                close_fds(fds)
                return None
            lost |= fds_lost
            try:
                done, message = self._reassembler.feed(data)
            except MessageLost:
                close_fds(fds)
                raise
            if done:
                if lost:
                    raise FdsLost(message, fds)
                return message, fds
            close_fds(fds)

    async def _io(self, call: Callable[[], T], *, writable: bool) -> T:
        loop = asyncio.get_running_loop()
        fd = self.sock.fileno()
        while True:
            try:
                return call()
            except (BlockingIOError, InterruptedError):
                pass
            ready: asyncio.Future[None] = loop.create_future()
            (loop.add_writer if writable else loop.add_reader)(fd, _wake, ready)
            try:
                await ready
            finally:
                (loop.remove_writer if writable else loop.remove_reader)(fd)

    def close(self) -> None:
        self.closed = True
        self.sock.close()


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
