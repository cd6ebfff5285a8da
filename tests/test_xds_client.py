"""The Delta ADS client against a minimal gRPC server written here, which records every request the
proxy sends and answers what each test scripts."""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from google.protobuf import any_pb2
from google.protobuf.message import Message

from policy.model import Authorization, Scope
from tests.certs import issue, make_ca
from xds import convert
from xds.client import (
    ADDRESS_TYPE_URL,
    AUTHORIZATION_TYPE_URL,
    CONNECTION_ERROR,
    INITIAL_BACKOFF,
    MAX_BACKOFF,
    AuthToken,
    ConnectionFailed,
    StreamStatus,
    XdsClient,
    node_from,
    reconnect_delay,
)
from xds.gen.envoy.service.discovery.v3 import discovery_pb2, discovery_pb2_grpc
from xds.gen.istio.security import authorization_pb2
from xds.gen.istio.workload import workload_pb2
from xds.model import NetworkAddress, Service, TunnelProtocol, Workload
from ztunnel.metrics import Metrics
from ztunnel.state import ProxyState

TIMEOUT = 10.0

DeltaRequest = discovery_pb2.DeltaDiscoveryRequest
DeltaResponse = discovery_pb2.DeltaDiscoveryResponse


# --- the test server ----------------------------------------------------------------------------


@dataclass(frozen=True)
class End:
    """Ends the stream: OK (code None) or with a gRPC status."""

    code: grpc.StatusCode | None = None
    details: str = ""


@dataclass
class ServerStream:
    metadata: dict[str, str]
    requests: asyncio.Queue[DeltaRequest] = field(default_factory=asyncio.Queue)
    outbox: asyncio.Queue[DeltaResponse | End] = field(default_factory=asyncio.Queue)

    async def request(self) -> DeltaRequest:
        async with asyncio.timeout(TIMEOUT):
            return await self.requests.get()

    def send(self, response: DeltaResponse) -> None:
        self.outbox.put_nowait(response)

    async def exchange(self, response: DeltaResponse) -> DeltaRequest:
        """Send a response and return the proxy's reply to it."""
        self.send(response)
        return await self.request()

    def end(self, code: grpc.StatusCode | None = None, details: str = "") -> None:
        self.outbox.put_nowait(End(code, details))


class RecordingAds(discovery_pb2_grpc.AggregatedDiscoveryServiceServicer):
    def __init__(self) -> None:
        self.streams: asyncio.Queue[ServerStream] = asyncio.Queue()

    async def next_stream(self) -> ServerStream:
        async with asyncio.timeout(TIMEOUT):
            return await self.streams.get()

    async def DeltaAggregatedResources(
        self, request_iterator: AsyncIterator[DeltaRequest], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[DeltaResponse]:
        stream = ServerStream({m.key: m.value for m in context.invocation_metadata() or ()})
        self.streams.put_nowait(stream)

        async def record() -> None:
            async for request in request_iterator:
                stream.requests.put_nowait(request)

        reader = asyncio.create_task(record())
        try:
            while True:
                item = await stream.outbox.get()
                if isinstance(item, End):
                    if item.code is not None:
                        await context.abort(item.code, item.details)
                    return
                yield item
        finally:
            reader.cancel()


@dataclass
class AdsServer:
    ads: RecordingAds
    port: int
    server: grpc.aio.Server

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.port}"


async def start_ads(credentials: grpc.ServerCredentials | None = None) -> AdsServer:
    ads = RecordingAds()
    server = grpc.aio.server()
    discovery_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(ads, server)
    if credentials is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", credentials)
    await server.start()
    return AdsServer(ads, port, server)


@pytest.fixture
async def ads() -> AsyncIterator[AdsServer]:
    server = await start_ads()
    try:
        yield server
    finally:
        await server.server.stop(None)


