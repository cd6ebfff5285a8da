"""The Delta ADS client's conversation (`tests/ads.py`'s server): responses applied and ACKed,
malformed resources NACKed, removals, unknown types, on-demand subscriptions."""

from __future__ import annotations

import asyncio
import gc
import ipaddress
import itertools
import time
from typing import Any

from google.protobuf import any_pb2

from mesh.model import NetworkAddress, Service, TunnelProtocol, Workload
from policy.model import Authorization, Scope
from tests.ads import (
    TIMEOUT,
    AdsServer,
    DeltaRequest,
    DeltaResponse,
    Running,
    address_resource,
    addresses,
    ads_fixture,  # noqa: F401 (a fixture)
    clients_fixture,  # noqa: F401 (a fixture)
    initial_pair,
    is_ack,
    packed,
    policies,
    policy_resource,
    run_client,
    service,
    workload,
)
from tests.waiting import eventually_async
from xds import convert
from xds.channel import node_from
from xds.client import (
    XdsClient,
)
from xds.convert import ADDRESS_TYPE_URL, AUTHORIZATION_TYPE_URL
from xds.gen.envoy.service.discovery.v3 import discovery_pb2
from xds.gen.istio.security import authorization_pb2
from ztunnel.state.store import ProxyState


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
    # (A negative check: correct code passes however long this is; it bounds how long a wrong sync has
    # to show.)
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


async def test_resources_that_could_never_route_are_nacked_by_name_and_the_rest_applies(
    ads: AdsServer, clients: list[Running]
) -> None:
    """A workload whose waypoint is on port 0 and a service without a namespace (which the
    development control plane refuses to load, so an istiod of its own sends them here): each is
    NACKed, naming it and why, and the valid ones beside are applied."""
    running = await run_client(ads.address)
    clients.append(running)
    stream = await ads.ads.next_stream()
    await initial_pair(stream)

    lost = workload("c//v1/Pod/ns/lost", "10.0.0.7")
    lost.workload.waypoint.hostname.namespace = "ns"
    lost.workload.waypoint.hostname.hostname = "wp.ns.svc.cluster.local"
    lost.workload.waypoint.hbone_mtls_port = 0
    nowhere = service("nowhere", "10.96.7.7")
    nowhere.service.namespace = ""
    reply = await stream.exchange(
        addresses(
            "n1",
            address_resource("c//v1/Pod/ns/lost", lost),
            address_resource("/nowhere.ns.svc.cluster.local", nowhere),
            address_resource("c//v1/Pod/ns/good", workload("c//v1/Pod/ns/good", "10.0.0.1")),
            address_resource("ns/web.ns.svc.cluster.local", service("web", "10.96.7.8")),
        )
    )
    assert reply.error_detail.message.split("; ") == [
        "c//v1/Pod/ns/lost: gateway hbone_mtls_port is 0: the gateway can never be reached",
        "/nowhere.ns.svc.cluster.local: service namespace is empty",
    ]
    assert [w.uid for w in running.state.workloads()] == ["c//v1/Pod/ns/good"]
    assert [s.key for s in running.state.services()] == ["ns/web.ns.svc.cluster.local"]


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
            await asyncio.sleep(0.005)  # the ticker's period: what measures the loop

    ticker = asyncio.create_task(tick())
    try:
        await eventually_async(lambda: len(ticks) >= 2, "the ticker running")
        start = time.monotonic()
        reply = await stream.exchange(
            policies("big", discovery_pb2.Resource(name="ns/huge", version="1", resource=packed(pb)))
        )
        took = time.monotonic() - start
    finally:
        ticker.cancel()
    assert is_ack(reply, AUTHORIZATION_TYPE_URL, "big")
    assert gc.isenabled()  # paused while the big response was converted and applied, on again
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
