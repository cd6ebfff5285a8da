"""Our gRPC client (`xds.grpc`) against grpcio servers and an HTTP/2 server that misbehaves, and beside
grpcio's own client: the same exchanges must end the same way (as h2 is the oracle of the HTTP/2
core, grpcio is the oracle here)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import grpc
import grpc.aio
import pytest

from hbone.settings import H2Settings
from tests.certs import issue, make_ca
from tests.grpc_peers import GrpcioPeer, RawPeer, method, start_grpcio_peer, start_raw_peer
from xds.channel import CHANNEL_SETTINGS, ControlPlaneAddress, ControlPlaneError, open_channel, tls_context
from xds.grpc.connection import GrpcConnection, connect
from xds.grpc.wire import RpcError, StatusCode

LIMIT = 1024 * 1024  # the receive limit of both clients here
# What a call came to: its messages, then the status code's name and details.
Outcome = tuple[list[bytes], str, str]


@pytest.fixture(name="peer")
async def peer_fixture() -> AsyncIterator[GrpcioPeer]:
    peer = await start_grpcio_peer()
    try:
        yield peer
    finally:
        await peer.server.stop(None)


@pytest.fixture(name="raw")
async def raw_fixture() -> AsyncIterator[RawPeer]:
    peer = await start_raw_peer()
    try:
        yield peer
    finally:
        await peer.close()


# --- the two clients, run the same way ------------------------------------------------------------


async def plain_connection(
    address: str, settings: H2Settings = CHANNEL_SETTINGS, max_message: int = LIMIT
) -> GrpcConnection:
    """Our client's connection to `address`, without TLS."""
    target = ControlPlaneAddress.parse(address)
    return await connect(
        target.host,
        target.port,
        authority=target.target,
        ssl_context=None,
        server_hostname=None,
        settings=settings,
        max_message=max_message,
        timeout=5.0,
    )


async def ours(address: str, path: str, requests: list[bytes], timeout: float | None = None) -> Outcome:
    """A call with our client: the requests written, then every response read to the status."""
    connection = await plain_connection(address)
    received: list[bytes] = []
    try:
        call = connection.call(path, [], timeout)
        for request in requests:
            await call.write(request)
        call.done_writing()
        while (message := await call.read()) is not None:
            received.append(message)
        return received, "OK", ""
    except RpcError as e:
        return received, e.code.name, e.details
    finally:
        connection.close()


async def theirs(address: str, path: str, requests: list[bytes], timeout: float | None = None) -> Outcome:
    """The same call with grpcio's client."""
    received: list[bytes] = []
    async with grpc.aio.insecure_channel(
        address.removeprefix("http://"), options=[("grpc.max_receive_message_length", LIMIT)]
    ) as channel:
        call = channel.stream_stream(path)(timeout=timeout)
        try:
            for request in requests:
                await call.write(request)
            await call.done_writing()
            while (message := await call.read()) is not grpc.aio.EOF:
                received.append(message)  # type: ignore[arg-type]
            return received, "OK", ""
        except grpc.aio.AioRpcError as e:
            return received, e.code().name, e.details() or ""
        except asyncio.InvalidStateError:  # a write after the end: the status says how
            return received, (await call.code()).name, await call.details() or ""


# --- the differential: same exchanges, same outcomes ----------------------------------------------

# (method, requests, timeout, compare the details too): the server's own statuses carry their
# details; statuses of the client's making (deadline, size limit) are compared by code.
EXCHANGES: list[tuple[str, list[bytes], float | None, bool]] = [
    ("Unary", [b"echo:hello"], None, True),
    ("Unary", [b"echo:"], None, True),
    ("Unary", ["abort:PERMISSION_DENIED:not you, über 100%: [x]".encode()], None, True),
    ("Unary", [b"abort:UNAVAILABLE:transport is closing"], None, True),
    ("Unary", [b"abort:UNAUTHENTICATED:"], None, True),
    ("Unary", [b"stall"], 0.3, False),
    ("Unary", [f"big:{LIMIT + 1}".encode()], None, False),
    ("Unary", [f"big:{LIMIT - 5}".encode()], None, True),
    ("Chat", [b"one", b"two", b"end"], None, True),
    ("Chat", [b"one", b"fail:FAILED_PRECONDITION:after one"], None, True),
    ("Chat", [], None, True),
    ("Nope", [b"x"], None, True),  # an unknown method: UNIMPLEMENTED, trailers-only
]