class Sleeps:
    """The injected sleep: records the delays and returns at once."""

    def __init__(self) -> None:
        self.delays: list[float] = []
        self.changed = asyncio.Event()

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)
        self.changed.set()
        await asyncio.sleep(0)

    async def wait_for(self, count: int) -> list[float]:
        async with asyncio.timeout(TIMEOUT):
            while len(self.delays) < count:
                self.changed.clear()
                await self.changed.wait()
        return self.delays[:count]


@dataclass
class Running:
    client: XdsClient
    state: ProxyState
    task: asyncio.Task[None]


async def run_client(address: str, **kwargs: Any) -> Running:
    state = kwargs.pop("state", None) or ProxyState()
    node = kwargs.pop("node", None) or node_from(pod_name="ztunnel", pod_namespace="istio-system")
    client = XdsClient(address, state, node, **kwargs)
    return Running(client, state, asyncio.create_task(client.run()))


@pytest.fixture
async def clients() -> AsyncIterator[list[Running]]:
    running: list[Running] = []
    yield running
    for r in running:
        await r.client.close()
        assert r.task.done()


# --- resources ----------------------------------------------------------------------------------


def packed(message: Message) -> any_pb2.Any:
    out = any_pb2.Any()
    out.Pack(message)
    return out


def address_resource(name: str, address: workload_pb2.Address, version: str = "1") -> discovery_pb2.Resource:
    return discovery_pb2.Resource(name=name, version=version, resource=packed(address))


def workload(uid: str, ip: str = "10.0.0.1", **fields: Any) -> workload_pb2.Address:
    w = workload_pb2.Workload(
        uid=uid, name=uid.rsplit("/", 1)[-1], namespace="ns", addresses=[ipaddress.ip_address(ip).packed]
    )
    for key, value in fields.items():
        setattr(w, key, value)
    return workload_pb2.Address(workload=w)


def service(name: str, vip: str) -> workload_pb2.Address:
    return workload_pb2.Address(
        service=workload_pb2.Service(
            name=name,
            namespace="ns",
            hostname=f"{name}.ns.svc.cluster.local",
            addresses=[workload_pb2.NetworkAddress(address=ipaddress.ip_address(vip).packed)],
            ports=[workload_pb2.Port(service_port=80, target_port=8080)],
        )
    )


def policy_resource(name: str, version: str = "1", scope: int = 1) -> discovery_pb2.Resource:
    p = authorization_pb2.Authorization(name=name, namespace="ns", scope=scope)  # type: ignore[arg-type]
    p.rules.add().clauses.add().matches.add().destination_ports.append(9999)
    return discovery_pb2.Resource(name=f"ns/{name}", version=version, resource=packed(p))


def addresses(nonce: str, *resources: discovery_pb2.Resource, removed: tuple[str, ...] = ()) -> DeltaResponse:
    return DeltaResponse(
        type_url=ADDRESS_TYPE_URL, nonce=nonce, resources=resources, removed_resources=removed
    )


def policies(nonce: str, *resources: discovery_pb2.Resource, removed: tuple[str, ...] = ()) -> DeltaResponse:
    return DeltaResponse(
        type_url=AUTHORIZATION_TYPE_URL, nonce=nonce, resources=resources, removed_resources=removed
    )


async def initial_pair(stream: ServerStream) -> tuple[DeltaRequest, DeltaRequest]:
    return await stream.request(), await stream.request()


def is_ack(reply: DeltaRequest, type_url: str, nonce: str) -> bool:
    """Only type_url and response_nonce are set."""
    return reply == DeltaRequest(type_url=type_url, response_nonce=nonce)


# --- tests --------------------------------------------------------------------------------------


