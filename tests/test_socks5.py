"""The SOCKS5 handshake codec, as transcripts: bytes in, events and bytes out."""

import ipaddress

import pytest

from ztunnel.proxy.socks5_codec import (
    ConnectRequested,
    HandshakeFailed,
    Reply,
    Socks5Handshake,
    encode_reply,
)


def test_ipv4_connect_in_one_write() -> None:
    hs = Socks5Handshake()
    events = hs.receive(bytes([5, 1, 0]) + bytes([5, 1, 0, 1, 127, 0, 0, 2, 0x1F, 0x90]))
    assert events == [ConnectRequested(ipaddress.IPv4Address("127.0.0.2"), 8080)]
    assert hs.data_to_send() == bytes([5, 0])


def test_ipv6_connect_byte_by_byte() -> None:
    hs = Socks5Handshake()
    wire = bytes([5, 2, 2, 0]) + bytes([5, 1, 0, 4]) + ipaddress.IPv6Address("::1").packed + b"\x00\x50"
    events = []
    for i in range(len(wire)):
        events += hs.receive(wire[i : i + 1])
    assert events == [ConnectRequested(ipaddress.IPv6Address("::1"), 80)]


def test_domain_connect_and_payload_after_request() -> None:
    hs = Socks5Handshake()
    name = b"echo.demo.svc.cluster.local"
    events = hs.receive(bytes([5, 1, 0, 5, 1, 0, 3, len(name)]) + name + b"\x01\xbb" + b"GET /")
    assert events == [ConnectRequested("echo.demo.svc.cluster.local", 443)]
    assert hs.leftover == b"GET /"


def test_no_acceptable_method() -> None:
    hs = Socks5Handshake()
    events = hs.receive(bytes([5, 1, 2]))
    assert isinstance(events[0], HandshakeFailed)
    assert hs.data_to_send() == bytes([5, 0xFF])


def test_wrong_version_is_refused_without_reply() -> None:
    hs = Socks5Handshake()
    (event,) = hs.receive(bytes([4, 1, 0, 80, 127, 0, 0, 1, 0]))
    assert isinstance(event, HandshakeFailed)
    assert hs.data_to_send() == b""


@pytest.mark.parametrize(
    ("cmd", "code"), [(2, Reply.COMMAND_NOT_SUPPORTED), (3, Reply.COMMAND_NOT_SUPPORTED)]
)
def test_bind_and_udp_are_not_supported(cmd: int, code: Reply) -> None:
    hs = Socks5Handshake()
    hs.receive(bytes([5, 1, 0]))
    hs.data_to_send()
    (event,) = hs.receive(bytes([5, cmd, 0, 1, 127, 0, 0, 1, 0, 80]))
    assert isinstance(event, HandshakeFailed)
    assert hs.data_to_send() == bytes([5, code, 0, 1, 0, 0, 0, 0, 0, 0])


def test_unknown_address_type() -> None:
    hs = Socks5Handshake()
    hs.receive(bytes([5, 1, 0]))
    hs.data_to_send()
    (event,) = hs.receive(bytes([5, 1, 0, 9, 0, 0]))
    assert isinstance(event, HandshakeFailed)
    assert hs.data_to_send()[1] == Reply.ADDRESS_TYPE_NOT_SUPPORTED


def test_incomplete_request_waits() -> None:
    hs = Socks5Handshake()
    assert hs.receive(bytes([5, 1, 0, 5, 1, 0, 1, 127])) == []


def test_reply_encoding() -> None:
    assert encode_reply(Reply.SUCCEEDED) == bytes([5, 0, 0, 1, 0, 0, 0, 0, 0, 0])
    assert encode_reply(Reply.CONNECTION_REFUSED, ("::1", 1080)) == (
        bytes([5, 5, 0, 4]) + ipaddress.IPv6Address("::1").packed + b"\x04\x38"
    )
