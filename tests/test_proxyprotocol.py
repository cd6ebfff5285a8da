"""The PROXY protocol v2 writer and reader, without sockets."""

from __future__ import annotations

import ipaddress

import pytest

from ztunnel.proxy.proxyprotocol import (
    SIGNATURE,
    TLV_PEER_IDENTITY,
    Command,
    ProxyHeader,
    ProxyProtocolError,
    decode,
    encode,
    encode_tunnel_header,
)

IP = ipaddress.ip_address
CLIENT_ID = "spiffe://cluster.local/ns/demo/sa/client"


def test_ipv4_header_bytes_with_the_identity_tlv() -> None:
    header = encode_tunnel_header((IP("10.0.0.1"), 41000), (IP("10.96.0.1"), 80), CLIENT_ID)
    tlv = bytes([0xD0]) + len(CLIENT_ID).to_bytes(2, "big") + CLIENT_ID.encode()
    body = bytes([10, 0, 0, 1, 10, 96, 0, 1]) + (41000).to_bytes(2, "big") + (80).to_bytes(2, "big") + tlv
    assert header == b"\r\n\r\n\x00\r\nQUIT\n" + bytes([0x21, 0x11]) + len(body).to_bytes(2, "big") + body


def test_ipv6_header_bytes() -> None:
    header = encode((IP("fd00::1"), 1), (IP("fd00::2"), 2))
    assert header[12:16] == bytes([0x21, 0x21, 0, 36])
    assert header[16:32] == IP("fd00::1").packed
    assert header[32:48] == IP("fd00::2").packed
    assert header[48:] == b"\x00\x01\x00\x02"


def test_no_identity_no_tlv() -> None:
    header = encode_tunnel_header((IP("10.0.0.1"), 1), (IP("10.0.0.2"), 2), None)
    assert len(header) == 16 + 12
    parsed = decode(header)
    assert parsed is not None and parsed[0].peer_identity is None


def test_mixed_families_are_sent_as_ipv6() -> None:
    header = encode((IP("10.0.0.1"), 5), (IP("fd00::2"), 6))
    parsed = decode(header)
    assert parsed is not None
    src, dst = parsed[0].source, parsed[0].destination
    assert src == (IP("::ffff:10.0.0.1"), 5) and dst == (IP("fd00::2"), 6)


@pytest.mark.parametrize(
    ("src", "dst"),
    [(("10.0.0.1", 41000), ("10.96.0.1", 80)), (("fd00::1", 65535), ("fd00::2", 0))],
)
def test_round_trip_and_what_follows_is_left_alone(src: tuple[str, int], dst: tuple[str, int]) -> None:
    source, destination = (IP(src[0]), src[1]), (IP(dst[0]), dst[1])
    header = encode_tunnel_header(source, destination, CLIENT_ID)
    parsed = decode(header + b"GET / HTTP/1.1\r\n")
    assert parsed == (
        ProxyHeader(Command.PROXY, source, destination, ((TLV_PEER_IDENTITY, CLIENT_ID.encode()),)),
        len(header),
    )
    assert parsed[0].peer_identity == CLIENT_ID


def test_every_prefix_asks_for_more() -> None:
    header = encode_tunnel_header((IP("10.0.0.1"), 1), (IP("10.0.0.2"), 2), CLIENT_ID)
    for n in range(len(header)):
        assert decode(header[:n]) is None, n


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (b"PROXY TCP4 10.0.0.1 10.0.0.2 1 2\r\n", "no PROXY v2 signature"),
        (SIGNATURE + bytes([0x11, 0x11, 0, 0]), "unsupported version 1"),
        (SIGNATURE + bytes([0x2F, 0x11, 0, 0]), "unknown command 15"),
        (SIGNATURE + bytes([0x21, 0x31, 0, 0]), "unsupported address family/transport 0x31"),
        (SIGNATURE + bytes([0x21, 0x11, 0, 4]) + bytes(4), "address block shorter than its family needs"),
        (SIGNATURE + bytes([0x21, 0x11, 0, 14]) + bytes(12) + b"\xd0\x00", "truncated TLV"),
        (SIGNATURE + bytes([0x21, 0x11, 0, 16]) + bytes(12) + b"\xd0\x00\x05x", "truncated TLV value"),
    ],
)
def test_invalid_headers(data: bytes, error: str) -> None:
    with pytest.raises(ProxyProtocolError, match=error):
        decode(data)


def test_local_command_has_no_addresses() -> None:
    data = SIGNATURE + bytes([0x20, 0x00, 0, 0])
    assert decode(data) == (ProxyHeader(Command.LOCAL, None, None), 16)


def test_oversized_tlv_is_refused() -> None:
    with pytest.raises(ValueError, match="invalid TLV"):
        encode((IP("10.0.0.1"), 1), (IP("10.0.0.2"), 2), [(0xD0, bytes(70_000))])
