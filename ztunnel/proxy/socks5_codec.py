"""The SOCKS5 codec: the handshake (RFC 1928, no authentication, CONNECT only) as a sans-I/O state
machine, and the replies.

`Socks5Handshake.receive(data)` consumes bytes and returns the events they complete; what must be
written back is collected in `data_to_send()`. The listener (`ztunnel.proxy.socks5_listener`) only
moves bytes. Reply codes are RFC 1928's; success is replied only once the upstream is established.
"""

from __future__ import annotations

import enum
import ipaddress
import struct
from dataclasses import dataclass

VERSION = 5
NO_AUTH = 0x00
NO_ACCEPTABLE_METHOD = 0xFF
CMD_CONNECT = 0x01
ATYP_IPV4 = 0x01
ATYP_DOMAIN = 0x03
ATYP_IPV6 = 0x04


class Reply(enum.IntEnum):
    SUCCEEDED = 0x00
    GENERAL_FAILURE = 0x01
    NOT_ALLOWED = 0x02
    NETWORK_UNREACHABLE = 0x03
    HOST_UNREACHABLE = 0x04
    CONNECTION_REFUSED = 0x05
    TTL_EXPIRED = 0x06
    COMMAND_NOT_SUPPORTED = 0x07
    ADDRESS_TYPE_NOT_SUPPORTED = 0x08


@dataclass(frozen=True, slots=True)
class ConnectRequested:
    """The client asked to CONNECT to `host:port`; host is an IP address or a domain name."""

    host: ipaddress.IPv4Address | ipaddress.IPv6Address | str
    port: int


@dataclass(frozen=True, slots=True)
class HandshakeFailed:
    """The handshake cannot go on; the reply (if any) is already queued. Close after sending it."""

    reason: str


Event = ConnectRequested | HandshakeFailed


class InvalidDomain(ValueError):
    """A requested domain name that no resolver can take: not UTF-8, refused by IDNA (an empty
    label such as `.`, a label over 63 bytes, a BIDI violation), or holding a control character.
    A listener that resolves names itself answers it with `Reply.HOST_UNREACHABLE`."""


def domain_name(raw: bytes) -> str:
    """The domain of a request (ASCII, `xn--` labels decoded, or UTF-8) checked the way name
    resolution will encode it, so that resolving it cannot fail with anything but a lookup error."""
    try:
        host = raw.decode("idna" if raw.isascii() else "utf-8")
        host.encode("idna")  # what getaddrinfo does with a str; it raises UnicodeError
    except UnicodeError as e:
        raise InvalidDomain(f"invalid domain name {raw[:64]!r}: {e}") from None
    if not host:
        raise InvalidDomain("empty domain name")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in host):  # a NUL ends a C string: never resolvable
        raise InvalidDomain(f"control character in domain name {raw[:64]!r}")
    return host


class _State(enum.Enum):
    GREETING = 1
    REQUEST = 2
    DONE = 3


def encode_reply(code: Reply, bind: tuple[str, int] | None = None) -> bytes:
    """A reply with the bound address (0.0.0.0:0 unless given)."""
    host, port = bind or ("0.0.0.0", 0)
    ip = ipaddress.ip_address(host)
    atyp = ATYP_IPV4 if ip.version == 4 else ATYP_IPV6
    return bytes((VERSION, code, 0, atyp)) + ip.packed + struct.pack("!H", port)


class Socks5Handshake:
    def __init__(self) -> None:
        self._buf = bytearray()
        self._out = bytearray()
        self._state = _State.GREETING

    def data_to_send(self) -> bytes:
        out = bytes(self._out)
        self._out.clear()
        return out

    def reply(self, code: Reply, bind: tuple[str, int] | None = None) -> None:
        self._out += encode_reply(code, bind)

    def receive(self, data: bytes) -> list[Event]:
        self._buf += data
        events: list[Event] = []
        while self._state is not _State.DONE:
            event = self._step()
            if event is None:
                break
            events.append(event)
        return events

    def _fail(self, reason: str, reply: Reply | None) -> HandshakeFailed:
        if reply is not None:
            self.reply(reply)
        self._state = _State.DONE
        return HandshakeFailed(reason)

    def _step(self) -> Event | None:
        buf = self._buf
        if self._state is _State.GREETING:
            if len(buf) < 2:
                return None
            if buf[0] != VERSION:
                return self._fail(f"unsupported SOCKS version {buf[0]}", None)
            n = buf[1]
            if len(buf) < 2 + n:
                return None
            methods = bytes(buf[2 : 2 + n])
            del buf[: 2 + n]
            if NO_AUTH not in methods:
                self._out += bytes((VERSION, NO_ACCEPTABLE_METHOD))
                return self._fail("client offers no acceptable authentication method", None)
            self._out += bytes((VERSION, NO_AUTH))
            self._state = _State.REQUEST
            return self._step()
        # REQUEST: VER CMD RSV ATYP ADDR PORT
        if len(buf) < 5:
            return None
        if buf[0] != VERSION:
            return self._fail(f"unsupported SOCKS version {buf[0]}", Reply.GENERAL_FAILURE)
        atyp = buf[3]
        if atyp == ATYP_IPV4:
            size = 4 + 4 + 2
        elif atyp == ATYP_IPV6:
            size = 4 + 16 + 2
        elif atyp == ATYP_DOMAIN:
            size = 4 + 1 + buf[4] + 2
        else:
            return self._fail(f"unsupported address type {atyp}", Reply.ADDRESS_TYPE_NOT_SUPPORTED)
        if len(buf) < size:
            return None
        cmd = buf[1]
        raw = bytes(buf[:size])
        del buf[:size]
        (port,) = struct.unpack("!H", raw[-2:])
        if cmd != CMD_CONNECT:
            return self._fail(f"unsupported command {cmd}", Reply.COMMAND_NOT_SUPPORTED)
        host: ipaddress.IPv4Address | ipaddress.IPv6Address | str
        if atyp == ATYP_IPV4:
            host = ipaddress.IPv4Address(raw[4:8])
        elif atyp == ATYP_IPV6:
            host = ipaddress.IPv6Address(raw[4:20])
        else:
            try:
                host = domain_name(raw[5:-2])
            except InvalidDomain as e:
                # The name can never resolve: the client hears "host unreachable" before the close.
                return self._fail(str(e), Reply.HOST_UNREACHABLE)
        self._state = _State.DONE
        return ConnectRequested(host, port)

    @property
    def leftover(self) -> bytes:
        """Bytes the client sent after its request (payload that must be relayed upstream)."""
        return bytes(self._buf)
