"""Precompiled forms of a policy's value lists, built once when the policy is made (`policy.model`).

A policy from a control plane may list a hundred thousand CIDRs, ports or names in one field, and
every inbound connection is checked against it. Walking such a list costs milliseconds on the shared
event loop; these forms answer in a few set lookups, whatever the list's length:

* `NetworkSet`: networks as one set of network numbers per (family, prefix length), so containment
  is one shift and one set lookup per distinct prefix length (at most 33 for IPv4, 129 for IPv6).
* `StringSet`: exact values as a set, prefixes and suffixes as one set per length (a value is
  sliced once per distinct length), presence as a flag.

They take plain values (no model types), so `policy.model` can build them without a cycle.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# Per family: (shift, network numbers) for each prefix length present; an address `a` is inside one of
# them when `int(a) >> shift` is in the set (shift = address bits - prefix length).
_Table = tuple[tuple[int, frozenset[int]], ...]


def _table(by_length: dict[int, set[int]], bits: int) -> _Table:
    return tuple((bits - length, frozenset(numbers)) for length, numbers in sorted(by_length.items()))


class NetworkSet:
    """Containment of an address in any of the networks, as `ipaddress` decides it: an address of
    the other family (an IPv4-mapped IPv6 address included) is in none of them."""

    __slots__ = ("_v4", "_v6")

    def __init__(self, networks: Iterable[IPNetwork]) -> None:
        v4: dict[int, set[int]] = {}
        v6: dict[int, set[int]] = {}
        for net in networks:
            length = net.prefixlen
            table = v4 if net.version == 4 else v6
            numbers = table.get(length)
            if numbers is None:
                numbers = table[length] = set()
            numbers.add(int(net.network_address) >> (net.max_prefixlen - length))
        self._v4 = _table(v4, 32)
        self._v6 = _table(v6, 128)

    def __contains__(self, ip: IPAddress) -> bool:
        table = self._v4 if ip.version == 4 else self._v6
        if not table:
            return False
        number = int(ip)
        return any((number >> shift) in numbers for shift, numbers in table)


def _by_length(values: Iterable[str]) -> tuple[tuple[int, frozenset[str]], ...]:
    lengths: dict[int, set[str]] = {}
    for value in values:
        lengths.setdefault(len(value), set()).add(value)
    return tuple((n, frozenset(group)) for n, group in sorted(lengths.items()))


class StringSet:
    """Whether a string passes any of a list of string matches (case-sensitive; presence means
    non-empty; the empty prefix or suffix passes everything)."""

    __slots__ = ("_exact", "_prefixes", "_presence", "_suffixes")

    def __init__(
        self, exact: Iterable[str], prefixes: Iterable[str], suffixes: Iterable[str], presence: bool
    ) -> None:
        self._exact = frozenset(exact)
        self._prefixes = _by_length(prefixes)
        self._suffixes = _by_length(suffixes)
        self._presence = presence

    def __contains__(self, value: str) -> bool:
        if value in self._exact or (self._presence and value != ""):
            return True
        size = len(value)
        for n, group in self._prefixes:
            if n > size:
                break
            if value[:n] in group:
                return True
        for n, group in self._suffixes:
            if n > size:
                break
            if (value[size - n :] if n else "") in group:
                return True
        return False
