"""The one table of rejection kinds: what the inbound side answers for each kind, read back by the
client side, tells a SOCKS5 client what the destination's proxy decided."""

from __future__ import annotations

import pytest

from ztunnel.decisions.rejection import TOLD, RejectionKind, http_status, kind_of_status, socks5_reply
from ztunnel.proxy.socks5_codec import Reply

# The kinds an inbound proxy answers a CONNECT with (admission's, and the app refusing).
INBOUND = (
    RejectionKind.MALFORMED,
    RejectionKind.MISADDRESSED,
    RejectionKind.NO_LOCAL_WORKLOAD,
    RejectionKind.NO_TARGET,
    RejectionKind.SELF_CALL,
    RejectionKind.DENIED,
    RejectionKind.REFUSED,
)


def test_every_kind_is_in_the_table_with_a_socks5_reply() -> None:
    assert set(TOLD) == set(RejectionKind)
    for kind in RejectionKind:
        Reply(socks5_reply(kind))  # a reply code of the protocol
        assert http_status(kind) in (400, 401, 503)


@pytest.mark.parametrize("kind", INBOUND, ids=lambda k: k.value)
def test_the_peers_status_reads_back_as_what_a_socks5_client_is_told(kind: RejectionKind) -> None:
    seen = kind_of_status(http_status(kind))
    assert socks5_reply(seen) == socks5_reply(kind)


def test_statuses_read_back() -> None:
    assert kind_of_status(401) is RejectionKind.DENIED
    assert kind_of_status(503) is RejectionKind.REFUSED
    assert kind_of_status(400) is RejectionKind.FAILED
    assert kind_of_status(502) is RejectionKind.FAILED
