"""The xDS resource types the proxy subscribes to: one registration each, and nothing else in the
client, the store or the control plane says which types there are.

A `ResourceType` is what the Delta ADS client needs of a type: its URL, how one resource's payload
becomes a model value (or the reason the NACK names when it does not), how a value is applied to the
store and how a name is removed from it, and whether on-demand mode subscribes to it by name.
`TYPES` lists them in the order a new stream subscribes and a control plane sends them (addresses
before the policies that name them).

Adding a type: its proto (`proto/`, then `python -m xds.generate`), its model value and conversion
(`mesh.model`, `xds.convert`), its upsert and remove in the store (and in `XdsStore` below), and one
registration here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from google.protobuf.message import DecodeError

from mesh.model import ConversionError, Service, Workload
from policy.model import Authorization
from xds.convert import ADDRESS_TYPE_URL, AUTHORIZATION_TYPE_URL, address_from_wire, authorization_from_wire
from xds.gen.istio.security import authorization_pb2
from xds.gen.istio.workload import workload_pb2

T = TypeVar("T")


class XdsStore(Protocol):
    """The store the client applies responses to (`ztunnel.state.store.ProxyState`)."""

    def batch(self) -> contextlib.AbstractContextManager[None]: ...
    def upsert_workload(self, w: Workload) -> None: ...
    def upsert_service(self, s: Service) -> None: ...
    def remove(self, name: str) -> bool: ...
    def upsert_policy(self, p: Authorization) -> None: ...
    def remove_policy(self, key: str) -> bool: ...


@dataclass(frozen=True)
class Rejection:
    """A resource left out of a response, and why: its part of the NACK."""

    name: str
    reason: str

    def __str__(self) -> str:
        return f"{self.name}: {self.reason}"


@dataclass(frozen=True)
class ResourceType(Generic[T]):
    type_url: str
    # The payload of one resource (its `Any`'s value) -> the model value; raises DecodeError or
    # ConversionError.
    decode: Callable[[bytes], T]
    upsert: Callable[[XdsStore, T], None]
    remove: Callable[[XdsStore, str], bool]
    # With XDS_ON_DEMAND, subscribed by name (what a connection misses) rather than wildcard.
    on_demand: bool = False

    def convert(self, name: str, payload: bytes | None) -> T | Rejection:
        """One resource as the model value, or the reason it is refused (None: no payload at all)."""
        if payload is None:
            return Rejection(name, "XDS payload without resource")
        try:
            return self.decode(payload)
        except DecodeError as e:
            return Rejection(name, f"decode: {e}")
        except ConversionError as e:
            return Rejection(name, str(e))


# --- the registrations ------------------------------------------------------------------------------


def _upsert_address(store: XdsStore, item: Workload | Service) -> None:
    if isinstance(item, Workload):
        store.upsert_workload(item)
    else:
        store.upsert_service(item)


ADDRESS: ResourceType[Workload | Service] = ResourceType(
    ADDRESS_TYPE_URL,
    decode=lambda payload: address_from_wire(workload_pb2.Address.FromString(payload)),
    upsert=_upsert_address,
    remove=lambda store, name: store.remove(name),  # a workload uid or a `namespace/hostname`
    on_demand=True,
)

AUTHORIZATION: ResourceType[Authorization] = ResourceType(
    AUTHORIZATION_TYPE_URL,
    decode=lambda payload: authorization_from_wire(authorization_pb2.Authorization.FromString(payload)),
    upsert=lambda store, policy: store.upsert_policy(policy),
    remove=lambda store, key: store.remove_policy(key),
)

TYPES: tuple[ResourceType[Any], ...] = (ADDRESS, AUTHORIZATION)
BY_URL: dict[str, ResourceType[Any]] = {t.type_url: t for t in TYPES}
TYPE_URLS: tuple[str, ...] = tuple(t.type_url for t in TYPES)
