"""What the control plane serves: a snapshot of named, versioned xDS resources, and deltas between them.

A snapshot is built from a local config (the reference's YAML) by converting each workload, service
and policy to its wire message. Names are the ones the client keys its state by: a
workload's uid, a service's `namespace/hostname`, a policy's `namespace/name`. A version is a hash
of the resource's deterministic encoding, so an unchanged resource keeps its version across reloads
and across control-plane restarts, and a reconnecting client is sent only what changed.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field, replace

from google.protobuf import any_pb2
from google.protobuf.message import Message

from mesh.localconfig import LocalConfig, LocalConfigError
from mesh.model import Service, Workload
from policy.model import Authorization
from xds.convert import (
    address_resource_name,
    address_to_wire,
    authorization_to_wire,
)
from xds.gen.envoy.service.discovery.v3 import discovery_pb2
from xds.resources import ADDRESS, AUTHORIZATION, TYPE_URLS

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class VersionedResource:
    """One resource as it is sent: its `Resource` message (name, version, the packed resource),
    encoded once when the snapshot is built and kept as bytes (a mesh of 100,000 workloads is
    served from about 30 MB of them, and each response is a concatenation)."""

    name: str
    version: str
    wire: bytes  # the encoded discovery `Resource`, without aliases

    @property
    def resource(self) -> any_pb2.Any:
        return discovery_pb2.Resource.FromString(self.wire).resource

    def encoded(self, aliases: Sequence[str] = ()) -> bytes:
        """The `Resource` as bytes; `aliases` appended (a repeated field may come in parts)."""
        if not aliases:
            return self.wire
        return self.wire + discovery_pb2.Resource(aliases=list(aliases)).SerializeToString()


@dataclass(frozen=True, slots=True)
class Delta:
    """What one type's client must be told: resources to add or replace, and names to forget."""

    type_url: str
    updated: tuple[VersionedResource, ...] = ()
    removed: tuple[str, ...] = ()
    # Resource name -> the names an on-demand client asked for it by (e.g. `network/ip`).
    aliases: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # The `resources` entries encoded (`encode_response`), kept: a snapshot's whole state goes to
    # every new stream.
    body: list[bytes] = field(default_factory=list, compare=False, repr=False)

    def __bool__(self) -> bool:
        return bool(self.updated or self.removed)

    def only(self, names: Set[str]) -> Delta:
        """The part of this delta about `names` (what a client subscribed to by name holds)."""
        return Delta(
            self.type_url,
            tuple(r for r in self.updated if r.name in names),
            tuple(n for n in self.removed if n in names),
        )


@dataclass(frozen=True)
class Snapshot:
    """Resources by type URL, then by name."""

    resources: Mapping[str, Mapping[str, VersionedResource]]
    # Other names a resource is asked for on demand, by type URL: an Address's `network/ip` of a
    # workload or a service VIP, a workload's `namespace/hostname`. Name -> resource names.
    aliases: Mapping[str, Mapping[str, tuple[str, ...]]] = field(default_factory=dict)
    # The delta of each type for a client holding nothing, made once (a node's proxies all start so).
    full: dict[str, Delta] = field(default_factory=dict, compare=False, repr=False)

    def resolve(self, type_url: str, key: str) -> tuple[str, ...]:
        """The resource names an on-demand subscription to `key` is answered with."""
        if key in self.resources.get(type_url, {}):
            return (key,)
        return self.aliases.get(type_url, {}).get(key, ())

    def prepare(self) -> Snapshot:
        """This snapshot with what a new stream is sent made now (each type's whole state, encoded),
        not when the first client asks: at 100,000 workloads that is 0.3 s of its first answer."""
        for type_url in TYPE_URLS:
            _body(self.delta_since(type_url, {}))
        return self

    def versions(self, type_url: str) -> dict[str, str]:
        return {name: r.version for name, r in self.resources.get(type_url, {}).items()}

    def delta_since(self, type_url: str, known: Mapping[str, str]) -> Delta:
        """What a holder of `known` (name -> version) lacks: changed or new resources, and names gone.

        It serves both a new stream (`known` = the client's `initial_resource_versions`) and a reload
        (`known` = the previous snapshot's versions).
        """
        if not known and type_url in self.full:
            return self.full[type_url]
        current = self.resources.get(type_url, {})
        delta = Delta(
            type_url=type_url,
            updated=tuple(r for name, r in sorted(current.items()) if known.get(name) != r.version),
            removed=tuple(sorted(name for name in known if name not in current)),
        )
        if not known:
            self.full[type_url] = delta
        return delta


