"""What a new xDS stream lists of the resources the proxy holds, within the control plane's limit.

A reconnecting client lists every resource it holds with its version (`initial_resource_versions`),
so that the server sends only what changed. At cluster scale that list outgrows a gRPC message:
istiod receives at most 4 MiB by default (`ISTIO_GPRC_MAXRECVMSGSIZE`; some 40,000 workloads of
its names, 84,000 of the scale bench's) and refuses a larger request, so the stream never starts.
So the request lists only what fits under `MAX_REQUEST_BYTES`, in the order the resources arrived,
and the rest is taken as a fresh push:

* a held resource that is not listed is, for the server, one the client lacks: a wildcard
  subscription gets it again in the answer to the initial request, as an ordinary add;
* a listed resource that is gone is named in that answer's `removed_resources`, as before;
* an unlisted resource that is gone is named nowhere, as the server never heard of it. The answer
  to the initial request of a wildcard subscription is the type's whole state less what the client
  listed (istiod's and the development control plane's alike), so what the client did not list and
  that answer did not carry is gone: `stale` names it, and the client removes it when it applies
  that answer, in the same batch.

A subscription by name (on-demand Address) has no such answer: a name left out of the request is no
longer subscribed, so the client forgets it at once (asked for again on its next miss).

A control plane that takes less refuses the request with RESOURCE_EXHAUSTED and says its limit
(gRPC's "received message larger than max (N vs. LIMIT)"): `refused_limit` reads it, so that the
next attempt stays within it.

Pure: the versions in, the request and what it left out out.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from xds.gen.envoy.config.core.v3 import base_pb2
from xds.gen.envoy.service.discovery.v3 import discovery_pb2
from xds.grpc.wire import StatusCode

# istiod's default receive limit: a request this size or smaller is never refused by it.
MAX_REQUEST_BYTES = 4 * 1024 * 1024
# How gRPC (grpc-go, as istiod, and gRPC core alike) words a message over the receive limit.
_OVER_LIMIT = re.compile(r"larger than max \((\d+) vs\. (\d+)\)", re.IGNORECASE)


def _varint_bytes(n: int) -> int:
    size = 1
    while n >= 0x80:
        n >>= 7
        size += 1
    return size


def _field_bytes(n: int) -> int:
    """A length-delimited field of `n` bytes with a one-byte tag."""
    return 1 + _varint_bytes(n) + n


def version_entry_bytes(name: str, version: str) -> int:
    """What one `initial_resource_versions` entry adds to the encoded request: a map entry is a
    message of its key (1) and value (2), both written even when empty."""
    return _field_bytes(_field_bytes(len(name.encode())) + _field_bytes(len(version.encode())))


@dataclass(frozen=True)
class InitialRequest:
    """A new stream's request for one type, and the held resources it does not list."""

    request: discovery_pb2.DeltaDiscoveryRequest
    held: int
    unlisted: frozenset[str]

    @property
    def cut(self) -> bool:
        return bool(self.unlisted)


def initial_request(
    node: base_pb2.Node,
    type_url: str,
    versions: Mapping[str, str],
    *,
    on_demand: bool = False,
    limit: int = MAX_REQUEST_BYTES,
) -> InitialRequest:
    """The request that opens `type_url` on a new stream: `versions` (name -> version, in the order
    they arrived) as far as the encoded request stays within `limit` bytes."""
    request = discovery_pb2.DeltaDiscoveryRequest(node=node, type_url=type_url)
    if on_demand:
        # Subscribe to nothing: names are asked for as they are missed, and the held ones listed.
        request.resource_names_subscribe.append("*")
        request.resource_names_unsubscribe.append("*")
    room = limit - request.ByteSize()
    listed: dict[str, str] = {}
    unlisted: list[str] = []
    for name, version in versions.items():
        if unlisted:
            unlisted.append(name)
            continue
        room -= version_entry_bytes(name, version)
        if room < 0:
            unlisted.append(name)
        else:
            listed[name] = version
    if listed:
        request.initial_resource_versions.update(listed)
    return InitialRequest(request, len(versions), frozenset(unlisted))


def stale(unlisted: Iterable[str], response: discovery_pb2.DeltaDiscoveryResponse) -> list[str]:
    """The unlisted resources that the answer to the initial request of a wildcard subscription
    neither carried nor removed: gone from the server while the client was away."""
    sent = {r.name for r in response.resources}
    sent.update(response.removed_resources)
    return [name for name in unlisted if name not in sent]


def refused_limit(code: StatusCode, details: str) -> int | None:
    """The receive limit a control plane named when it refused a message as too large, else None."""
    if code is not StatusCode.RESOURCE_EXHAUSTED:
        return None
    found = _OVER_LIMIT.search(details)
    return int(found.group(2)) if found else None
