"""Our HPACK encoder, read back by the general decoder (hpack's, as every peer's would)."""

from __future__ import annotations

import pytest
from hpack import Decoder

from hbone.hpack import HeaderFieldError, StaticEncoder, encode_field


def decoded(blocks: list[bytes]) -> list[list[tuple[str, str]]]:
    decoder = Decoder()
    return [[(k.decode(), v.decode()) for k, v in decoder.decode(b, raw=True)] for b in blocks]


def test_blocks_read_back_by_the_general_decoder() -> None:
    enc = StaticEncoder()
    connect = [
        (":method", "CONNECT"),
        (":authority", "10.0.0.2:8080"),
        ("baggage", "k8s.namespace.name=demo," + "x" * 300),  # a length past the 7-bit prefix
        ("forwarded", 'for="10.0.0.1:34567"'),
        ("x-custom-name", "ünïcode"),
    ]
    ok = [(":status", "200"), ("content-length", "0")]
    blocks = [enc.encode(connect), enc.encode(ok), enc.encode(connect)]
    assert decoded(blocks) == [connect, ok, connect]


def test_first_block_empties_the_dynamic_table_and_later_ones_repeat_nothing() -> None:
    enc = StaticEncoder()
    first, second = enc.encode([(":status", "200")]), enc.encode([(":status", "200")])
    assert first == b"\x20\x88"  # size update to 0, then static entry 8
    assert second == b"\x88"


def test_fields_use_the_static_table_and_raw_literals() -> None:
    assert encode_field(":method", "GET") == b"\x82"
    # :authority (static 1) by index, the value as a raw literal.
    assert encode_field(":authority", "a:1") == b"\x01\x03a:1"
    assert encode_field("x-a", "b") == b"\x00\x03x-a\x01b"


def test_names_are_lowercased_and_values_trimmed() -> None:
    assert decoded([StaticEncoder().encode([("Forwarded", "  for=x \t")])]) == [[("forwarded", "for=x")]]


@pytest.mark.parametrize(
    ("name", "value"),
    [("bad name", "v"), ("", "v"), ("a:b", "v"), ("x", "a\r\nInjected: 1"), ("x", "nul\x00"), ("x", "lf\n")],
)
def test_fields_http2_forbids_are_refused(name: str, value: str) -> None:
    with pytest.raises(HeaderFieldError):
        StaticEncoder().encode([(name, value)])
