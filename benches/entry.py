"""How the load generator reaches the sink: an `Entry` (straight, or through a ztunnel's SOCKS5
listener with the greeting, the CONNECT and the first payload in one write), and the sockets it opens.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass
from typing import Any

Address = tuple[str, int]


@dataclass(frozen=True)
class Entry:
    kind: str  # "direct" | "socks5"
    echo: Address
    discard: Address
    proxy: Address | None = None
    tools: str | None = None  # the C tools binary: rr and connrate run in C
    iperf3: Address | None = None  # an iperf3 server: throughput runs are iperf3's
    half_close: bool = True  # integrity: the client half-closes and reads to the echo's EOF

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Entry:
        proxy, iperf3 = raw.get("proxy"), raw.get("iperf3")
        return cls(
            kind=raw["kind"],
            echo=(raw["echo"][0], int(raw["echo"][1])),
            discard=(raw["discard"][0], int(raw["discard"][1])),
            proxy=(proxy[0], int(proxy[1])) if proxy else None,
            tools=raw.get("tools"),
            iperf3=(iperf3[0], int(iperf3[1])) if iperf3 else None,
            half_close=bool(raw.get("half_close", True)),
        )

    def dial(self, target: Address) -> tuple[Address, bytes, int]:
        """(address to connect to, bytes to send first, bytes of reply to skip) for `target`."""
        if self.kind == "direct":
            return target, b"", 0
        assert self.proxy is not None
        ip = ipaddress.ip_address(target[0])
        atyp = b"\x01" if ip.version == 4 else b"\x04"
        request = b"\x05\x01\x00" + b"\x05\x01\x00" + atyp + ip.packed + target[1].to_bytes(2, "big")
        return self.proxy, request, 2 + 4 + (4 if ip.version == 4 else 16) + 2


def _check_socks_reply(reply: bytes) -> None:
    if reply[:2] != b"\x05\x00" or reply[2:4] != b"\x05\x00":
        raise ConnectionError(f"SOCKS5 refused: {reply[:4].hex()}")


# -- blocking helpers (rr) ---------------------------------------------------------------------


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def blocking_open(entry: Entry, target: Address, timeout: float = 10.0) -> socket.socket:
    addr, prefix, skip = entry.dial(target)
    sock = socket.create_connection(addr, timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if prefix:
        sock.sendall(prefix)
        _check_socks_reply(recv_exactly(sock, skip))
    return sock


# -- asyncio helpers -----------------------------------------------------------------------------


async def open_socket(entry: Entry, target: Address, payload: bytes = b"") -> socket.socket:
    """A connected non-blocking socket to `target` through `entry`; `payload` sent with the handshake."""
    loop = asyncio.get_running_loop()
    addr, prefix, skip = entry.dial(target)
    sock = socket.socket(socket.AF_INET6 if ":" in addr[0] else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await loop.sock_connect(sock, addr)
        if prefix or payload:
            await loop.sock_sendall(sock, prefix + payload)
        if skip:
            _check_socks_reply(await sock_recv_exactly(sock, skip))
    except BaseException:
        sock.close()
        raise
    return sock


async def sock_recv_exactly(sock: socket.socket, n: int) -> bytes:
    loop = asyncio.get_running_loop()
    buf = bytearray()
    while len(buf) < n:
        chunk = await loop.sock_recv(sock, n - len(buf))
        if not chunk:
            raise ConnectionError(f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)
