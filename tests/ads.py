"""A minimal Delta ADS server for the xDS client's tests: it records every request the proxy sends
and answers what each test scripts; the resources it sends, and the client under test."""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio
import pytest
from google.protobuf import any_pb2
from google.protobuf.message import Message

from xds.channel import node_from
from xds.client import (
    XdsClient,
)
from xds.convert import ADDRESS_TYPE_URL, AUTHORIZATION_TYPE_URL
from xds.gen.envoy.service.discovery.v3 import discovery_pb2, discovery_pb2_grpc
from xds.gen.istio.security import authorization_pb2
from xds.gen.istio.workload import workload_pb2
from ztunnel.state.store import ProxyState

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


@pytest.fixture(name="ads")
async def ads_fixture() -> AsyncIterator[AdsServer]:
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


@pytest.fixture(name="clients")
async def clients_fixture() -> AsyncIterator[list[Running]]:
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
