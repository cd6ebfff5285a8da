"""PROXY protocol version 2, without I/O.

An application tunnel of protocol PROXY starts the stream delivered to the app with a PROXY v2
header: command PROXY over TCP, the client address the server proxy saw as source, the tunnel target
as destination, and TLV 0xD0 carrying the client's SPIFFE identity when it is known. `encode` builds
such a header; `decode` parses one from the front of a buffer (for apps, tests and fuzzers).

Only the parts ztunnel uses are modelled: TCP over IPv4 or IPv6, the PROXY and LOCAL commands, and
TLVs as opaque (type, value) pairs.
"""

from __future__ import annotations

import enum
import ipaddress
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from mesh.model import IPAddress

SIGNATURE = b"\r\n\r\n\x00\r\nQUIT\n"
VERSION_2 = 0x20
FAMILY_TCP4 = 0x11
FAMILY_TCP6 = 0x21
FAMILY_UNSPEC = 0x00
# ztunnel's TLVs, in the range PROXY v2 reserves for custom use (0xE0 and up is "experimental";
# Istio took 0xD0/0xD1). Only the identity is written, as by the reference.
TLV_PEER_IDENTITY = 0xD0
TLV_SERVICE_HOSTNAME = 0xD1

_FIXED = struct.Struct("!12sBBH")  # signature, version|command, family|transport, length
_ADDR4 = struct.Struct("!4s4sHH")
_ADDR6 = struct.Struct("!16s16sHH")
_TLV = struct.Struct("!BH")
HEADER_MIN = _FIXED.size  # 16: a decoder needs this much to know the whole length

Address = tuple[IPAddress, int]


class Command(enum.IntEnum):
    LOCAL = 0x0
    PROXY = 0x1


class ProxyProtocolError(ValueError):
    """The bytes are not a valid PROXY v2 header."""


@dataclass(frozen=True, slots=True)
class ProxyHeader:
    command: Command
    source: Address | None  # None for LOCAL or an unspecified family
    destination: Address | None
    tlvs: tuple[tuple[int, bytes], ...] = ()

    def tlv(self, kind: int) -> bytes | None:
        """The value of the first TLV of this type."""
        for t, value in self.tlvs:
            if t == kind:
                return value
        return None

    @property
    def peer_identity(self) -> str | None:
        """The client's SPIFFE identity ztunnel sent in TLV 0xD0."""
        value = self.tlv(TLV_PEER_IDENTITY)
        return value.decode("utf-8", "replace") if value is not None else None


def _as_v6(ip: IPAddress) -> ipaddress.IPv6Address:
    return ip if isinstance(ip, ipaddress.IPv6Address) else ipaddress.IPv6Address(f"::ffff:{ip}")


def encode(source: Address, destination: Address, tlvs: Sequence[tuple[int, bytes]] = ()) -> bytes:
    """A PROXY v2 header, command PROXY over TCP. Mixed families are sent as IPv6 (IPv4-mapped)."""
    (src_ip, src_port), (dst_ip, dst_port) = source, destination
    if src_ip.version == 4 and dst_ip.version == 4:
        family = FAMILY_TCP4
        addresses = _ADDR4.pack(src_ip.packed, dst_ip.packed, src_port, dst_port)
    else:
        family = FAMILY_TCP6
        addresses = _ADDR6.pack(_as_v6(src_ip).packed, _as_v6(dst_ip).packed, src_port, dst_port)
    parts = [addresses]
    for kind, value in tlvs:
        if not 0 <= kind <= 0xFF or len(value) > 0xFFFF:
            raise ValueError(f"invalid TLV: type {kind}, {len(value)} bytes")
        parts.append(_TLV.pack(kind, len(value)) + value)
    body = b"".join(parts)
    if len(body) > 0xFFFF:
        raise ValueError("PROXY v2 header too long")
    return _FIXED.pack(SIGNATURE, VERSION_2 | Command.PROXY, family, len(body)) + body


def encode_tunnel_header(source: Address, destination: Address, peer_identity: str | None) -> bytes:
    """The header of an application tunnel: TLV 0xD0 with the client identity when known."""
    tlvs = [(TLV_PEER_IDENTITY, peer_identity.encode())] if peer_identity else []
    return encode(source, destination, tlvs)


def decode(data: bytes | bytearray | memoryview) -> tuple[ProxyHeader, int] | None:
    """Parse a header at the start of `data`: the header and its length, or None if more bytes are
    needed. Raises `ProxyProtocolError` when the bytes cannot be a PROXY v2 header."""
    view = memoryview(data)
    prefix = bytes(view[: len(SIGNATURE)])
    if not SIGNATURE.startswith(prefix):
        raise ProxyProtocolError("no PROXY v2 signature")
    if len(view) < HEADER_MIN:
        return None
    _, ver_cmd, family, length = _FIXED.unpack_from(view)
    if ver_cmd & 0xF0 != VERSION_2:
        raise ProxyProtocolError(f"unsupported version {ver_cmd >> 4}")
    try:
        command = Command(ver_cmd & 0x0F)
    except ValueError:
        raise ProxyProtocolError(f"unknown command {ver_cmd & 0x0F}") from None
    total = HEADER_MIN + length
    if len(view) < total:
        return None
    body = view[HEADER_MIN:total]
    source: Address | None = None
    destination: Address | None = None
    fixed: struct.Struct | None
    if family == FAMILY_TCP4:
        fixed = _ADDR4
    elif family == FAMILY_TCP6:
        fixed = _ADDR6
    elif family == FAMILY_UNSPEC:
        fixed = None
    else:
        raise ProxyProtocolError(f"unsupported address family/transport 0x{family:02x}")
    offset = 0
    if fixed is not None:
        if len(body) < fixed.size:
            raise ProxyProtocolError("address block shorter than its family needs")
        src, dst, sport, dport = fixed.unpack_from(body)
        source = (ipaddress.ip_address(src), sport)
        destination = (ipaddress.ip_address(dst), dport)
        offset = fixed.size
    tlvs = []
    while offset < len(body):
        if len(body) - offset < _TLV.size:
            raise ProxyProtocolError("truncated TLV")
        kind, n = _TLV.unpack_from(body, offset)
        offset += _TLV.size
        if len(body) - offset < n:
            raise ProxyProtocolError("truncated TLV value")
        tlvs.append((kind, bytes(body[offset : offset + n])))
        offset += n
    if command is Command.LOCAL:
        source = destination = None  # LOCAL: the receiver must ignore the addresses
    return ProxyHeader(command, source, destination, tuple(tlvs)), total