async def test_initial_requests_name_the_node_and_carry_credentials(
    ads: AdsServer, clients: list[Running], tmp_path: Path
) -> None:
    token_file = tmp_path / "istio-token"
    token_file.write_text("first-token\n")
    node = node_from(
        instance_ip="10.1.2.3",
        pod_name="pod",
        pod_namespace="ns",
        node_name="node-7",
        istio_meta={"ISTIO_VERSION": "1.24.0", "DNS_CAPTURE": "true"},
        istio_meta_json={"LABELS": {"app": "ztunnel"}},
        cluster_id="cluster-9",
    )
    clients.append(
        await run_client(
            ads.address,
            node=node,
            token=AuthToken.from_setting(str(token_file)),
            cluster_id="cluster-9",
            headers=[("x_tenant", "a")],
        )
    )
    stream = await ads.ads.next_stream()
    first, second = await initial_pair(stream)

    assert [first.type_url, second.type_url] == [ADDRESS_TYPE_URL, AUTHORIZATION_TYPE_URL]
    for request in (first, second):
        assert request.node.id == "ztunnel~10.1.2.3~pod.ns~ns.svc.cluster.local"
        meta = dict(request.node.metadata)
        assert meta["NAME"] == "pod" and meta["NAMESPACE"] == "ns"
        assert meta["INSTANCE_IPS"] == "10.1.2.3" and meta["NODE_NAME"] == "node-7"
        assert meta["ISTIO_VERSION"] == "1.24.0" and meta["CLUSTER_ID"] == "cluster-9"
        assert meta["LABELS"]["app"] == "ztunnel"
        # Wildcard: no names, nothing held yet.
        assert list(request.resource_names_subscribe) == [] == list(request.resource_names_unsubscribe)
        assert dict(request.initial_resource_versions) == {}
        assert request.response_nonce == ""
    assert stream.metadata["authorization"] == "Bearer first-token"
    assert stream.metadata["clusterid"] == "cluster-9"
    assert stream.metadata["x_tenant"] == "a"

    # The token file is read again for the next stream.
    token_file.write_text("second-token")
    stream.end()
    again = await ads.ads.next_stream()
    assert again.metadata["authorization"] == "Bearer second-token"


async def test_responses_are_applied_and_acked_and_readiness_follows_both_types(
    ads: AdsServer, clients: list[Running]
) -> None:
    synced: list[bool] = []
    running = await run_client(ads.address, on_synced=lambda: synced.append(True))
    clients.append(running)
    stream = await ads.ads.next_stream()
    await initial_pair(stream)

    reply = await stream.exchange(
        addresses(
            "nonce-1",
            address_resource("c//v1/Pod/ns/a", workload("c//v1/Pod/ns/a", "10.0.0.1", tunnel_protocol=1)),
            address_resource("ns/svc.ns.svc.cluster.local", service("svc", "10.96.0.1")),
        )
    )
    assert is_ack(reply, ADDRESS_TYPE_URL, "nonce-1")
    state = running.state
    a = state.workload_by_uid("c//v1/Pod/ns/a")
    assert a is not None and a.tunnel_protocol is TunnelProtocol.HBONE
    assert a.trust_domain == "cluster.local"  # the wire defaults apply
    assert state.services_by_vip("", ipaddress.ip_address("10.96.0.1"))[0].name == "svc"
    await asyncio.sleep(0.05)
    assert not running.client.synced and synced == []  # Authorization not answered yet

    reply = await stream.exchange(policies("nonce-2", policy_resource("deny-9999")))
    assert is_ack(reply, AUTHORIZATION_TYPE_URL, "nonce-2")
    async with asyncio.timeout(TIMEOUT):
        await running.client.wait_synced()
    assert synced == [True]
    p = state.policy("ns/deny-9999")
    assert p is not None and p.scope is Scope.NAMESPACE