@pytest.mark.parametrize(("name", "requests", "timeout", "details"), EXCHANGES)
async def test_the_same_exchanges_end_the_same_through_grpcio_and_ours(
    peer: GrpcioPeer, name: str, requests: list[bytes], timeout: float | None, details: bool
) -> None:
    path = method(name)
    mine = await ours(peer.address, path, requests, timeout)
    reference = await theirs(peer.address, path, requests, timeout)
    if details:
        assert mine == reference
    else:
        assert (mine[0], mine[1]) == (reference[0], reference[1]), (mine, reference)


@pytest.mark.parametrize(
    ("path", "code"),
    [
        ("/raw/Ok", "OK"),
        ("/raw/Reset/2", "INTERNAL"),  # RST_STREAM(INTERNAL_ERROR) after a message
        ("/raw/Reset/8", "CANCELLED"),
        ("/raw/Reset/11", "RESOURCE_EXHAUSTED"),  # ENHANCE_YOUR_CALM
        ("/raw/GoAway/2", "UNAVAILABLE"),  # GOAWAY(INTERNAL_ERROR), then the close
        ("/raw/Close", "UNAVAILABLE"),  # the server closes mid-stream
    ],
)
async def test_transport_failures_end_the_same_through_grpcio_and_ours(
    raw: RawPeer, path: str, code: str
) -> None:
    mine = await ours(raw.address, path, [b"x"])
    reference = await theirs(raw.address, path, [b"x"])
    assert (mine[1], reference[1]) == (code, code), (mine, reference)
    # The message before the failure: ours hands it over; grpcio drops a message that arrives in
    # the same read as the stream's failure.
    assert mine[0] == [b"first"]
    if code != "OK":
        assert mine[2]  # ours names what happened


@pytest.mark.parametrize(
    ("status", "code"), [(503, "UNAVAILABLE"), (404, "UNIMPLEMENTED"), (403, "PERMISSION_DENIED")]
)
async def test_an_http_error_status_ends_the_call_at_once_as_grpcio_does(
    raw: RawPeer, status: int, code: str
) -> None:
    """HEADERS with an HTTP status other than 200 and the stream left open: the call ends on them,
    with the status gRPC maps it to, not whenever (if ever) the server ends the stream."""
    async with asyncio.timeout(5):
        mine = await ours(raw.address, f"/raw/Status/{status}", [b"x"])
        reference = await theirs(raw.address, f"/raw/Status/{status}", [b"x"])
    assert (mine[:2], reference[:2]) == (([], code), ([], code))
    assert mine[2] == f"the server answered HTTP status {status}"


# --- what only ours is asked --------------------------------------------------------------------


async def test_ok_trailers_after_half_a_message_end_the_call_as_an_error(raw: RawPeer) -> None:
    """A message cut short by the trailers is no message, and the call did not end well, whatever
    the trailers say (grpcio drops the half message and reports OK)."""
    assert await ours(raw.address, "/raw/Half", [b"x"]) == (
        [],
        "INTERNAL",
        "the trailers arrived inside a message: it is cut short",
    )


async def test_request_headers_reach_a_grpcio_server(raw: RawPeer, peer: GrpcioPeer) -> None:
    address = ControlPlaneAddress.parse(raw.address)
    channel = open_channel(address)
    try:
        with pytest.raises(RpcError):  # CANCELLED: the raw server resets it, having recorded the headers
            await channel.unary(
                "/raw/Reset/8", b"", [("authorization", "Bearer tok"), ("clusterid", "c1")], 2.0
            )
    finally:
        await channel.close()
    (headers,) = raw.requests
    assert headers[":method"] == "POST" and headers[":scheme"] == "http"
    assert headers[":path"] == "/raw/Reset/8" and headers[":authority"] == address.target
    assert headers["content-type"] == "application/grpc" and headers["te"] == "trailers"
    assert headers["grpc-timeout"].endswith("u") and int(headers["grpc-timeout"][:-1]) <= 2_000_000
    assert headers["authorization"] == "Bearer tok" and headers["clusterid"] == "c1"

    # grpcio reads them as metadata.
    grpcio = open_channel(ControlPlaneAddress.parse(peer.address))
    try:
        answer = await grpcio.unary(method("Unary"), b"meta", [("authorization", "Bearer tok")], 5.0)
    finally:
        await grpcio.close()
    assert "('authorization', 'Bearer tok')" in answer.decode()


