"""The mesh's workloads and services as compact, read-only images: what the workers read in place.

The parent holds the store (`store.ProxyState`); after a change it encodes the workloads and
services into a byte image (`encode_image`), which the workers map read-only and look up in place
(`StateImage`), so the mesh is held once per node however many workers there are. A base image
holds the whole store; a delta image only the keys a push touched since the base (`Touched`), each
with the whole of what the store has for it, and the set of those keys (`StateImage.touches`).

An image is a header and sections, each 8-byte aligned:

* records: every workload, service, and each service's memberships (its endpoints from the
  workloads' `services`), each a tuple of plain values (`ztunnel.state.records`) marshalled on its
  own, with an array of their offsets, so a lookup decodes only the records it finds;
* indexes: one per question the store answers (a workload by uid, by address, by hostname, by
  name, by the name its metric series carry; a service by key, by VIP, by hostname; the
  memberships by service key). An index is two arrays sorted together: `crc32(key) << 32 | order`
  and the record number. A lookup hashes its key, bisects, and checks each candidate's own fields
  (so a hash collision costs a decode, never a wrong answer); `order` keeps the store's order among
  records sharing a key, which its rules depend on (a pod wins an address, then an HBONE workload,
  then the first seen);
* a delta's touched keys, per index it overrides: their sorted hashes and the keys themselves.

Decoded records are kept in a bounded cache per image; a new image starts with an empty one.
"""

from __future__ import annotations

import marshal
import struct
import zlib
from array import array
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

from mesh.model import Endpoint, IPAddress, NamespacedHostname, NetworkAddress, Service, Workload
from ztunnel.state.records import (
    members_of,
    members_record,
    service_of,
    service_record,
    workload_of,
    workload_record,
)

MAGIC = b"ZTIMAGE3"
_HEADER = struct.Struct("<8sI")
_SECTION = struct.Struct("<QQ")

_INDEXES = ("uid", "addr", "host", "name", "pod", "series", "key", "vip", "svchost", "member")
# The indexes a delta image overrides key by key (by name, pod name and series, a delta adds to the
# base).
_OVERRIDES = ("uid", "addr", "host", "key", "vip", "svchost", "member")
# The sections, in the order the header lists them.
_SECTIONS = (
    "workloads",
    "workload_offsets",
    "services",
    "service_offsets",
    "members",
    "member_offsets",
    "cidr_services",
    *(f"{name}_{part}" for name in _INDEXES for part in ("hashes", "ids")),
    *(f"{name}_{part}" for name in _OVERRIDES for part in ("touched", "keys", "key_offsets")),
)
# Decoded records kept per kind (workloads, services, memberships): a node's connections name few,
# and a worker's memory must not grow with the mesh (about 1.5 MiB of workloads at most).
CACHE_KEPT = 1024


class ImageError(ValueError):
    """Bytes that are not an image of this version."""


def addr_key(network: str, ip: IPAddress) -> bytes:
    return network.encode() + b"/" + ip.packed


def text_key(*parts: str) -> bytes:
    return "/".join(parts).encode()


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
    """Keys to record numbers, each key's records in the order they were added."""

    def __init__(self) -> None:
        self.keys: list[bytes] = []
        self.ids: list[int] = []

    def add(self, key: bytes, record: int) -> None:
        self.keys.append(key)
        self.ids.append(record)

    def extend(self, keys: Iterable[bytes], records: Iterable[int]) -> None:
        self.keys += keys
        self.ids += records

    def extend_lists(
        self, lists: Mapping[Any, Sequence[str]], key_of: Callable[[Any], bytes], ids: Mapping[str, int]
    ) -> None:
        """Every key of `lists` (a store's index: key -> uids or service keys), each with the record
        numbers of its list in order."""
        keys, records = self.keys, self.ids
        for where, names in lists.items():
            key = key_of(where)
            for name in names:
                keys.append(key)
                records.append(ids[name])

    def sections(self) -> tuple[list[bytes], list[bytes]]:
        order = [h << 32 | i for i, h in enumerate(map(zlib.crc32, self.keys))]
        order.sort()
        ids = self.ids
        return [array("Q", order).tobytes()], [array("I", [ids[e & 0xFFFFFFFF] for e in order]).tobytes()]


