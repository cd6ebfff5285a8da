"""The HPACK encoder of our header blocks: static table and plain literals, no dynamic table.

What HBONE sends is a handful of short header blocks per stream (the CONNECT, the 200), most of
whose fields repeat from stream to stream (`:method`, `:authority`, `baggage`) and some never
(`traceparent`, `forwarded`). The general encoder (`hpack.Encoder`) Huffman-codes
every string and keeps a dynamic table: it costs more than the rest of a stream's set-up, and it
makes the peer Huffman-decode. This one writes each field as an indexed static entry when the
static table has it whole, else as a literal without indexing (the name indexed when the static
table has it), strings raw; the encoding of each field is remembered, as the same fields repeat.
Decoding stays the general decoder's: a peer may use every part of HPACK.

Without a dynamic table the block never refers to one, so the peer's SETTINGS_HEADER_TABLE_SIZE
changes nothing; the first block still says "dynamic table size 0" (RFC 7541 §6.3), so the peer's
decoder frees its table.

Fields are normalised and checked as they are encoded: names lowercased and without separators,
values trimmed of surrounding blanks and without CR, LF or NUL (RFC 9113 §8.2.1).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from hpack.table import HeaderTable

# The static table, RFC 7541 Appendix A: index by (name, value), and by name (its first entry).
_STATIC_FIELD: dict[tuple[bytes, bytes], int] = {}
_STATIC_NAME: dict[bytes, int] = {}
for _i, (_name, _value) in enumerate(HeaderTable.STATIC_TABLE, 1):
    _STATIC_FIELD.setdefault((_name, _value), _i)
    _STATIC_NAME.setdefault(_name, _i)

_REMEMBERED = 1024  # encoded fields kept; the cache starts over beyond that
_TABLE_SIZE_ZERO = b"\x20"  # dynamic table size update to 0 (001 prefix, 5-bit integer 0)
# A token of lowercase characters (RFC 9110 §5.6.2), after the colon of a pseudo-header.
_NAME = re.compile(rb":?[!#$%&'*+\-.^_`|~0-9a-z]+")
_BAD_VALUE = re.compile(rb"[\r\n\0]")


class HeaderFieldError(ValueError):
    """A header field HTTP/2 does not allow to be sent."""


def _integer(value: int, prefix_bits: int, first: int) -> bytes:
    """An HPACK integer with an N-bit prefix; `first` holds the bits above the prefix."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _string(raw: bytes) -> bytes:
    return _integer(len(raw), 7, 0) + raw  # H bit 0: not Huffman-coded


def _as_bytes(text: str | bytes) -> bytes:
    return text.encode("utf-8") if isinstance(text, str) else bytes(text)


def encode_field(name: str | bytes, value: str | bytes) -> bytes:
    """One header field's representation; raises HeaderFieldError for a field HTTP/2 forbids."""
    n = _as_bytes(name).lower()  # HTTP/2 field names are lowercase; callers may say `Forwarded`
    v = _as_bytes(value).strip(b" \t")
    if _NAME.fullmatch(n) is None:
        raise HeaderFieldError(f"invalid header name {n!r}")
    if _BAD_VALUE.search(v) is not None:
        raise HeaderFieldError(f"invalid value of header {n.decode('ascii', 'replace')}: CR, LF or NUL")
    index = _STATIC_FIELD.get((n, v))
    if index is not None:
        return _integer(index, 7, 0x80)  # indexed header field
    index = _STATIC_NAME.get(n)
    if index is not None:
        return _integer(index, 4, 0x00) + _string(v)  # literal without indexing, indexed name
    return b"\x00" + _string(n) + _string(v)  # literal without indexing, new name


# Encoded fields, shared by every connection of the process: the fields that repeat (`:method`,
# `:authority`, `baggage`, `:status`). Fields unique to a stream are not kept.
_FIELDS: dict[tuple[str | bytes, str | bytes], bytes] = {}
_UNIQUE_NAMES = frozenset({b"traceparent", b"forwarded"})  # as normalised (`Forwarded` too)


class StaticEncoder:
    """The encoder of one connection's header blocks (`encode`)."""

    def __init__(self) -> None:
        self._announce = True  # the first block announces the empty dynamic table

    def encode(self, headers: Iterable[tuple[str | bytes, str | bytes]]) -> bytes:
        """One header block; raises HeaderFieldError (before anything is sent) for a forbidden field."""
        parts = [_field(field) for field in headers]
        if self._announce:
            self._announce = False
            parts.insert(0, _TABLE_SIZE_ZERO)
        return b"".join(parts)


def _field(field: tuple[str | bytes, str | bytes]) -> bytes:
    encoded = _FIELDS.get(field)
    if encoded is None:
        name, value = field
        encoded = encode_field(name, value)
        if _as_bytes(name).lower() not in _UNIQUE_NAMES:
            if len(_FIELDS) >= _REMEMBERED:
                _FIELDS.clear()
            _FIELDS[(name, value)] = encoded
    return encoded
