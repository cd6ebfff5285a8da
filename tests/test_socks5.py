"""The SOCKS5 handshake codec, as transcripts: bytes in, events and bytes out; and the address a
mesh host name is connected to."""

import ipaddress

import pytest

from mesh.localconfig import parse_local_config
from mesh.model import Workload
from ztunnel.dns.resolver import ResolverSettings
from ztunnel.proxy.socks5_codec import (
    ConnectRequested,
    HandshakeFailed,
    Reply,
    Socks5Handshake,
    encode_reply,
)
from ztunnel.proxy.socks5_listener import NoAddress, mesh_address
from ztunnel.state.store import ProxyState


def test_ipv4_connect_in_one_write() -> None:
    hs = Socks5Handshake()
    events = hs.receive(bytes([5, 1, 0]) + bytes([5, 1, 0, 1, 127, 0, 0, 2, 0x1F, 0x90]))
    assert events == [ConnectRequested(ipaddress.IPv4Address("127.0.0.2"), 8080)]
    assert hs.data_to_send() == bytes([5, 0])


def test_ipv6_connect_byte_by_byte() -> None:
    hs = Socks5Handshake()
    wire = bytes([5, 2, 2, 0]) + bytes([5, 1, 0, 4]) + ipaddress.IPv6Address("::1").packed + b"\x00\x50"
    events = []
    for i in range(len(wire)):
        events += hs.receive(wire[i : i + 1])
    assert events == [ConnectRequested(ipaddress.IPv6Address("::1"), 80)]


def test_domain_connect_and_payload_after_request() -> None:
    hs = Socks5Handshake()
    name = b"echo.demo.svc.cluster.local"
    events = hs.receive(bytes([5, 1, 0, 5, 1, 0, 3, len(name)]) + name + b"\x01\xbb" + b"GET /")
    assert events == [ConnectRequested("echo.demo.svc.cluster.local", 443)]
    assert hs.leftover == b"GET /"


def test_no_acceptable_method() -> None:
    hs = Socks5Handshake()
    events = hs.receive(bytes([5, 1, 2]))
    assert isinstance(events[0], HandshakeFailed)
    assert hs.data_to_send() == bytes([5, 0xFF])


def test_wrong_version_is_refused_without_reply() -> None:
    hs = Socks5Handshake()
    (event,) = hs.receive(bytes([4, 1, 0, 80, 127, 0, 0, 1, 0]))
    assert isinstance(event, HandshakeFailed)
    assert hs.data_to_send() == b""


@pytest.mark.parametrize(
    ("cmd", "code"), [(2, Reply.COMMAND_NOT_SUPPORTED), (3, Reply.COMMAND_NOT_SUPPORTED)]
)
def test_bind_and_udp_are_not_supported(cmd: int, code: Reply) -> None:
    hs = Socks5Handshake()
    hs.receive(bytes([5, 1, 0]))
    hs.data_to_send()
    (event,) = hs.receive(bytes([5, cmd, 0, 1, 127, 0, 0, 1, 0, 80]))
    assert isinstance(event, HandshakeFailed)
    assert hs.data_to_send() == bytes([5, code, 0, 1, 0, 0, 0, 0, 0, 0])


def test_unknown_address_type() -> None:
    hs = Socks5Handshake()
    hs.receive(bytes([5, 1, 0]))
    hs.data_to_send()
    (event,) = hs.receive(bytes([5, 1, 0, 9, 0, 0]))
    assert isinstance(event, HandshakeFailed)
    assert hs.data_to_send()[1] == Reply.ADDRESS_TYPE_NOT_SUPPORTED


def test_incomplete_request_waits() -> None:
    hs = Socks5Handshake()
    assert hs.receive(bytes([5, 1, 0, 5, 1, 0, 1, 127])) == []


def test_reply_encoding() -> None:
    assert encode_reply(Reply.SUCCEEDED) == bytes([5, 0, 0, 1, 0, 0, 0, 0, 0, 0])
    assert encode_reply(Reply.CONNECTION_REFUSED, ("::1", 1080)) == (
        bytes([5, 5, 0, 4]) + ipaddress.IPv6Address("::1").packed + b"\x04\x38"
    )


# --- which address a mesh name is connected to (pure: the store and the client's family) ---------

NAMES = """
workloads:
  - {uid: c//Pod/ns1/client, name: client, namespace: ns1, serviceAccount: client,
     trustDomain: cluster.local, workloadIps: ["10.0.0.1"]}
services:
  - {name: dual, namespace: ns1, hostname: dual.ns1.svc.cluster.local, vips: ["/10.96.0.10", "/fd00::10"],
     ports: {80: 80}}
  - {name: v6, namespace: ns1, hostname: v6.ns1.svc.cluster.local, vips: ["/fd00::12"], ports: {80: 80},
     ipFamilies: IPv6}
  - {name: v4, namespace: ns1, hostname: v4.ns1.svc.cluster.local, vips: ["/10.96.0.11"], ports: {80: 80}}
  - {name: empty, namespace: ns1, hostname: empty.ns1.svc.cluster.local, vips: [], ports: {80: 80}}
"""


@pytest.mark.parametrize(
    ("name", "family", "expected"),
    [
        ("dual", 4, "10.96.0.10"),  # the client's family first
        ("dual", 6, "fd00::10"),
        ("v6", 4, "fd00::12"),  # then the other one
        ("v4.ns1.svc.cluster.local.", 6, "10.96.0.11"),
        ("example.org", 4, None),  # not a mesh name: the system resolver's
    ],
)
def test_mesh_name_tries_the_clients_family_then_the_other(
    name: str, family: int, expected: str | None
) -> None:
    state, client = _names_state()
    found = mesh_address(state, client, name, family, ResolverSettings())
    assert (str(found) if found is not None else None) == expected


def test_mesh_name_with_no_address_of_either_family() -> None:
    state, client = _names_state()
    with pytest.raises(NoAddress, match=r"empty\.ns1 is a mesh name with no IPv4 or IPv6 address"):
        mesh_address(state, client, "empty.ns1", 4, ResolverSettings())
    # Without IPv6 answers, an IPv6-only service has none either.
    with pytest.raises(NoAddress):
        mesh_address(state, client, "v6", 4, ResolverSettings(ipv6_enabled=False))


def _names_state() -> tuple[ProxyState, Workload]:
    state = ProxyState()
    state.apply_local_config(parse_local_config(NAMES))
    client = state.workload_by_uid("c//Pod/ns1/client")
    assert client is not None
    return state, client
