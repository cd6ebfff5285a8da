"""The SOCKS5 handshake codec fed random greetings and requests, whole or split at every point.

Whatever arrives, the codec returns only `ConnectRequested` or `HandshakeFailed`, stops after either,
writes only well-formed replies, and gives the same events and bytes however the input is split.
A requested domain is one name resolution can take. Then the findings of the first round: names
IDNA refuses and names with NULs get a reply (0x04) before the close, also from a real listener
(a `ztunnel proxy` process's).
"""

from __future__ import annotations

import asyncio
import ipaddress
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.harness import Fleet, proxy_env
from ztunnel.proxy.socks5_codec import ConnectRequested, HandshakeFailed, Reply, Socks5Handshake

REPLY_CODES = {int(code) for code in Reply}
DOMAINS = st.one_of(
    st.binary(max_size=255),
    st.sampled_from(
        [b".", b"a..b", b"example.com", b"example.com.", b"xn--ida.com", b"xn--zz", "\u05d0a".encode()]
    ),
    st.text(max_size=40).map(lambda t: t.encode("utf-8", "surrogatepass")),
)


@st.composite
def handshakes(draw: st.DrawFn) -> bytes:
    """A greeting and a request, mostly well-formed, every field sometimes wrong."""
    version = draw(st.sampled_from([5, 5, 5, 4, 0]))
    methods = draw(st.one_of(st.just(b"\x00"), st.binary(max_size=5)))
    greeting = bytes([version, len(methods)]) + methods
    cmd = draw(st.sampled_from([1, 1, 1, 2, 3, 0, 9]))
    atyp = draw(st.sampled_from([1, 3, 4, 3, 0, 2]))
    if atyp == 3:
        domain = draw(DOMAINS)
        address = bytes([len(domain)]) + domain
    else:
        address = draw(st.binary(min_size=4 if atyp == 1 else 16, max_size=4 if atyp == 1 else 16))
    port = draw(st.integers(0, 65535)).to_bytes(2, "big")
    request = bytes([draw(st.sampled_from([5, 5, 4])), cmd, 0, atyp]) + address + port
    data = greeting + request + draw(st.binary(max_size=8))
    if draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data)))]
    if draw(st.integers(0, 9)) == 0:
        data = draw(st.binary(max_size=64))
    return data


def _run(chunks: list[bytes]) -> tuple[list[object], bytes, bytes]:
    hs = Socks5Handshake()
    events: list[object] = []
    out = b""
    for chunk in chunks:
        events += hs.receive(chunk)
        out += hs.data_to_send()
    return events, out, hs.leftover


def _check_output(out: bytes, events: list[object]) -> None:
    """At most the method choice, then at most one reply of 10 bytes with a known code."""
    if not out:
        return
    assert out[:2] in (b"\x05\x00", b"\x05\xff")
    rest = out[2:]
    if rest:
        assert len(rest) == 10 and rest[0] == 5 and rest[1] in REPLY_CODES and rest[1] != 0
        assert events and isinstance(events[-1], HandshakeFailed)


@given(handshakes(), st.randoms(use_true_random=False))
def test_any_input_gives_typed_events_the_same_at_every_split(data: bytes, rnd: random.Random) -> None:
    whole = _run([data])
    cuts = sorted(rnd.sample(range(len(data) + 1), min(len(data) + 1, rnd.randint(0, 6))))
    pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    assert _run(pieces) == whole
    assert _run([data[i : i + 1] for i in range(len(data))]) == whole
    events, out, _ = whole
    assert len(events) <= 1 and all(isinstance(e, ConnectRequested | HandshakeFailed) for e in events)
    _check_output(out, events)
    for event in events:
        if isinstance(event, ConnectRequested):
            assert 0 <= event.port <= 65535
            if isinstance(event.host, str):
                event.host.encode("idna")  # what resolution does with it: never a UnicodeError
                assert event.host and "\x00" not in event.host


# -- findings of the first round ------------------------------------------------------------------

NUL_DOMAIN = b".".join([b"\x00" * 50] * 5)[:255]  # 255 bytes, labels short enough for IDNA


def request(domain: bytes, port: int = 80) -> bytes:
    return b"\x05\x01\x00" + b"\x05\x01\x00\x03" + bytes([len(domain)]) + domain + port.to_bytes(2, "big")


@pytest.mark.parametrize(
    "domain",
    [b".", b"a..b", "\u05d0a".encode(), NUL_DOMAIN, b"\x00" * 255, b"a\x00b", b"x" * 64, b"\xff"],
    ids=["dot", "empty-label", "bidi", "nul-255", "nul-label-too-long", "nul", "long-label", "not-utf8"],
)
def test_unresolvable_domains_get_host_unreachable_before_the_close(domain: bytes) -> None:
    events, out, _ = _run([request(domain)])
    assert len(events) == 1 and isinstance(events[0], HandshakeFailed)
    assert out == b"\x05\x00" + b"\x05\x04\x00\x01" + bytes(6)


def test_internationalized_domains_still_connect() -> None:
    for domain, host in [("ñ.example".encode(), "ñ.example"), (b"xn--ida.example", "ñ.example")]:
        events, out, _ = _run([request(domain)])
        assert events == [ConnectRequested(host, 80)] and out == b"\x05\x00"


LISTENER_CASES = [b".", "\u05d0a".encode(), NUL_DOMAIN]


async def test_the_listener_replies_before_closing(fleet: Fleet) -> None:
    net = f"127.{random.randint(16, 250)}.{random.randint(0, 250)}"
    me = f"{net}.2"
    config = f"""
workloads:
  - uid: t//v1/Pod/demo/client
    name: client
    namespace: demo
    serviceAccount: client
    workloadIps: ["{me}"]
"""
    await fleet.start(proxy_env(me, "demo/client/client", config))
    for domain in LISTENER_CASES:
        reader, writer = await asyncio.open_connection(me, 15080)
        try:
            writer.write(request(domain))
            async with asyncio.timeout(5):
                assert await reader.readexactly(2) == b"\x05\x00"
                reply = await reader.readexactly(10)
                assert reply[:2] == b"\x05\x04", (domain, reply)
                assert await reader.read() == b""  # then the close
        finally:
            writer.close()
    # The listener is still serving: a request to a closed port is answered "refused".
    reader, writer = await asyncio.open_connection(me, 15080)
    writer.write(b"\x05\x01\x00\x05\x01\x00\x01" + ipaddress.ip_address(me).packed + (1).to_bytes(2, "big"))
    async with asyncio.timeout(5):
        assert (await reader.readexactly(12))[2:4] == b"\x05\x05"
    writer.close()
