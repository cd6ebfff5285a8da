"""Forged crc32 collisions: crc32 is affine, so four chosen bytes anywhere in a key reach any value
(`forge`); strings and IPv6 addresses whose image keys share the crc32 of another key."""

from __future__ import annotations

import ipaddress
import zlib
from collections.abc import Callable, Iterator

from ztunnel.state.image import addr_key


def _crc_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0xEDB88320 if c & 1 else c >> 1
        table.append(c)
    return table


TABLE = _crc_table()
BY_TOP = {entry >> 24: i for i, entry in enumerate(TABLE)}  # each table entry's top byte is its own


def forge(prefix: bytes, suffix: bytes, target: int) -> bytes:
    """The four bytes that make crc32(prefix + them + suffix) == target."""
    reg = target ^ 0xFFFFFFFF  # the register after the last byte
    for b in reversed(suffix):  # back through the known bytes: each step is undone exactly
        i = BY_TOP[reg >> 24]
        reg = ((reg ^ TABLE[i]) << 8 | (i ^ b)) & 0xFFFFFFFF
    indexes = []
    for _ in range(4):  # the four table indexes that lead to that register, whatever came before
        i = BY_TOP[reg >> 24]
        indexes.append(i)
        reg = ((reg ^ TABLE[i]) << 8) & 0xFFFFFFFF
    reg = zlib.crc32(prefix) ^ 0xFFFFFFFF
    out = bytearray()
    for i in reversed(indexes):  # forward: the byte that makes each index come
        out.append((reg ^ i) & 0xFF)
        reg = TABLE[i] ^ (reg >> 8)
    assert zlib.crc32(prefix + out + suffix) == target
    return bytes(out)


def forged_texts(stem: str, key_of: Callable[[str], bytes], target: bytes, count: int) -> Iterator[str]:
    """`count` strings `<stem><n>-<4 forged chars>` (printable ASCII) whose key, `key_of(text)`,
    has the crc32 of `target`."""
    want, n = zlib.crc32(target), 0
    while count:
        n += 1
        text = f"{stem}{n}-"
        whole = key_of(text + "\0\0\0\0")
        at = whole.index(text.encode()) + len(text)
        four = forge(whole[:at], whole[at + 4 :], want)
        if all(0x21 <= c < 0x7F for c in four) and four != whole[at : at + 4]:
            forged = text + four.decode()
            assert zlib.crc32(key_of(forged)) == want and key_of(forged) != target
            count -= 1
            yield forged


def forged_v6(network: str, target: bytes, n: int) -> ipaddress.IPv6Address:
    """An IPv6 address in `network` whose address key has the crc32 of `target`."""
    head = ipaddress.IPv6Address(f"fd00::{n:x}:0:0").packed[:12]
    whole = addr_key(network, ipaddress.IPv6Address(head + b"\0" * 4))
    four = forge(whole[:13], whole[17:], zlib.crc32(target))
    return ipaddress.IPv6Address(head + four)