async def test_messages_larger_than_the_windows_go_both_ways(peer: GrpcioPeer) -> None:
    small = replace(CHANNEL_SETTINGS, stream_window=65535, connection_window=65535)
    connection = await plain_connection(peer.address, small, max_message=64 * 1024 * 1024)
    try:
        size = 3 * 1024 * 1024  # grpcio's server takes up to 4 MiB
        call = connection.call(method("Chat"), [])
        payload = bytes(range(256)) * (size // 256)
        await call.write(payload)  # 48 times the server's initial window: waits for WINDOW_UPDATEs
        assert await call.read() == payload
        call.done_writing()
        assert await call.read() is None
        big = connection.call(method("Unary"), [])
        await big.write(f"big:{size}".encode())
        big.done_writing()
        assert await big.read() == b"b" * size  # 48 windows given back as they were read
    finally:
        connection.close()


async def test_a_peer_that_stops_answering_pings_is_cut_by_the_keepalive(raw: RawPeer) -> None:
    quick = replace(CHANNEL_SETTINGS, ping_interval=0.1, ping_timeout=0.2)
    connection = await plain_connection(raw.address, quick)
    call = connection.call("/raw/Deaf", [])
    call.done_writing()  # the server stops reading here
    with pytest.raises(RpcError) as caught:
        async with asyncio.timeout(5):
            await call.read()
    assert caught.value.code is StatusCode.UNAVAILABLE
    assert caught.value.details.startswith("keepalive timeout")


async def test_a_graceful_goaway_lets_the_call_finish(peer: GrpcioPeer) -> None:
    """grpcio's server stopping with a grace period: GOAWAY, the open call ends as the server ends it."""
    address = ControlPlaneAddress.parse(peer.address)
    channel = open_channel(address)
    try:
        call = await channel.stream(method("Chat"), [])
        await call.write(b"ping")
        assert await call.read() == b"ping"
        stopping = asyncio.create_task(peer.server.stop(None))
        with pytest.raises(RpcError) as caught:
            await call.read()
        await stopping
        assert caught.value.code is StatusCode.UNAVAILABLE  # as grpcio's client sees its server stop
        with pytest.raises(RpcError, match="UNAVAILABLE"):
            await channel.unary(method("Unary"), b"echo:x", [], 2.0)
    finally:
        await channel.close()


async def test_tls_with_the_configured_root_and_alt_host_name(tmp_path: Any) -> None:
    root = make_ca("grpc test root")
    leaf = issue(root, "spiffe://cluster.local/ns/istio-system/sa/istiod", dns_names=["istiod.test"])
    peer = await start_grpcio_peer(grpc.ssl_server_credentials([(leaf.key_pem, b"".join(leaf.chain_pem))]))
    try:
        address = ControlPlaneAddress.parse(f"https://127.0.0.1:{peer.port}")
        root_file = tmp_path / "root.pem"
        root_file.write_bytes(root.root_pem)
        channel = open_channel(address, str(root_file), "istiod.test")
        try:
            assert await channel.unary(method("Unary"), b"echo:over tls", [], 5.0) == b"over tls"
        finally:
            await channel.close()
        # The address's own name (an IP) is not in the certificate: one clear reason, no traceback.
        bare = open_channel(address, str(root_file))
        with pytest.raises(RpcError) as caught:
            await bare.unary(method("Unary"), b"echo:x", [], 5.0)
        assert caught.value.code is StatusCode.UNAVAILABLE
        assert "TLS" in caught.value.details and "127.0.0.1" in caught.value.details
        other = tmp_path / "other.pem"
        other.write_bytes(make_ca("someone else").root_pem)
        wrong = open_channel(address, str(other), "istiod.test")
        with pytest.raises(RpcError, match=r"certificate verify failed|unable to get local issuer"):
            await wrong.unary(method("Unary"), b"echo:x", [], 5.0)
    finally:
        await peer.server.stop(None)
    with pytest.raises(ControlPlaneError, match="invalid root certificate"):
        tls_context(b"-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n")


def test_a_root_without_a_certificate_is_refused_never_the_system_store(tmp_path: Any) -> None:
    """Only the literal SYSTEM means the system's roots: an empty root file, one of blank lines or
    a key alone, and an inline value without a certificate are each refused, naming the root."""
    address = ControlPlaneAddress.parse("https://127.0.0.1:15012")
    key_only = "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n"
    for name, content in (("empty.pem", ""), ("blank.pem", "\n \n"), ("key.pem", key_only)):
        path = tmp_path / name
        path.write_text(content)
        with pytest.raises(
            ControlPlaneError, match=rf"^root certificate {re.escape(str(path))} holds no certificate$"
        ):
            open_channel(address, str(path))
    with pytest.raises(ControlPlaneError, match=r"^inline root certificate holds no certificate$"):
        open_channel(address, key_only)
    with pytest.raises(ControlPlaneError, match="invalid root certificate"):
        tls_context(b"")  # given roots, none of them loaded: never the system's
    root = make_ca("a root").root_pem.decode()
    assert open_channel(address, root) is not None
    assert open_channel(address, "SYSTEM") is not None
