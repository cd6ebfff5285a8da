"""Messages (and fds) over a `SOCK_SEQPACKET` socket pair, standard library only.

The framing is its own sans-IO part: `encode` cuts a pickled message into packets of at most
`CHUNK` bytes plus a one-byte header (`MORE` or `LAST`); a `Reassembler` is fed packets and returns
the message on the last one. File descriptors travel on the last packet of their message. `Channel`
runs that over a non-blocking socket in an event loop.
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
        """(True, message) on a message's last packet, else (False, None)."""
        header, body = packet[:1], packet[1:]
        if header not in (MORE, LAST):
            self._parts.clear()
            raise ChannelError(f"bad packet header {header!r} on the worker channel")
        self._parts.append(body)
        if header == MORE:
            return False, None
        data, self._parts = b"".join(self._parts), []
        return True, pickle.loads(data)


def recv_packet(sock: socket.socket) -> tuple[bytes, list[int]]:
    """One packet and its fds (b"" once the peer is gone); a truncated one is an error."""
    data, fds, flags, _ = socket.recv_fds(sock, CHUNK + 1, MAX_FDS, socket.MSG_CMSG_CLOEXEC)
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        close_fds(fds)
        raise ChannelError("truncated packet on the worker channel")
    return data, fds


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
        """The next message and its fds; None once the peer is gone."""
        while True:
            data, fds = await self._io(lambda: recv_packet(self.sock), writable=False)
            if not data:
                return None
            done, message = self._reassembler.feed(data)
            if done:
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
