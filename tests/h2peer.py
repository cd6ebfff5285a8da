"""A raw HTTP/2 peer over real mTLS, for abuse tests: it writes frames exactly as told (no state
machine of its own, so it can break every rule) and reads back what the server sends.

Frames are built by hand (`frame`) or with `hpack` for header blocks; received frames are split by
their 9-byte headers. Used against in-process `HboneServer`s and against proxy processes.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import struct
from collections.abc import Callable
from dataclasses import dataclass

import hpack

from hbone.tls import TlsCredentials, WorkloadCertificate

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 0, 1, 3, 4, 6, 7, 8, 9
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4
NO_ERROR, PROTOCOL_ERROR, STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL = (
    0x0,
    0x1,
    0x5,
    0x6,
    0x7,
    0x8,
)
ENHANCE_YOUR_CALM = 0xB


def frame(
    ftype: int, flags: int, stream_id: int, payload: bytes = b"", *, length: int | None = None
) -> bytes:
    """One frame; `length` lets the header claim another length than the payload's."""
    n = len(payload) if length is None else length
    return struct.pack(">HBBBL", n >> 8, n & 0xFF, ftype, flags, stream_id) + payload


def rst(stream_id: int, code: int = CANCEL) -> bytes:
    return frame(RST_STREAM, 0, stream_id, struct.pack(">L", code))


def ping(data: bytes = b"12345678") -> bytes:
    return frame(PING, 0, 0, data)


@dataclass(frozen=True)
class Frame:
    type: int
    flags: int
    stream_id: int
    payload: bytes

    @property
    def error_code(self) -> int:
        """For GOAWAY and RST_STREAM."""
        if self.type == GOAWAY:
            return int(struct.unpack(">L", self.payload[4:8])[0])
        return int(struct.unpack(">L", self.payload[:4])[0])


class RawH2:
    """One TLS connection speaking raw HTTP/2 frames."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.encoder = hpack.Encoder()
        self.received: list[Frame] = []
        self._buf = b""

    @classmethod
    async def connect(
        cls, addr: tuple[str, int], cert: WorkloadCertificate, *, rcvbuf: int | None = None
    ) -> RawH2:
        ctx: ssl.SSLContext = TlsCredentials.build(cert).client
        if rcvbuf is not None:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, addr)
            reader, writer = await asyncio.open_connection(sock=sock, ssl=ctx, server_hostname="")
        else:
            reader, writer = await asyncio.open_connection(*addr, ssl=ctx, server_hostname="")
        peer = cls(reader, writer)
        peer.send(PREFACE + frame(SETTINGS, 0, 0))
        # As every HTTP/2 peer: acknowledge the server's SETTINGS (else it gives up on us).
        await peer.read_until(lambda f: f.type == SETTINGS and not f.flags & ACK, 10.0)
        peer.send(frame(SETTINGS, ACK, 0))
        await writer.drain()
        return peer

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    def connect_headers(
        self, stream_id: int, authority: str = "127.0.0.1:80", *, end_headers: bool = True
    ) -> bytes:
        block = self.encoder.encode([(":method", "CONNECT"), (":authority", authority)])
        return frame(HEADERS, END_HEADERS if end_headers else 0, stream_id, block)

    async def read_until(self, check: Callable[[Frame], bool], timeout: float) -> Frame:
        """Read frames until one matches `check`; EOF raises EOFError, the timeout TimeoutError."""
        deadline = asyncio.get_running_loop().time() + timeout
        for f in self.received:
            if check(f):
                return f
        while True:
            while len(self._buf) >= 9:
                hi, lo, ftype, flags, sid = struct.unpack(">HBBBL", self._buf[:9])
                n = (hi << 8) | lo
                if len(self._buf) < 9 + n:
                    break
                f = Frame(ftype, flags, sid & 0x7FFFFFFF, self._buf[9 : 9 + n])
                self._buf = self._buf[9 + n :]
                self.received.append(f)
                if check(f):
                    return f
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                raise TimeoutError(f"no matching frame within {timeout}s; got {self.summary()}")
            chunk = await asyncio.wait_for(self.reader.read(1 << 20), left)
            if not chunk:
                raise EOFError(f"connection closed; got {self.summary()}")
            self._buf += chunk

    async def goaway(self, timeout: float = 10.0) -> Frame:
        return await self.read_until(lambda f: f.type == GOAWAY, timeout)

    def summary(self) -> str:
        counts: dict[int, int] = {}
        for f in self.received:
            counts[f.type] = counts.get(f.type, 0) + 1
        return ", ".join(f"type {t}: {n}" for t, n in sorted(counts.items()))

    def close(self) -> None:
        self.writer.transport.abort()


class RawH2Server:
    """A TLS listener on 127.0.0.1 whose connections are `RawH2` peers (server side: no preface)."""

    def __init__(self, cert: WorkloadCertificate) -> None:
        self.context = TlsCredentials.build(cert).server
        self.peers: asyncio.Queue[RawH2] = asyncio.Queue()
        self.server: asyncio.Server | None = None
        self.addr: tuple[str, int] = ("127.0.0.1", 0)

    async def start(self) -> None:
        async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await self.peers.put(RawH2(reader, writer))

        self.server = await asyncio.start_server(accepted, "127.0.0.1", 0, ssl=self.context)
        self.addr = self.server.sockets[0].getsockname()[:2]

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()


def settings_of(f: Frame) -> dict[int, int]:
    return {
        struct.unpack(">H", f.payload[i : i + 2])[0]: struct.unpack(">L", f.payload[i + 2 : i + 6])[0]
        for i in range(0, len(f.payload), 6)
    }
