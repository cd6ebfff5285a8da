"""The xDS client's reconnects: the resources it lists again, the state it keeps, the backoff."""

from __future__ import annotations

import contextlib
import socket

import grpc
import grpc.aio
import pytest

from tests.ads import (
    AdsServer,
    Running,
    Sleeps,
    address_resource,
    addresses,
    ads_fixture,  # noqa: F401 (a fixture)
    clients_fixture,  # noqa: F401 (a fixture)
    initial_pair,
    policies,
    policy_resource,
    run_client,
    service,
    workload,
)
from xds.client import (
    CONNECTION_ERROR,
    INITIAL_BACKOFF,
    MAX_BACKOFF,
    ConnectionFailed,
    StreamStatus,
    reconnect_delay,
)
from xds.convert import ADDRESS_TYPE_URL, AUTHORIZATION_TYPE_URL
from xds.grpc.wire import StatusCode
from ztunnel.metrics.families import Metrics
from ztunnel.state.store import ProxyState


async def test_reconnect_lists_the_accepted_resources_and_keeps_state(
    ads: AdsServer, clients: list[Running]
) -> None:
    metrics = Metrics(process_metrics=False)
    running = await run_client(ads.address, metrics=metrics.xds)
    clients.append(running)
    stream = await ads.ads.next_stream()
    await initial_pair(stream)
    await stream.exchange(
        addresses(
            "n1",
            address_resource("c//v1/Pod/ns/a", workload("c//v1/Pod/ns/a", "10.0.0.1"), version="v7"),
            address_resource(
                "c//v1/Pod/ns/bad", workload("c//v1/Pod/ns/bad", tunnel_protocol=2), version="v1"
            ),
            address_resource("ns/svc.ns.svc.cluster.local", service("svc", "10.96.0.1"), version="v3"),
        )
    )
    await stream.exchange(policies("n2", policy_resource("p1", version="v9")))
    body = metrics.render(None)[0].decode()
    assert "istio_xds_connection_terminations_total" not in body
    assert f'istio_xds_message_total{{url="{ADDRESS_TYPE_URL}"}} 1' in body
    assert f'istio_xds_message_total{{url="{AUTHORIZATION_TYPE_URL}"}} 1' in body
    assert f'istio_xds_message_bytes_total{{url="{ADDRESS_TYPE_URL}"}} ' in body

    # The server resets the stream the way a restarting istiod does.
    stream.end(grpc.StatusCode.UNAVAILABLE, "transport is closing")
    again = await ads.ads.next_stream()
    first, second = await initial_pair(again)
    assert first.type_url == ADDRESS_TYPE_URL
    # The rejected resource is not listed, so the server sends it again.
    assert dict(first.initial_resource_versions) == {
        "c//v1/Pod/ns/a": "v7",
        "ns/svc.ns.svc.cluster.local": "v3",
    }
    assert dict(second.initial_resource_versions) == {"ns/p1": "v9"}
    assert running.state.workload_by_uid("c//v1/Pod/ns/a") is not None
    assert running.client.connections == 2
    body = metrics.render(None)[0].decode()
    assert 'istio_xds_connection_terminations_total{reason="Reconnect"} 1' in body

    # A clean end reconnects too, counted as Complete.
    again.end()
    third = await ads.ads.next_stream()
    await initial_pair(third)
    body = metrics.render(None)[0].decode()
    assert 'istio_xds_connection_terminations_total{reason="Complete"} 1' in body


async def test_connection_errors_back_off_doubling(clients: list[Running]) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sleeps = Sleeps()
    metrics = Metrics(process_metrics=False)
    running = await run_client(f"http://127.0.0.1:{port}", sleep=sleeps, metrics=metrics.xds)
    clients.append(running)
    delays = await sleeps.wait_for(5)
    assert delays == pytest.approx([0.02, 0.04, 0.08, 0.16, 0.32])
    assert not running.client.synced
    body = metrics.render(None)[0].decode()
    assert 'istio_xds_connection_terminations_total{reason="ConnectionError"}' in body


class BrokenStore(ProxyState):
    """A store with a bug: applying a response raises what the client never expects."""

    def batch(self) -> contextlib.AbstractContextManager[None]:
        raise RuntimeError("a bug in the store")


async def test_an_unexpected_error_backs_off_like_any_other(ads: AdsServer, clients: list[Running]) -> None:
    """A stream that ends in an exception of no known kind is not reconnected at once: each new
    stream takes a full push from the control plane, so a bug that fails every push would loop."""
    sleeps = Sleeps()
    metrics = Metrics(process_metrics=False)
    running = await run_client(ads.address, state=BrokenStore(), sleep=sleeps, metrics=metrics.xds)
    clients.append(running)
    for n in range(3):
        stream = await ads.ads.next_stream()
        await initial_pair(stream)
        stream.send(addresses(f"n{n}", address_resource("c//v1/Pod/ns/a", workload("c//v1/Pod/ns/a"))))
    assert await sleeps.wait_for(3) == pytest.approx([0.02, 0.04, 0.08])
    body = metrics.render(None)[0].decode()
    assert 'istio_xds_connection_terminations_total{reason="Error"} 3' in body


def test_reconnect_delays_of_the_reference() -> None:
    unavailable = StatusCode.UNAVAILABLE
    cases: list[tuple[BaseException | None, float, str, float]] = [
        (None, 1.0, "Complete", 0.0),
        (ConnectionFailed("refused"), INITIAL_BACKOFF, CONNECTION_ERROR, 0.02),
        (ConnectionFailed("refused"), 10.0, CONNECTION_ERROR, MAX_BACKOFF),
        (StreamStatus(StatusCode.UNKNOWN, ""), 5.0, "Reconnect", INITIAL_BACKOFF),
        (StreamStatus(StatusCode.CANCELLED, ""), 5.0, "Reconnect", INITIAL_BACKOFF),
        (StreamStatus(StatusCode.DEADLINE_EXCEEDED, ""), 5.0, "Reconnect", INITIAL_BACKOFF),
        (StreamStatus(unavailable, "x: transport is closing"), 5.0, "Reconnect", INITIAL_BACKOFF),
        (StreamStatus(unavailable, "received prior goaway: code"), 5.0, "Reconnect", INITIAL_BACKOFF),
        (StreamStatus(unavailable, "socket closed"), 1.0, "Error", 2.0),
        (StreamStatus(StatusCode.PERMISSION_DENIED, "no"), 1.0, "Error", 2.0),
        (ValueError("anything else"), 1.0, "Error", 2.0),  # a bug of ours backs off too
        (ValueError("anything else"), 8.0, "Error", MAX_BACKOFF),
    ]
    for end, backoff, reason, delay in cases:
        assert reconnect_delay(end, backoff) == (reason, pytest.approx(delay)), end