async def test_malformed_resources_are_nacked_and_their_siblings_applied(
    ads: AdsServer, clients: list[Running], proxy_logs: Any
) -> None:
    running = await run_client(ads.address)
    clients.append(running)
    stream = await ads.ads.next_stream()
    await initial_pair(stream)

    bad_ip = workload("c//v1/Pod/ns/short-ip")
    bad_ip.workload.addresses[0] = b"\x0a\x00\x00"
    no_slash = workload("c//v1/Pod/ns/no-slash", "10.0.0.3")
    no_slash.workload.services["nohostname"].ports.add(service_port=80, target_port=80)
    reply = await stream.exchange(
        addresses(
            "n1",
            address_resource("c//v1/Pod/ns/good", workload("c//v1/Pod/ns/good", "10.0.0.1")),
            address_resource(
                "c//v1/Pod/ns/bad-enum", workload("c//v1/Pod/ns/bad-enum", "10.0.0.2", tunnel_protocol=7)
            ),
            address_resource("c//v1/Pod/ns/short-ip", bad_ip),
            address_resource("c//v1/Pod/ns/no-slash", no_slash),
            address_resource("ns/svc.ns.svc.cluster.local", service("svc", "10.96.0.1")),
            discovery_pb2.Resource(name="garbage", version="1", resource=any_pb2.Any(value=b"\xff\xff\xff")),
        )
    )
    assert reply.type_url == ADDRESS_TYPE_URL and reply.response_nonce == "n1"
    assert reply.error_detail.code == 0
    reasons = reply.error_detail.message.split("; ")
    assert reasons[:3] == [
        "c//v1/Pod/ns/bad-enum: unknown tunnel_protocol value 7",
        "c//v1/Pod/ns/short-ip: invalid IP address: 3 bytes (expected 4 or 16)",
        "c//v1/Pod/ns/no-slash: invalid service key 'nohostname' (expected '<namespace>/<hostname>')",
    ]
    assert reasons[3].startswith("garbage: decode: ")
    assert len(reasons) == 4
    assert not reply.HasField("node") and not reply.initial_resource_versions

    state = running.state
    assert [w.uid for w in state.workloads()] == ["c//v1/Pod/ns/good"]
    assert [s.key for s in state.services()] == ["ns/svc.ns.svc.cluster.local"]
    assert running.client.resource_versions(ADDRESS_TYPE_URL) == {
        "c//v1/Pod/ns/good": "1",
        "ns/svc.ns.svc.cluster.local": "1",
    }
    # A NACK answers the type for readiness too.
    await stream.exchange(policies("n2"))
    async with asyncio.timeout(TIMEOUT):
        await running.client.wait_synced()
    warnings = [line for line in proxy_logs.text().splitlines() if "\twarn\t" in line and "NACK" in line]
    assert len(warnings) == 1 and "unknown tunnel_protocol value 7" in warnings[0]


async def test_a_huge_policy_is_converted_while_the_loop_keeps_running(
    ads: AdsServer, clients: list[Running]
) -> None:
    """A 1 MB Authorization of 100k CIDRs: converted beside the loop (which carries the data plane),
    so that a task ticking every 5 ms keeps ticking while it is; then applied and ACKed."""
    running = await run_client(ads.address)
    clients.append(running)
    stream = await ads.ads.next_stream()
    await initial_pair(stream)
    pb = authorization_pb2.Authorization(name="huge", namespace="ns")
    match = pb.rules.add().clauses.add().matches.add()
    for i in range(100_000):
        match.source_ips.add(address=(0x0A000000 + 4 * i).to_bytes(4, "big"), length=30)
    assert pb.ByteSize() > 1_000_000
    ticks: list[float] = []

    async def tick() -> None:
        while True:
            ticks.append(time.monotonic())
            await asyncio.sleep(0.005)

    ticker = asyncio.create_task(tick())
    try:
        await asyncio.sleep(0.05)
        start = time.monotonic()
        reply = await stream.exchange(
            policies("big", discovery_pb2.Resource(name="ns/huge", version="1", resource=packed(pb)))
        )
        took = time.monotonic() - start
    finally:
        ticker.cancel()
    assert is_ack(reply, AUTHORIZATION_TYPE_URL, "big")
    policy = running.state.policy("ns/huge")
    assert policy is not None and len(policy.rules[0][0][0].source_ips) == 100_000
    during = [t for t in ticks if start <= t <= start + took]
    gaps = [b - a for a, b in itertools.pairwise(during)]
    # Converted on the loop, it was one gap as long as the whole conversion (0.3-1.3 s).
    assert len(during) >= 5 and max(gaps, default=0) < took / 2, (len(during), max(gaps, default=0), took)


