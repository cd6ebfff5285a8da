"""The mesh's workloads and services as compact, read-only images: what the workers read in place.

The parent holds the store (`store.ProxyState`); after a change it encodes the workloads and
services into a byte image (`encode_image`), which the workers map read-only and look up in place
(`StateImage`), so the mesh is held once per node however many workers there are. A base image
holds the whole store; a delta image only the keys a push touched since the base (`Touched`), each
with the whole of what the store has for it (a key it emptied with none), so a delta answers a key
it holds in place of the base (`StateImage.touches`).

An image is a header (`MAGIC`, and `LAYOUT`, which names the records' layout) and sections, each
8-byte aligned:

* records: every workload, service, and each service's memberships (its endpoints from the
  workloads' `services`), each a tuple of plain values (`ztunnel.state.records`) marshalled on its
  own, with an array of their offsets, so a lookup decodes only the records it finds;
* indexes: one per question the store answers (a workload by uid, by address, by hostname, by
  name, by pod name, by the name its metric series carry; a service by key, by VIP, by hostname;
  the memberships by service key). An index holds each key once, with its records together in the
  store's order (a pod wins an address, then an HBONE workload, then the first seen: the store's
  rules read that order): the keys, their records, and the entries `crc32(key) << 32 | key
  number`, sorted. A lookup hashes its key, bisects, and compares the key itself: entries sharing
  a hash are ordered by their keys' bytes and bisected too, so a collision (forged or not) costs a
  comparison, never a decode nor a wrong answer. Keys of several parts are spelled so that
  no two keys of different parts are the same bytes (`addr_key`, `pair_key`).

Decoded records are kept in a bounded cache per image; a new image starts with an empty one.
"""

from __future__ import annotations

import marshal
import struct
import zlib
from array import array
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, chain
from typing import Any

from mesh.model import Endpoint, IPAddress, NamespacedHostname, NetworkAddress, Service, Workload
from ztunnel.state.names import NameIndex
from ztunnel.state.records import (
    layout,
    members_of,
    members_record,
    service_of,
    service_record,
    workload_of,
    workload_record,
)

MAGIC = b"ZTIMAGE4"
_HEADER = struct.Struct("<8sII")  # MAGIC, LAYOUT, the number of sections
_SECTION = struct.Struct("<QQ")

_INDEXES = ("uid", "addr", "host", "name", "pod", "series", "key", "vip", "svchost", "member")
# The indexes a delta image overrides key by key (by name and series, a delta adds to the base).
_OVERRIDES = ("uid", "addr", "host", "pod", "key", "vip", "svchost", "member")
# An index's sections: its entries (`crc32(key) << 32 | key number`, sorted), the keys and where
# each starts, where each key's record numbers start (none when each key has one), the record numbers.
_INDEX_PARTS = ("entries", "keys", "key_offsets", "starts", "ids")
_KEY_NUMBER = 0xFFFFFFFF
# The sections, in the order the header lists them.
_SECTIONS = (
    "workloads",
    "workload_offsets",
    "services",
    "service_offsets",
    "members",
    "member_offsets",
    "cidr_services",
    *(f"{name}_{part}" for name in _INDEXES for part in _INDEX_PARTS),
)
# What an image's header names: its sections, and the records' layout (a worker of another build,
# which reads other records, refuses the image, and is refused at its start: `messages.Spawn`).
LAYOUT = zlib.crc32(repr((_SECTIONS, layout())).encode())
# Decoded records kept per kind (workloads, services, memberships): a node's connections name few,
# and a worker's memory must not grow with the mesh (about 1.5 MiB of workloads at most).
CACHE_KEPT = 1024


class ImageError(ValueError):
    """Bytes that are not an image of this version."""


_LENGTHS = {4: b"\x04", 16: b"\x10"}


def addr_key(network: str, ip: IPAddress) -> bytes:
    """An address's key: the address's length and bytes, then the network's."""
    packed = ip.packed
    return _LENGTHS[len(packed)] + packed + network.encode()