class _NoKeys:
    """A base image's: it overrides nothing."""

    def add(self, key: bytes) -> None:
        pass

    def sections(self) -> tuple[list[bytes], list[bytes], list[bytes]]:
        return [], [], [array("Q", [0]).tobytes()]


class _KeySet:
    """Keys, to ask whether one is among them: sorted `crc32(key) << 32 | n`, and the keys."""

    def __init__(self) -> None:
        self.entries: list[int] = []
        self.keys: list[bytes] = []

    def add(self, key: bytes) -> None:
        self.entries.append(zlib.crc32(key) << 32 | len(self.keys))
        self.keys.append(key)

    def sections(self) -> tuple[list[bytes], list[bytes], list[bytes]]:
        offsets = array("Q", [0])
        for key in self.keys:
            offsets.append(offsets[-1] + len(key))
        return [array("Q", sorted(self.entries)).tobytes()], self.keys, [offsets.tobytes()]


@dataclass(frozen=True)
class Tables:
    """A store's tables, as `ProxyState.image()` gives them to the encoder."""

    workloads: Mapping[str, Workload]
    by_addr: Mapping[NetworkAddress, Sequence[str]]
    by_hostname: Mapping[NamespacedHostname, Sequence[str]]
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
    services: set[str] = field(default_factory=set)
    vips: set[NetworkAddress] = field(default_factory=set)
    svchosts: set[str] = field(default_factory=set)
    members: set[str] = field(default_factory=set)

    def workload(self, w: Workload) -> None:
        self.uids[w.uid] = None
        self.addrs.update(NetworkAddress(w.network, ip) for ip in w.addresses)
        if w.hostname:
            self.hosts.add(NamespacedHostname(w.namespace, w.hostname))
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

    def __init__(self, t: Tables, delta: bool) -> None:
        self.t = t
        self.delta = delta
        self.wrec, self.srec, self.mrec = _Records(), _Records(), _Records()
        self.idx = {name: _Index() for name in _INDEXES}
        self.touched = {name: _KeySet() if delta else _NoKeys() for name in _OVERRIDES}
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
        """`workloads` of a base image (every record made already by `all_records`), the same entries
        made a list at a time."""
        t, idx = self.t, self.idx
        ws = list(t.workloads.values())
        every = range(len(ws))
        idx["uid"].extend([w.uid.encode() for w in ws], every)
        idx["name"].extend([text_key(w.namespace, w.name) for w in ws], every)
        idx["pod"].extend([w.name.encode() for w in ws], every)
        idx["series"].extend([text_key(w.namespace, w.workload_name or w.name) for w in ws], every)
        idx["addr"].extend_lists(t.by_addr, lambda a: addr_key(a.network, a.address), self._wid)
        idx["host"].extend_lists(t.by_hostname, lambda h: text_key(h.namespace, h.hostname), self._wid)

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

    def workloads(
        self, uids: Iterable[str], addrs: Iterable[NetworkAddress], hosts: Iterable[NamespacedHostname]
    ) -> None:
        t, idx, touched = self.t, self.idx, self.touched
        for uid in uids:
            touched["uid"].add(key := uid.encode())
            w = t.workloads.get(uid)
            if w is not None:
                idx["uid"].add(key, n := self.wid(uid))
                idx["name"].add(text_key(w.namespace, w.name), n)
                idx["pod"].add(w.name.encode(), n)
                idx["series"].add(text_key(w.namespace, w.workload_name or w.name), n)
        for addr in addrs:
            touched["addr"].add(key := addr_key(addr.network, addr.address))
            for uid in t.by_addr.get(addr, ()):
                idx["addr"].add(key, self.wid(uid))
        for nh in hosts:
            touched["host"].add(key := text_key(nh.namespace, nh.hostname))
            for uid in t.by_hostname.get(nh, ()):
                idx["host"].add(key, self.wid(uid))

    def services(
        self,
        keys: Iterable[str],
        vips: Iterable[NetworkAddress],
        hosts: Iterable[str],
        members: Iterable[str],
    ) -> None:
        t, idx, touched = self.t, self.idx, self.touched
        for key in keys:
            touched["key"].add(raw := key.encode())
            if key in t.services:
                idx["key"].add(raw, self.sid(key))
        for vip in vips:
            touched["vip"].add(raw := addr_key(vip.network, vip.address))
            for key in t.services_by_vip.get(vip, ()):
                idx["vip"].add(raw, self.sid(key))
        for hostname in hosts:
            touched["svchost"].add(raw := hostname.encode())
            for key in t.services_by_hostname.get(hostname, ()):
                idx["svchost"].add(raw, self.sid(key))
        for key in members:
            touched["member"].add(raw := key.encode())
            endpoints = t.memberships.get(key)
            if endpoints and key in t.services:
                idx["member"].add(raw, self.mrec.add(members_record(key, endpoints.values())))

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
            body[f"{name}_hashes"], body[f"{name}_ids"] = index.sections()
        for name, keys in self.touched.items():
            body[f"{name}_touched"], body[f"{name}_keys"], body[f"{name}_key_offsets"] = keys.sections()
        return _layout(body)