def snapshot_from_config(config: LocalConfig, source: str = "<inline>") -> Snapshot:
    """Convert a parsed local config; a resource the wire cannot name or carry is a `LocalConfigError`."""
    addresses: dict[str, VersionedResource] = {}
    policies: dict[str, VersionedResource] = {}
    items: list[tuple[str, Workload | Service | Authorization]] = [
        *(
            (f"workloads[{i}]", w)
            for i, w in enumerate(_with_service_endpoints(config.workloads, config.services))
        ),
        *((f"services[{i}]", s) for i, s in enumerate(config.services)),
        *((f"policies[{i}]", p) for i, p in enumerate(config.policies)),
    ]
    for path, item in items:
        if isinstance(item, Workload) and not item.uid:
            raise LocalConfigError(
                f"{source}: {path}.uid: required by the control plane (resources are named by uid)"
            )
        try:
            if isinstance(item, Authorization):
                table, name, message = policies, item.key, authorization_to_wire(item)
            else:
                table, name, message = addresses, address_resource_name(item), address_to_wire(item)
        except ValueError as e:  # protobuf's: a value the wire cannot carry
            raise LocalConfigError(f"{source}: {path}: cannot be sent over xDS: {e}") from None
        if name in table:
            raise LocalConfigError(f"{source}: {path}: duplicate resource name {name!r}")
        table[name] = _versioned(name, message)
    keys: dict[str, list[str]] = {}
    for item in config.workloads:
        for ip in item.addresses:
            keys.setdefault(f"{item.network}/{ip}", []).append(item.uid)
        if item.hostname:
            keys.setdefault(f"{item.namespace}/{item.hostname}", []).append(item.uid)
    for service in config.services:
        for vip in service.vips:
            keys.setdefault(str(vip), []).append(service.key)
    return Snapshot(
        {ADDRESS.type_url: addresses, AUTHORIZATION.type_url: policies},
        {ADDRESS.type_url: {k: tuple(v) for k, v in keys.items()}},
    )


def _versioned(name: str, message: Message) -> VersionedResource:
    # Deterministic: map fields (a workload's `services`) would otherwise encode in any order.
    data = message.SerializeToString(deterministic=True)
    packed = any_pb2.Any(type_url=f"type.googleapis.com/{message.DESCRIPTOR.full_name}", value=data)
    version = hashlib.sha256(data).hexdigest()[:16]
    wire = discovery_pb2.Resource(name=name, version=version, resource=packed).SerializeToString()
    return VersionedResource(name=name, version=version, wire=wire)


# A response's `resources` entry: field 2, length-delimited.
_RESOURCES_KEY = bytes(
    [discovery_pb2.DeltaDiscoveryResponse.DESCRIPTOR.fields_by_name["resources"].number << 3 | 2]
)


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def encode_response(delta: Delta, nonce: str) -> bytes:
    """The `DeltaDiscoveryResponse` carrying `delta`, encoded: its small fields by protobuf, then
    each resource's kept bytes as one `resources` entry (what protobuf would write for them)."""
    head = discovery_pb2.DeltaDiscoveryResponse(
        type_url=delta.type_url, nonce=nonce, removed_resources=delta.removed
    ).SerializeToString()
    return head + _body(delta)


def _body(delta: Delta) -> bytes:
    """The `resources` entries of `delta`'s response, encoded once."""
    if not delta.body:
        parts: list[bytes] = []
        for r in delta.updated:
            wire = r.encoded(delta.aliases.get(r.name, ()))
            parts += (_RESOURCES_KEY, _varint(len(wire)), wire)
        delta.body.append(b"".join(parts))
    return delta.body[0]


def _with_service_endpoints(workloads: Sequence[Workload], services: Iterable[Service]) -> list[Workload]:
    """Fold the services' `endpoints` into the workloads' `services` memberships.

    The wire Service has no endpoints: a client learns membership only from each workload's `services`
    map, so an endpoint written under a service in the file is sent as its workload's membership.
    """
    uids = {w.uid for w in workloads}
    extra: dict[str, dict[str, tuple[tuple[int, int], ...]]] = {}
    for service in services:
        for endpoint in service.endpoints:
            if endpoint.workload_uid not in uids:
                log.warning(
                    "service %s lists endpoint %r, which is no workload in the file; not sent",
                    service.key,
                    endpoint.workload_uid,
                )
                continue
            extra.setdefault(endpoint.workload_uid, {})[service.key] = endpoint.port
    folded = []
    for w in workloads:
        memberships = dict(w.services)
        added = {key: ports for key, ports in extra.get(w.uid, {}).items() if key not in memberships}
        folded.append(replace(w, services=(*w.services, *added.items())) if added else w)
    return folded
