"""PROXY v2 without I/O: headers written by `encode` read back equal at every split of the bytes,
and any other bytes are a header, "need more", or a `ProxyProtocolError`, nothing else."""

from __future__ import annotations

import ipaddress

from hypothesis import given
from hypothesis import strategies as st

from ztunnel.proxy.proxyprotocol import (
    HEADER_MIN,
    SIGNATURE,
    Command,
    ProxyProtocolError,
    decode,
    encode,
    encode_tunnel_header,
)

ADDRESSES = st.one_of(
    st.builds(ipaddress.IPv4Address, st.integers(0, 2**32 - 1)),
    st.builds(ipaddress.IPv6Address, st.integers(0, 2**128 - 1)),
)
ENDPOINTS = st.tuples(ADDRESSES, st.integers(0, 65535))
TLVS = st.lists(st.tuples(st.integers(0, 255), st.binary(max_size=40)), max_size=4)


def _mapped(ip: ipaddress.IPv4Address | ipaddress.IPv6Address, mixed: bool) -> object:
    return ipaddress.IPv6Address(f"::ffff:{ip}") if mixed and ip.version == 4 else ip


@given(ENDPOINTS, ENDPOINTS, TLVS, st.binary(max_size=8))
def test_encoded_headers_decode_back_at_every_split(
    source: tuple, destination: tuple, tlvs: list[tuple[int, bytes]], payload: bytes
) -> None:
    header = encode(source, destination, tlvs)
    for i in range(len(header)):
        assert decode(header[:i]) is None
    decoded = decode(header + payload)
    assert decoded is not None
    got, length = decoded
    assert length == len(header)
    mixed = source[0].version != destination[0].version or source[0].version == 6
    assert got.command is Command.PROXY
    assert got.source == (_mapped(source[0], mixed), source[1])
    assert got.destination == (_mapped(destination[0], mixed), destination[1])
    assert got.tlvs == tuple(tlvs)


@given(ENDPOINTS, ENDPOINTS, st.one_of(st.none(), st.text(max_size=40)))
def test_tunnel_headers_carry_the_identity(source: tuple, destination: tuple, identity: str | None) -> None:
    decoded = decode(encode_tunnel_header(source, destination, identity))
    assert decoded is not None
    assert decoded[0].peer_identity == (identity or None)


@st.composite
def mangled(draw: st.DrawFn) -> bytes:
    header = bytearray(encode(draw(ENDPOINTS), draw(ENDPOINTS), draw(TLVS)))
    for _ in range(draw(st.integers(0, 4))):
        i = draw(st.integers(HEADER_MIN - 4, len(header) - 1))  # version, family, length and body
        header[i] = draw(st.integers(0, 255))
    if draw(st.booleans()):
        header = header[: draw(st.integers(0, len(header)))]
    return bytes(header) if draw(st.integers(0, 4)) else draw(st.binary(max_size=64))


@given(st.one_of(mangled(), st.binary(max_size=40).map(lambda b: SIGNATURE + b)))
def test_other_bytes_are_a_header_more_or_a_typed_error(data: bytes) -> None:
    try:
        decoded = decode(data)
    except ProxyProtocolError:
        return
    if decoded is not None:
        header, length = decoded
        assert HEADER_MIN <= length <= len(data)
        if header.command is Command.LOCAL:
            assert header.source is None and header.destination is None