def encode_image(t: Tables, touched: Touched | None = None) -> list[bytes]:
    """The image of a store's tables, as chunks to write in order: the whole store (a base image),
    or with `touched` a delta image: only those keys, each with the whole of what the store has for
    it now. Only the memberships of known services are kept (the staged ones are the parent's)."""
    enc = _Encoder(t, delta=touched is not None)
    if touched is None:
        enc.all_records()
        enc.every_workload()
        enc.services(t.services, t.services_by_vip, t.services_by_hostname, t.memberships)
    else:
        enc.workloads(touched.uids, touched.addrs, touched.hosts)
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
    head = _HEADER.pack(MAGIC, len(_SECTIONS)) + b"".join(table)
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
        view = memoryview(buffer).cast("B")
        if len(view) < _HEADER.size:
            raise ImageError("not a state image: too short")
        magic, count = _HEADER.unpack_from(view, 0)
        if magic != MAGIC or count != len(_SECTIONS):
            raise ImageError("not a state image of this version")
        parts: dict[str, memoryview] = {}
        for i, name in enumerate(_SECTIONS):
            offset, length = _SECTION.unpack_from(view, _HEADER.size + i * _SECTION.size)
            if offset + length > len(view):
                raise ImageError(f"state image truncated: section {name}")
            parts[name] = view[offset : offset + length]
        self._view = view
        self._workloads = _Table(parts["workloads"], parts["workload_offsets"].cast("Q"), workload_of)
        self._services = _Table(parts["services"], parts["service_offsets"].cast("Q"), service_of)
        self._members = _Table(parts["members"], parts["member_offsets"].cast("Q"), members_of)
        self._cidr = parts["cidr_services"].cast("I")
        self._index = {
            name: (parts[f"{name}_hashes"].cast("Q"), parts[f"{name}_ids"].cast("I")) for name in _INDEXES
        }
        self._touched = {
            name: (
                parts[f"{name}_touched"].cast("Q"),
                parts[f"{name}_keys"],
                parts[f"{name}_key_offsets"].cast("Q"),
            )
            for name in _OVERRIDES
        }

    def touches(self, index: str, key: bytes) -> bool:
        """Whether this (delta) image answers `key` of `index` in full, in place of the base."""
        hashes, keys, offsets = self._touched[index]
        if not hashes:
            return False
        low = zlib.crc32(key) << 32
        i = bisect_left(hashes, low)
        while i < len(hashes) and hashes[i] >> 32 == low >> 32:
            n = hashes[i] & 0xFFFFFFFF
            if keys[offsets[n] : offsets[n + 1]] == key:
                return True
            i += 1
        return False

    @property
    def size(self) -> int:
        return len(self._view)

    def _ids(self, index: str, key: bytes) -> Iterator[int]:
        hashes, ids = self._index[index]
        low = zlib.crc32(key) << 32
        i = bisect_left(hashes, low)
        high = low + (1 << 32)
        while i < len(hashes) and hashes[i] < high:
            yield ids[i]
            i += 1

    # --- workloads ---

    def workload_count(self) -> int:
        return len(self._workloads)

    def workloads(self) -> Iterator[Workload]:
        return (self._workloads.get(n) for n in range(len(self._workloads)))

    def workload_by_uid(self, uid: str) -> Workload | None:
        for n in self._ids("uid", uid.encode()):
            w: Workload = self._workloads.get(n)
            if w.uid == uid:
                return w
        return None

    def workloads_at(self, network: str, ip: IPAddress) -> list[Workload]:
        """The workloads holding `network/ip`, in the store's order."""
        found = (self._workloads.get(n) for n in self._ids("addr", addr_key(network, ip)))
        return [w for w in found if w.network == network and ip in w.addresses]

    def workloads_by_hostname(self, namespace: str, hostname: str) -> list[Workload]:
        found = (self._workloads.get(n) for n in self._ids("host", text_key(namespace, hostname)))
        return [w for w in found if w.namespace == namespace and w.hostname == hostname]

    def workloads_named(self, namespace: str, name: str) -> list[Workload]:
        found = (self._workloads.get(n) for n in self._ids("name", text_key(namespace, name)))
        return [w for w in found if w.namespace == namespace and w.name == name]

    def workloads_of_pod_name(self, name: str) -> list[Workload]:
        """The workloads of this name in any namespace or cluster (a headless service's pods)."""
        found = (self._workloads.get(n) for n in self._ids("pod", name.encode()))
        return [w for w in found if w.name == name]

    def series_named(self, namespace: str, name: str) -> list[Workload]:
        """The workloads whose metric series name them `namespace`, `name` (their workload name,
        else their name)."""
        found = (self._workloads.get(n) for n in self._ids("series", text_key(namespace, name)))
        return [w for w in found if w.namespace == namespace and (w.workload_name or w.name) == name]

    # --- services ---

    def service_count(self) -> int:
        return len(self._services)

    def services(self) -> Iterator[Service]:
        return (self._services.get(n) for n in range(len(self._services)))

    def service_by_key(self, key: str) -> Service | None:
        for n in self._ids("key", key.encode()):
            s: Service = self._services.get(n)
            if s.key == key:
                return s
        return None

    def services_at(self, network: str, ip: IPAddress) -> list[Service]:
        vip = NetworkAddress(network, ip)
        found = (self._services.get(n) for n in self._ids("vip", addr_key(network, ip)))
        return [s for s in found if vip in s.vips]

    def services_by_hostname(self, hostname: str) -> list[Service]:
        found = (self._services.get(n) for n in self._ids("svchost", hostname.encode()))
        return [s for s in found if s.hostname == hostname]

    def services_with_cidr_vips(self) -> Iterable[Service]:
        return [self._services.get(n) for n in self._cidr]

    def memberships(self, service_key: str) -> tuple[Endpoint, ...]:
        """The endpoints the workloads' `services` give a known service, in the store's order."""
        for n in self._ids("member", service_key.encode()):
            key, endpoints = self._members.get(n)
            if key == service_key:
                return endpoints  # type: ignore[no-any-return]
        return ()

    def cached(self) -> int:
        """Decoded records held (bounded by `CACHE_KEPT` per kind)."""
        return len(self._workloads.kept) + len(self._services.kept) + len(self._members.kept)