async def test_removals_by_uid_by_service_key_and_by_policy_key(
    ads: AdsServer, clients: list[Running]
) -> None:
    running = await run_client(ads.address)
    clients.append(running)
    stream = await ads.ads.next_stream()
    await initial_pair(stream)
    await stream.exchange(
        addresses(
            "n1",
            address_resource("c//v1/Pod/ns/a", workload("c//v1/Pod/ns/a", "10.0.0.1")),
            address_resource("c//v1/Pod/ns/b", workload("c//v1/Pod/ns/b", "10.0.0.2")),
            address_resource("ns/svc.ns.svc.cluster.local", service("svc", "10.96.0.1")),
        )
    )
    await stream.exchange(policies("n2", policy_resource("p1"), policy_resource("p2")))
    state = running.state

    reply = await stream.exchange(addresses("n3", removed=("c//v1/Pod/ns/a", "ns/svc.ns.svc.cluster.local")))
    assert is_ack(reply, ADDRESS_TYPE_URL, "n3")
    assert [w.uid for w in state.workloads()] == ["c//v1/Pod/ns/b"]
    assert state.services() == []
    assert state.workload_by_addr("", ipaddress.ip_address("10.0.0.1")) is None

    reply = await stream.exchange(policies("n4", removed=("ns/p1",)))
    assert is_ack(reply, AUTHORIZATION_TYPE_URL, "n4")
    assert [p.key for p in state.policies()] == ["ns/p2"]
    assert running.client.resource_versions(ADDRESS_TYPE_URL) == {"c//v1/Pod/ns/b": "1"}
    assert running.client.resource_versions(AUTHORIZATION_TYPE_URL) == {"ns/p2": "1"}


async def test_unknown_type_urls_are_acked(ads: AdsServer, clients: list[Running]) -> None:
    running = await run_client(ads.address)
    clients.append(running)
    stream = await ads.ads.next_stream()
    await initial_pair(stream)
    reply = await stream.exchange(DeltaResponse(type_url="type.googleapis.com/example.Other", nonce="x1"))
    assert is_ack(reply, "type.googleapis.com/example.Other", "x1")


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


def test_reconnect_delays_of_the_reference() -> None:
    unavailable = grpc.StatusCode.UNAVAILABLE
    cases: list[tuple[BaseException | None, float, str, float]] = [
        (None, 1.0, "Complete", 0.0),
        (ConnectionFailed("refused"), INITIAL_BACKOFF, CONNECTION_ERROR, 0.02),
        (ConnectionFailed("refused"), 10.0, CONNECTION_ERROR, MAX_BACKOFF),
        (StreamStatus(grpc.StatusCode.UNKNOWN, ""), 5.0, "Reconnect", INITIAL_BACKOFF),
        (StreamStatus(grpc.StatusCode.CANCELLED, ""), 5.0, "Reconnect", INITIAL_BACKOFF),
        (StreamStatus(grpc.StatusCode.DEADLINE_EXCEEDED, ""), 5.0, "Reconnect", INITIAL_BACKOFF),
        (StreamStatus(unavailable, "x: transport is closing"), 5.0, "Reconnect", INITIAL_BACKOFF),
        (StreamStatus(unavailable, "received prior goaway: code"), 5.0, "Reconnect", INITIAL_BACKOFF),
        (StreamStatus(unavailable, "socket closed"), 1.0, "Error", 2.0),
        (StreamStatus(grpc.StatusCode.PERMISSION_DENIED, "no"), 1.0, "Error", 2.0),
        (ValueError("anything else"), 8.0, "Error", 0.0),
    ]
    for end, backoff, reason, delay in cases:
        assert reconnect_delay(end, backoff) == (reason, pytest.approx(delay)), end


