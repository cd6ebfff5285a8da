"""The gRPC client's protocol without I/O (`xds.grpc.wire`): framing, headers, statuses, one call's
response side."""

from __future__ import annotations

import pytest

from xds.grpc.wire import (
    CallState,
    MessageReader,
    RpcError,
    Status,
    StatusCode,
    encode_timeout,
    frame_message,
    request_headers,
    status_from,
)


def test_a_message_is_a_flag_a_length_and_the_bytes() -> None:
    assert frame_message(b"abc") == b"\x00\x00\x00\x00\x03abc"
    assert frame_message(b"") == b"\x00\x00\x00\x00\x00"


def test_the_reader_cuts_messages_at_any_split() -> None:
    stream = b"".join(frame_message(m) for m in (b"first", b"", b"x" * 300))
    for step in (1, 2, 5, 7, 64, len(stream)):
        reader = MessageReader(1000)
        out: list[bytes] = []
        for at in range(0, len(stream), step):
            out += reader.feed(stream[at : at + step])
        assert out == [b"first", b"", b"x" * 300], step
        assert not reader.partial


def test_a_message_over_the_limit_is_refused_at_its_prefix() -> None:
    reader = MessageReader(100)
    with pytest.raises(RpcError) as caught:
        reader.feed(frame_message(b"y" * 101)[:5])  # the prefix alone: nothing buffered beyond it
    assert caught.value.status == Status(
        StatusCode.RESOURCE_EXHAUSTED, "received message larger than max (101 vs. 100)"
    )
    with pytest.raises(RpcError, match="compressed"):
        MessageReader(100).feed(b"\x01\x00\x00\x00\x01z")


@pytest.mark.parametrize(
    ("seconds", "header"),
    [
        (60.0, "60000000u"),
        (0.5, "500000u"),
        (0.000001, "1000n"),
        (1e-10, "1n"),
        (0, "0n"),
        (1000.0, "1000000m"),
        (86400.0 * 3, "259200S"),
        (1e9, "16666667M"),
    ],
)
def test_grpc_timeout_has_at_most_eight_digits_and_never_shortens(seconds: float, header: str) -> None:
    assert encode_timeout(seconds) == header
    digits, unit = header[:-1], header[-1]
    assert len(digits) <= 8
    scale = {"n": 1e-9, "u": 1e-6, "m": 1e-3, "S": 1.0, "M": 60.0, "H": 3600.0}[unit]
    assert int(digits) * scale >= seconds * (1 - 1e-12)


def test_request_headers_as_grpc_requires() -> None:
    headers = request_headers(
        "istiod:15012",
        "/istio.v1.auth.IstioCertificateService/CreateCertificate",
        tls=True,
        timeout=60.0,
        metadata=[("authorization", "Bearer t0ken"), ("X-Tenant", "a")],
    )
    assert headers == [
        (":method", "POST"),
        (":scheme", "https"),
        (":path", "/istio.v1.auth.IstioCertificateService/CreateCertificate"),
        (":authority", "istiod:15012"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
        ("grpc-timeout", "60000000u"),
        ("authorization", "Bearer t0ken"),
        ("x-tenant", "a"),
    ]
    assert ("grpc-timeout" not in dict(request_headers("h:1", "/a/b", tls=False))) is True
    assert dict(request_headers("h:1", "/a/b", tls=False))[":scheme"] == "http"
    for reserved in ("te", ":path", "grpc-status", "Content-Type"):
        with pytest.raises(ValueError, match="reserved"):
            request_headers("h:1", "/a/b", tls=False, metadata=[(reserved, "x")])


def test_statuses_from_trailers() -> None:
    assert status_from([("grpc-status", "0")]) == Status(StatusCode.OK)
    assert status_from([("grpc-status", "7"), ("grpc-message", "no%20way%3A%20%C3%BCber%25")]) == Status(
        StatusCode.PERMISSION_DENIED, "no way: über%"
    )
    assert status_from([("grpc-status", "99")]).code is StatusCode.UNKNOWN
    assert status_from([]) == Status(StatusCode.UNKNOWN, "the server sent no grpc-status")
    # A proxy's error page instead of a gRPC answer: the HTTP status decides.
    assert status_from([], 503).code is StatusCode.UNAVAILABLE
    assert status_from([], 404).code is StatusCode.UNIMPLEMENTED
    assert status_from([], 401).code is StatusCode.UNAUTHENTICATED


def test_a_call_state_from_response_to_status() -> None:
    call = CallState(1000)
    call.response([(":status", "200"), ("content-type", "application/grpc+proto")], False)
    assert call.data(frame_message(b"one") + frame_message(b"tw")[:4]) == [b"one"]
    assert call.data(frame_message(b"tw")[4:]) == [b"tw"]
    call.trailers([("grpc-status", "0")])
    call.ended()
    assert call.status == Status(StatusCode.OK)

    trailers_only = CallState(1000)
    trailers_only.response([(":status", "200"), ("grpc-status", "16"), ("grpc-message", "bad%20token")], True)
    assert trailers_only.status == Status(StatusCode.UNAUTHENTICATED, "bad token")

    cut = CallState(1000)
    cut.response([(":status", "200"), ("content-type", "application/grpc")], False)
    cut.data(frame_message(b"half")[:6])
    cut.ended()
    assert cut.status == Status(StatusCode.INTERNAL, "the stream ended inside a message")

    half = CallState(1000)  # OK trailers do not make half a message whole
    half.response([(":status", "200"), ("content-type", "application/grpc")], False)
    half.data(frame_message(b"half")[:6])
    half.trailers([("grpc-status", "0")])
    assert half.status == Status(
        StatusCode.INTERNAL, "the trailers arrived inside a message: it is cut short"
    )
    failed = CallState(1000)  # a failure the trailers name is kept as they name it
    failed.response([(":status", "200"), ("content-type", "application/grpc")], False)
    failed.data(frame_message(b"half")[:6])
    failed.trailers([("grpc-status", "14"), ("grpc-message", "going away")])
    assert failed.status == Status(StatusCode.UNAVAILABLE, "going away")

    reset = CallState(1000)
    reset.reset(0x8)
    assert reset.status is not None and reset.status.code is StatusCode.CANCELLED

    html = CallState(1000)
    html.response([(":status", "200"), ("content-type", "text/html")], False)
    assert html.status is not None and html.status.code is StatusCode.UNKNOWN