def pair_key(first: str, second: str) -> bytes:
    """The key of two strings (a namespace and a name): the first's length leads, so that no other
    pair has the same bytes, whatever either holds."""
    return f"{len(first)}/{first}/{second}".encode()


class _Records:
    """Marshalled records and their offsets, as they are added."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.offsets = array("Q", [0])

    def add(self, record: tuple[Any, ...]) -> int:
        data = marshal.dumps(record)
        self.chunks.append(data)
        self.offsets.append(self.offsets[-1] + len(data))
        return len(self.offsets) - 2

    def extend(self, records: Iterable[tuple[Any, ...]]) -> None:
        """Many at once (a base image's), the loops in C where they can be."""
        chunks = list(map(marshal.dumps, records))
        ends = accumulate(map(len, chunks), initial=self.offsets[-1])
        next(ends)  # the initial value: the last offset already there
        self.offsets.extend(ends)
        self.chunks += chunks


class _Index:
    """Keys to record numbers: each key once, with its records in the order they were added."""

    def __init__(self) -> None:
        self.keys: list[bytes] = []  # each once
        self.counts: list[int] = []  # of each key's records
        self.ids: list[int] = []  # the records, a key's together, in the order of the keys

    def put(self, key: bytes, records: Iterable[int]) -> None:
        """A key not put before, with all of its records (none: a delta's key the store emptied)."""
        before = len(self.ids)
        self.ids += records
        self.keys.append(key)
        self.counts.append(len(self.ids) - before)

    def put_lists(
        self,
        wheres: Iterable[Any],
        lists: Iterable[Sequence[str]],
        key_of: Callable[[Any], bytes],
        ids: Mapping[str, int],
    ) -> None:
        """Every key of a store's index (`wheres`, each with its list of uids or service keys in
        `lists`: one loop in C each), with the record numbers of its list in order."""
        lists = list(lists)
        self.keys += map(key_of, wheres)
        self.counts += map(len, lists)
        self.ids += map(ids.__getitem__, chain.from_iterable(lists))

    def group(self, keys: list[bytes], records: Sequence[int]) -> None:
        """Entries whose keys may repeat (a key not put before): each key's records together, in
        the order they come."""
        if len(set(keys)) == len(keys):  # mostly: one record per key
            self.keys += keys
            self.counts += [1] * len(keys)
            self.ids += records
            return
        groups: dict[bytes, list[int]] = {}
        for key, n in zip(keys, records, strict=True):
            groups.setdefault(key, []).append(n)
        self.keys += groups
        self.counts += map(len, groups.values())
        for found in groups.values():
            self.ids += found

    def sections(self) -> list[list[bytes]]:
        """The index's sections (`_INDEX_PARTS`): the keys and their records as they were added,
        and the entries `crc32(key) << 32 | key number`, sorted (those sharing a hash by the keys'
        bytes)."""
        keys, counts = self.keys, self.counts
        hashes = list(map(zlib.crc32, keys))
        entries = [h << 32 | i for i, h in enumerate(hashes)]
        entries.sort()
        if len(set(hashes)) < len(hashes):
            _order_runs(entries, hashes, keys)
        one_each = counts.count(1) == len(counts)  # then no starts: key k's record is ids[k]
        return [
            [array("Q", entries).tobytes()],
            [b"".join(keys)],
            [array("I", accumulate(map(len, keys), initial=0)).tobytes()],
            [b"" if one_each else array("I", accumulate(counts, initial=0)).tobytes()],
            [array("I", self.ids).tobytes()],
        ]


def _order_runs(entries: list[int], hashes: list[int], keys: list[bytes]) -> None:
    """Order each run of `entries` sharing a hash by the keys' bytes (a lookup bisects them). Natural
    collisions are few (about one pair in 100,000 keys); forged ones cost a sort."""
    for h in {h for h, seen in Counter(hashes).items() if seen > 1}:
        start = bisect_left(entries, h << 32)
        end = bisect_left(entries, (h + 1) << 32, start)
        entries[start:end] = sorted(entries[start:end], key=lambda e: keys[e & _KEY_NUMBER])


@dataclass(frozen=True)
class Tables:
    """A store's tables, as `ProxyState.image()` gives them to the encoder."""

    workloads: Mapping[str, Workload]
    by_addr: Mapping[NetworkAddress, Sequence[str]]
    by_hostname: Mapping[NamespacedHostname, Sequence[str]]
    by_name: NameIndex
    services: Mapping[str, Service]
    services_by_vip: Mapping[NetworkAddress, Sequence[str]]
    services_by_hostname: Mapping[str, Sequence[str]]
    cidr_services: Mapping[str, Service]
    memberships: Mapping[str, Mapping[str, Endpoint]]


@dataclass
class Touched:
    """What changed since the base image, as the keys of each index: a delta image answers these
    keys in full (their whole lists, as the store has them now), the base image every other."""

    uids: dict[str, None] = field(default_factory=dict)  # workloads changed, in the order of change
    addrs: set[NetworkAddress] = field(default_factory=set)
    hosts: set[NamespacedHostname] = field(default_factory=set)
    names: set[str] = field(default_factory=set)  # pod names
    services: set[str] = field(default_factory=set)
    vips: set[NetworkAddress] = field(default_factory=set)
    svchosts: set[str] = field(default_factory=set)
    members: set[str] = field(default_factory=set)

    def workload(self, w: Workload) -> None:
        self.uids[w.uid] = None
        self.addrs.update(NetworkAddress(w.network, ip) for ip in w.addresses)
        if w.hostname:
            self.hosts.add(NamespacedHostname(w.namespace, w.hostname))
        if w.name:
            self.names.add(w.name)
        self.members.update(key for key, _ in w.services)

    def service(self, s: Service) -> None:
        self.services.add(s.key)
        self.vips.update(s.vips)
        self.svchosts.add(s.hostname)
        self.members.add(s.key)

    def __len__(self) -> int:
        return len(self.uids) + len(self.services)


class _Encoder:
    """Records added as the indexes name them; each workload or service encoded once."""

    def __init__(self, t: Tables) -> None:
        self.t = t
        self.wrec, self.srec, self.mrec = _Records(), _Records(), _Records()
        self.idx = {name: _Index() for name in _INDEXES}
        self._wid: dict[str, int] = {}
        self._sid: dict[str, int] = {}

    def all_records(self) -> None:
        """Every workload and service, in the store's order (`workloads()` lists them so)."""
        t = self.t
        self.wrec.extend(map(workload_record, t.workloads.values()))
        self._wid = {uid: n for n, uid in enumerate(t.workloads)}
        self.srec.extend(map(service_record, t.services.values()))
        self._sid = {key: n for n, key in enumerate(t.services)}

    def every_workload(self) -> None:
        """The workloads' indexes of a base image (every record made already by `all_records`),
        a list at a time."""
        t, idx = self.t, self.idx
        ws = list(t.workloads.values())
        every = range(len(ws))
        idx["uid"].group([w.uid.encode() for w in ws], every)
        idx["name"].group([pair_key(w.namespace, w.name) for w in ws], every)
        idx["series"].group([pair_key(w.namespace, w.workload_name or w.name) for w in ws], every)
        addrs, hosts = t.by_addr, t.by_hostname
        idx["addr"].put_lists(addrs, addrs.values(), lambda a: addr_key(a.network, a.address), self._wid)
        idx["host"].put_lists(hosts, hosts.values(), lambda h: pair_key(h.namespace, h.hostname), self._wid)
        idx["pod"].put_lists(t.by_name.names(), t.by_name.uid_lists(), str.encode, self._wid)

    def wid(self, uid: str) -> int:
        n = self._wid.get(uid)
        if n is None:
            self._wid[uid] = n = self.wrec.add(workload_record(self.t.workloads[uid]))
        return n

    def sid(self, key: str) -> int:
        n = self._sid.get(key)
        if n is None:
            self._sid[key] = n = self.srec.add(service_record(self.t.services[key]))
        return n

    def workloads(self, touched: Touched) -> None:
        """The workloads' indexes of a delta image: the keys `touched` names, each with all the
        store has for it now; by name and series, the workloads changed."""
        t, idx, wid = self.t, self.idx, self.wid
        changed = [w for w in map(t.workloads.get, touched.uids) if w is not None]
        records = [wid(w.uid) for w in changed]
        for uid in touched.uids:
            idx["uid"].put(uid.encode(), [wid(uid)] if uid in t.workloads else [])
        idx["name"].group([pair_key(w.namespace, w.name) for w in changed], records)
        idx["series"].group([pair_key(w.namespace, w.workload_name or w.name) for w in changed], records)
        for addr in touched.addrs:
            idx["addr"].put(addr_key(addr.network, addr.address), map(wid, t.by_addr.get(addr, ())))
        for nh in touched.hosts:
            idx["host"].put(pair_key(nh.namespace, nh.hostname), map(wid, t.by_hostname.get(nh, ())))
        for name in touched.names:
            idx["pod"].put(name.encode(), map(wid, t.by_name.uids(name)))

    def services(
        self,
        keys: Iterable[str],
        vips: Iterable[NetworkAddress],
        hosts: Iterable[str],
        members: Iterable[str],
    ) -> None:
        """The services' indexes: these keys, each with all the store has for it now."""
        t, idx, sid = self.t, self.idx, self.sid
        for key in keys:
            idx["key"].put(key.encode(), [sid(key)] if key in t.services else [])
        for vip in vips:
            idx["vip"].put(addr_key(vip.network, vip.address), map(sid, t.services_by_vip.get(vip, ())))
        for hostname in hosts:
            idx["svchost"].put(hostname.encode(), map(sid, t.services_by_hostname.get(hostname, ())))
        for key in members:
            endpoints = t.memberships.get(key) if key in t.services else None
            found = [self.mrec.add(members_record(key, endpoints.values()))] if endpoints else []
            idx["member"].put(key.encode(), found)

    def chunks(self) -> list[bytes]:
        cidr = array("I", [self.sid(key) for key in self.t.cidr_services])
        body: dict[str, list[bytes]] = {
            "workloads": self.wrec.chunks,
            "workload_offsets": [self.wrec.offsets.tobytes()],
            "services": self.srec.chunks,
            "service_offsets": [self.srec.offsets.tobytes()],
            "members": self.mrec.chunks,
            "member_offsets": [self.mrec.offsets.tobytes()],
            "cidr_services": [cidr.tobytes()],
        }
        for name, index in self.idx.items():
            for part, chunks in zip(_INDEX_PARTS, index.sections(), strict=True):
                body[f"{name}_{part}"] = chunks
        return _layout(body)


def encode_image(t: Tables, touched: Touched | None = None) -> list[bytes]:
    """The image of a store's tables, as chunks to write in order: the whole store (a base image),
    or with `touched` a delta image: only those keys, each with the whole of what the store has for
    it now. Only the memberships of known services are kept (the staged ones are the parent's)."""
    enc = _Encoder(t)
    if touched is None:
        enc.all_records()
        enc.every_workload()
        enc.services(t.services, t.services_by_vip, t.services_by_hostname, t.memberships)
    else:
        enc.workloads(touched)
        enc.services(sorted(touched.services), touched.vips, touched.svchosts, touched.members)
    return enc.chunks()


def _layout(body: dict[str, list[bytes]]) -> list[bytes]:
    """The header, then each section padded to 8 bytes."""
    header_size = _HEADER.size + _SECTION.size * len(_SECTIONS)
    offset = header_size + (-header_size % 8)
    table, out = [], []
    for name in _SECTIONS:
        length = sum(len(c) for c in body[name])
        table.append(_SECTION.pack(offset, length))
        out += body[name]
        pad = -length % 8
        if pad:
            out.append(b"\0" * pad)
        offset += length + pad
    head = _HEADER.pack(MAGIC, LAYOUT, len(_SECTIONS)) + b"".join(table)
    return [head + b"\0" * (-len(head) % 8), *out]


class _Table:
    """One kind of record of an image: decoded on demand, a bounded number kept."""

    def __init__(self, data: memoryview, offsets: memoryview, decode: Callable[[Any], Any]) -> None:
        self.data = data
        self.decode = decode
        self.offsets = offsets
        self.kept: dict[int, Any] = {}

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def get(self, n: int) -> Any:
        try:
            return self.kept[n]
        except KeyError:
            pass
        record = self.decode(marshal.loads(self.data[self.offsets[n] : self.offsets[n + 1]]))
        if len(self.kept) >= CACHE_KEPT:
            self.kept.clear()
        self.kept[n] = record
        return record


class StateImage:
    """Lookups over an image (bytes, or a read-only mapping of one), answering as the store does."""

    def __init__(self, buffer: Any) -> None:
        """Map the sections of `buffer`; bytes that are not a whole image of this build's layout
        raise `ImageError`, saying what is wrong."""
        view = memoryview(buffer).cast("B")
        if len(view) < _HEADER.size:
            raise ImageError("not a state image: too short")
        magic, layout_, count = _HEADER.unpack_from(view, 0)
        if magic != MAGIC or count != len(_SECTIONS):
            raise ImageError("not a state image of this version")
        if layout_ != LAYOUT:
            raise ImageError(f"a state image of record layout {layout_:08x}, this build's is {LAYOUT:08x}")
        if len(view) < _HEADER.size + count * _SECTION.size:
            raise ImageError("state image truncated: its section table")
        parts: dict[str, memoryview] = {}
        for i, name in enumerate(_SECTIONS):
            offset, length = _SECTION.unpack_from(view, _HEADER.size + i * _SECTION.size)
            if offset + length > len(view):
                raise ImageError(f"state image truncated: section {name}")
            if offset % 8:
                raise ImageError(f"state image misaligned: section {name} at {offset}")
            parts[name] = view[offset : offset + length]
        try:
            self._map(parts)
        except (TypeError, IndexError, ValueError) as e:  # a section of the wrong size, offsets past it
            raise ImageError(f"not a state image: {e}") from None
        self._view = view

    def _map(self, parts: dict[str, memoryview]) -> None:
        self._workloads = _Table(parts["workloads"], parts["workload_offsets"].cast("Q"), workload_of)
        self._services = _Table(parts["services"], parts["service_offsets"].cast("Q"), service_of)
        self._members = _Table(parts["members"], parts["member_offsets"].cast("Q"), members_of)
        self._cidr = parts["cidr_services"].cast("I")
        self._index = {
            name: (
                parts[f"{name}_entries"].cast("Q"),
                parts[f"{name}_keys"],
                parts[f"{name}_key_offsets"].cast("I"),
                parts[f"{name}_starts"].cast("I"),
                parts[f"{name}_ids"].cast("I"),
            )
            for name in _INDEXES
        }
        for table in (self._workloads, self._services, self._members):
            if len(table.offsets) == 0 or table.offsets[-1] > len(table.data):
                raise ValueError("record offsets past their section")
        for entries, keys, offsets, starts, ids in self._index.values():
            if len(offsets) != len(entries) + 1 or offsets[-1] > len(keys):
                raise ValueError("index keys past their section")
            if len(starts) not in (0, len(offsets)) or (starts and starts[-1] > len(ids)):
                raise ValueError("index records past their section")

    def _find(self, index: str, key: bytes) -> memoryview | None:
        """The record numbers of `key` in `index` (empty: a delta's key the store emptied), None
        when the index does not hold it. The key itself is compared: among keys sharing its hash
        (ordered by their bytes), one comparison each halving."""
        entries, keys, offsets, starts, ids = self._index[index]
        h = zlib.crc32(key)
        i = bisect_left(entries, h << 32)
        n = len(entries)
        if i == n or entries[i] >> 32 != h:
            return None
        if i + 1 < n and entries[i + 1] >> 32 == h:  # a run of keys with this hash
            end = hi = bisect_left(entries, (h + 1) << 32, i)
            while i < hi:
                mid = (i + hi) // 2
                k = entries[mid] & _KEY_NUMBER
                if bytes(keys[offsets[k] : offsets[k + 1]]) < key:
                    i = mid + 1
                else:
                    hi = mid
            if i == end:
                return None
        k = entries[i] & _KEY_NUMBER
        if keys[offsets[k] : offsets[k + 1]] != key:
            return None
        return ids[starts[k] : starts[k + 1]] if starts else ids[k : k + 1]

    def touches(self, index: str, key: bytes) -> bool:
        """Whether this (delta) image answers `key` of `index` in full, in place of the base."""
        return self._find(index, key) is not None

    @property
    def size(self) -> int:
        return len(self._view)

    def _ids(self, index: str, key: bytes) -> memoryview | tuple[()]:
        found = self._find(index, key)
        return () if found is None else found

    # --- workloads ---

    def workload_count(self) -> int:
        return len(self._workloads)

    def workloads(self) -> Iterator[Workload]:
        return (self._workloads.get(n) for n in range(len(self._workloads)))

    def workload_by_uid(self, uid: str) -> Workload | None:
        for n in self._ids("uid", uid.encode()):
            return self._workloads.get(n)  # type: ignore[no-any-return]
        return None

    def workloads_at(self, network: str, ip: IPAddress) -> list[Workload]:
        """The workloads holding `network/ip`, in the store's order."""
        return [self._workloads.get(n) for n in self._ids("addr", addr_key(network, ip))]

    def workloads_by_hostname(self, namespace: str, hostname: str) -> list[Workload]:
        return [self._workloads.get(n) for n in self._ids("host", pair_key(namespace, hostname))]

    def workloads_named(self, namespace: str, name: str) -> list[Workload]:
        return [self._workloads.get(n) for n in self._ids("name", pair_key(namespace, name))]

    def workloads_of_pod_name(self, name: str) -> list[Workload]:
        """The workloads of this pod name in any namespace or cluster (a headless service's pods),
        in the store's order."""
        return [self._workloads.get(n) for n in self._ids("pod", name.encode())]

    def series_named(self, namespace: str, name: str) -> list[Workload]:
        """The workloads whose metric series name them `namespace`, `name` (their workload name,
        else their name)."""
        return [self._workloads.get(n) for n in self._ids("series", pair_key(namespace, name))]

    # --- services ---

    def service_count(self) -> int:
        return len(self._services)

    def services(self) -> Iterator[Service]:
        return (self._services.get(n) for n in range(len(self._services)))

    def service_by_key(self, key: str) -> Service | None:
        for n in self._ids("key", key.encode()):
            return self._services.get(n)  # type: ignore[no-any-return]
        return None

    def services_at(self, network: str, ip: IPAddress) -> list[Service]:
        return [self._services.get(n) for n in self._ids("vip", addr_key(network, ip))]

    def services_by_hostname(self, hostname: str) -> list[Service]:
        return [self._services.get(n) for n in self._ids("svchost", hostname.encode())]

    def services_with_cidr_vips(self) -> Iterable[Service]:
        return [self._services.get(n) for n in self._cidr]

    def memberships(self, service_key: str) -> tuple[Endpoint, ...]:
        """The endpoints the workloads' `services` give a known service, in the store's order."""
        for n in self._ids("member", service_key.encode()):
            return self._members.get(n)[1]  # type: ignore[no-any-return]
        return ()

    def cached(self) -> int:
        """Decoded records held (bounded by `CACHE_KEPT` per kind)."""
        return len(self._workloads.kept) + len(self._services.kept) + len(self._members.kept)