async def test_https_with_a_root_ca_and_an_alternative_host_name(
    tmp_path: Path, clients: list[Running]
) -> None:
    ca = make_ca("xds test root")
    leaf = issue(ca, "spiffe://cluster.local/ns/istio-system/sa/istiod", dns_names=["istiod.test"])
    creds = grpc.ssl_server_credentials([(leaf.key_pem, b"".join(leaf.chain_pem))])
    server = await start_ads(creds)
    try:
        root = tmp_path / "root-cert.pem"
        root.write_bytes(ca.root_pem)
        running = await run_client(
            f"https://127.0.0.1:{server.port}", root_ca=str(root), alt_hostname="istiod.test"
        )
        clients.append(running)
        stream = await server.ads.next_stream()
        first, _ = await initial_pair(stream)
        assert first.type_url == ADDRESS_TYPE_URL

        # Another root: the handshake fails and counts as a connection error.
        other = tmp_path / "other-root.pem"
        other.write_bytes(make_ca("someone else").root_pem)
        sleeps = Sleeps()
        metrics = Metrics(process_metrics=False)
        refused = await run_client(
            f"https://127.0.0.1:{server.port}",
            root_ca=str(other),
            alt_hostname="istiod.test",
            sleep=sleeps,
            metrics=metrics.xds,
        )
        clients.append(refused)
        assert await sleeps.wait_for(2) == pytest.approx([0.02, 0.04])
        assert (
            'istio_xds_connection_terminations_total{reason="ConnectionError"} '
            in metrics.render(None)[0].decode()
        )
        assert server.ads.streams.empty()  # no stream ever reached the server
    finally:
        await server.server.stop(None)


async def test_on_demand_subscribes_to_nothing_then_to_what_is_asked(
    ads: AdsServer, clients: list[Running]
) -> None:
    running = await run_client(ads.address, on_demand=True)
    clients.append(running)
    stream = await ads.ads.next_stream()
    first, second = await initial_pair(stream)
    assert list(first.resource_names_subscribe) == ["*"] == list(first.resource_names_unsubscribe)
    assert list(second.resource_names_subscribe) == []
    # Only Authorization gates readiness in on-demand mode.
    await stream.exchange(policies("n1"))
    async with asyncio.timeout(TIMEOUT):
        await running.client.wait_synced()

    waiter = asyncio.create_task(running.client.demand("/10.0.0.5"))
    subscribe = await stream.request()
    assert subscribe == DeltaRequest(type_url=ADDRESS_TYPE_URL, resource_names_subscribe=["/10.0.0.5"])
    assert not waiter.done()
    await stream.exchange(addresses("n2", removed=("/10.0.0.5",)))
    async with asyncio.timeout(TIMEOUT):
        await waiter


def test_node_defaults() -> None:
    node = node_from()
    assert node.id == "ztunnel~1.1.1.1~.~.svc.cluster.local"
    assert dict(node.metadata)["INSTANCE_IPS"] == "1.1.1.1"


def test_local_config_model_served_over_the_wire_reaches_the_store() -> None:
    """What the development control plane sends (model -> wire) is what the client applies."""
    state = ProxyState()
    client = XdsClient("http://127.0.0.1:1", state, node_from())
    w = Workload(uid="u1", namespace="ns", addresses=(ipaddress.ip_address("10.0.0.8"),), trust_domain="td")
    s = Service(
        name="s",
        namespace="ns",
        hostname="s.ns",
        vips=(NetworkAddress("", ipaddress.ip_address("10.96.0.8")),),
    )
    p = Authorization(name="p", namespace="ns")
    reply = client.handle_response(
        addresses(
            "n",
            discovery_pb2.Resource(name="u1", version="1", resource=packed(convert.address_to_wire(w))),
            discovery_pb2.Resource(name="ns/s.ns", version="1", resource=packed(convert.address_to_wire(s))),
        )
    )
    assert not reply.HasField("error_detail")
    client.handle_response(
        policies("m", discovery_pb2.Resource(name="ns/p", resource=packed(convert.authorization_to_wire(p))))
    )
    got = state.workload_by_uid("u1")
    assert got is not None and got.trust_domain == "td" and got.service_account == "default"
    assert state.service_by_key("ns/s.ns") == s
    assert state.policy("ns/p") == p
