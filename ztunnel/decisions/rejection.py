"""Why a connection is refused, as a kind, and the one table of what each kind is told.

Every refusal has a `RejectionKind`: admission's (inbound), the self-call guard's, and an outbound
upstream's failure. `TOLD` maps each kind to what the proxy answers with it: the HBONE CONNECT's
HTTP status (the inbound listener; `ztunnel/admin/explain.py` shows it) and the SOCKS5 reply code
(RFC 1928; the SOCKS5 listener). Read back for the client's side, `kind_of_status` is what a peer
proxy's status says: the kinds a peer tells apart (a denial, nothing to deliver to), anything else
a failure.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class RejectionKind(enum.Enum):
    MALFORMED = "malformed"  # not a CONNECT, or an authority that names no target
    MISADDRESSED = "misaddressed"  # an address neither ours nor one we are the waypoint of
    NO_LOCAL_WORKLOAD = "no local workload"  # our own workload is not known (yet)
    NO_TARGET = "no target"  # a hostname authority that no service of ours (or its port) answers
    SELF_CALL = "self call"  # one of the proxy's own ports: the connection would loop
    DENIED = "denied"  # authorization said no (ours, or the destination's proxy)
    REFUSED = "refused"  # nothing accepted it: the app, or the destination (ECONNREFUSED, a 503)
    UNREACHABLE = "unreachable"  # no route, no answer, no address
    FAILED = "failed"  # anything else


@dataclass(frozen=True, slots=True)
class Told:
    http_status: int  # the CONNECT's response
    socks5_reply: int  # the SOCKS5 reply code


_GENERAL_FAILURE, _NOT_ALLOWED, _HOST_UNREACHABLE, _CONNECTION_REFUSED = 0x01, 0x02, 0x04, 0x05

TOLD: dict[RejectionKind, Told] = {
    RejectionKind.MALFORMED: Told(400, _GENERAL_FAILURE),
    RejectionKind.MISADDRESSED: Told(400, _GENERAL_FAILURE),
    RejectionKind.NO_LOCAL_WORKLOAD: Told(503, _CONNECTION_REFUSED),
    RejectionKind.NO_TARGET: Told(503, _CONNECTION_REFUSED),
    RejectionKind.SELF_CALL: Told(503, _CONNECTION_REFUSED),
    RejectionKind.DENIED: Told(401, _NOT_ALLOWED),
    RejectionKind.REFUSED: Told(503, _CONNECTION_REFUSED),
    RejectionKind.UNREACHABLE: Told(503, _HOST_UNREACHABLE),
    RejectionKind.FAILED: Told(503, _GENERAL_FAILURE),
}

# What a peer's status tells the client side: the kinds a peer's answer tells apart.
_FROM_PEER = {TOLD[kind].http_status: kind for kind in (RejectionKind.DENIED, RejectionKind.REFUSED)}


def http_status(kind: RejectionKind) -> int:
    return TOLD[kind].http_status


def socks5_reply(kind: RejectionKind) -> int:
    return TOLD[kind].socks5_reply


def kind_of_status(status: int) -> RejectionKind:
    """The kind of a peer's non-200 answer to our CONNECT."""
    return _FROM_PEER.get(status, RejectionKind.FAILED)
