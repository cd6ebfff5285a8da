"""A new xDS stream's initial request within the control plane's message limit: it lists what fits,
the rest comes again as adds, and what is gone disappears, listed or not (`xds.resume`)."""

from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path

import grpc
import pytest

from controlplane.server import ControlPlane
from tests.ads import (
    TIMEOUT,
    AdsServer,
    Running,
    address_resource,
    addresses,
    ads_fixture,  # noqa: F401 (a fixture)
    clients_fixture,  # noqa: F401 (a fixture)
    initial_pair,
    is_ack,
    policies,
    policy_resource,
    run_client,
    workload,
)
from tests.waiting import eventually_async
from xds.channel import node_from
from xds.convert import ADDRESS_TYPE_URL, AUTHORIZATION_TYPE_URL
from xds.grpc.wire import StatusCode
from xds.resume import MAX_REQUEST_BYTES, initial_request, refused_limit, stale, version_entry_bytes

NODE = node_from(pod_name="ztunnel", pod_namespace="istio-system")
UIDS = [f"c//v1/Pod/ns/w{i}" for i in range(6)]
HELD = {uid: f"v{i}" for i, uid in enumerate(UIDS)}
CUT_LINE = "initial request cut to the message limit"
# The control plane's line for a reconnect it took that listed what the proxy held.
KEPT = re.compile(r"subscribed to Address: sending \d+ resource\(s\), 0 removal\(s\), [1-9]\d* unchanged")


def limit_for(count: int, *, on_demand: bool = False) -> int:
    """A limit that lets exactly the first `count` of HELD into an Address request."""
    base = initial_request(NODE, ADDRESS_TYPE_URL, {}, on_demand=on_demand).request.ByteSize()
    return base + sum(version_entry_bytes(uid, HELD[uid]) for uid in UIDS[:count])


def test_the_request_lists_the_first_resources_that_fit_and_no_more() -> None:
    versions = {f"name-{i}-{'é' * (i % 7)}": "x" * (i % 300) for i in range(2_000)}
    for limit in (0, 200, 4_096, 65_536, 300_000, MAX_REQUEST_BYTES):
        opening = initial_request(NODE, ADDRESS_TYPE_URL, versions, limit=limit)
        listed = dict(opening.request.initial_resource_versions)
        size = len(opening.request.SerializeToString())
        names = list(versions)
        assert set(listed) == set(names[: len(listed)]), "the first ones, in the order they arrived"
        assert opening.unlisted == frozenset(names[len(listed) :])
        assert opening.held == len(versions)
        if listed:
            assert size <= limit
        if opening.cut:
            following = names[len(listed)]
            assert size + version_entry_bytes(following, versions[following]) > limit
    assert not initial_request(NODE, ADDRESS_TYPE_URL, versions).cut  # 2,000 fit in 4 MiB
    on_demand = initial_request(NODE, ADDRESS_TYPE_URL, versions, on_demand=True, limit=4_096).request
    assert list(on_demand.resource_names_subscribe) == ["*"] == list(on_demand.resource_names_unsubscribe)
    assert len(on_demand.SerializeToString()) <= 4_096


def test_stale_is_what_was_left_out_and_neither_sent_nor_removed() -> None:
    response = addresses(
        "n", address_resource("b", workload("b")), address_resource("x", workload("x")), removed=("c", "y")
    )
    assert sorted(stale({"a", "b", "c", "d"}, response)) == ["a", "d"]
    assert stale(set(), response) == []


async def test_a_reconnect_over_the_limit_lists_what_fits_and_the_rest_comes_again(
    ads: AdsServer, clients: list[Running], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="xds.client")
    limit = limit_for(3)
    running = await run_client(ads.address, node=NODE, request_limit=limit)
    clients.append(running)
    stream = await ads.ads.next_stream()
    await initial_pair(stream)
    await stream.exchange(
        addresses(
            "n1",
            *(
                address_resource(u, workload(u, f"10.0.0.{i + 1}"), version=HELD[u])
                for i, u in enumerate(UIDS)
            ),
        )
    )
    await stream.exchange(policies("n2", policy_resource("p1", version="v9")))
    assert CUT_LINE not in caplog.text

    stream.end(grpc.StatusCode.UNAVAILABLE, "transport is closing")
    again = await ads.ads.next_stream()
    first, second = await initial_pair(again)
    assert len(first.SerializeToString()) == limit  # exactly what fits
    assert dict(first.initial_resource_versions) == {u: HELD[u] for u in UIDS[:3]}
    assert dict(second.initial_resource_versions) == {"ns/p1": "v9"}  # under the limit: whole
    [cut] = [r for r in caplog.records if r.getMessage().startswith(CUT_LINE)]
    assert cut.fields == {  # type: ignore[attr-defined]
        "type_url": ADDRESS_TYPE_URL,
        "resources": 3,
        "held": 6,
        "limit": limit,
    }

    # While the proxy was away: w1 (listed) and w4 (left out) were deleted, w5 (left out) changed.
    # The server removes what it was told of and sends everything else the proxy did not list.
    reply = await again.exchange(
        addresses(
            "n3",
            address_resource(UIDS[3], workload(UIDS[3], "10.0.0.4"), version=HELD[UIDS[3]]),
            address_resource(UIDS[5], workload(UIDS[5], "10.0.1.6"), version="v5b"),
            removed=(UIDS[1],),
        )
    )
    assert is_ack(reply, ADDRESS_TYPE_URL, "n3")
    held = {u for u in UIDS if running.state.workload_by_uid(u) is not None}
    assert held == {UIDS[0], UIDS[2], UIDS[3], UIDS[5]}
    assert running.client.resource_versions(ADDRESS_TYPE_URL) == {
        UIDS[0]: "v0",
        UIDS[2]: "v2",
        UIDS[3]: "v3",
        UIDS[5]: "v5b",
    }
    assert any("no longer has" in r.getMessage() for r in caplog.records)

    # Only that first answer says what is gone: a later push removes only what it names.
    await again.exchange(addresses("n4", address_resource("c//v1/Pod/ns/new", workload("c//v1/Pod/ns/new"))))
    assert {u for u in UIDS if running.state.workload_by_uid(u) is not None} == held
    assert running.state.workload_by_uid("c//v1/Pod/ns/new") is not None


async def test_a_reconnect_within_the_limit_lists_everything_and_a_short_answer_removes_nothing(
    ads: AdsServer, clients: list[Running], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="xds.client")
    running = await run_client(ads.address, node=NODE, request_limit=limit_for(6))
    clients.append(running)
    stream = await ads.ads.next_stream()
    await initial_pair(stream)
    await stream.exchange(addresses("n1", *(address_resource(u, workload(u), version=HELD[u]) for u in UIDS)))
    await stream.exchange(policies("n2"))
    stream.end(grpc.StatusCode.UNAVAILABLE, "transport is closing")
    again = await ads.ads.next_stream()
    first, _ = await initial_pair(again)
    assert dict(first.initial_resource_versions) == HELD
    await again.exchange(addresses("n3"))  # nothing changed
    assert all(running.state.workload_by_uid(u) is not None for u in UIDS)
    assert CUT_LINE not in caplog.text


async def test_on_demand_forgets_at_once_what_the_request_left_out(
    ads: AdsServer, clients: list[Running]
) -> None:
    running = await run_client(
        ads.address, node=NODE, on_demand=True, request_limit=limit_for(2, on_demand=True)
    )
    clients.append(running)
    stream = await ads.ads.next_stream()
    await initial_pair(stream)
    await stream.exchange(policies("n1"))
    for i, uid in enumerate(UIDS[:4]):
        waiter = asyncio.create_task(running.client.demand(uid))
        await stream.request()  # the subscription
        await stream.exchange(addresses(f"d{i}", address_resource(uid, workload(uid), version=HELD[uid])))
        async with asyncio.timeout(TIMEOUT):
            assert await waiter
    assert all(running.state.workload_by_uid(u) is not None for u in UIDS[:4])

    stream.end(grpc.StatusCode.UNAVAILABLE, "transport is closing")
    again = await ads.ads.next_stream()
    first, second = await initial_pair(again)
    assert dict(first.initial_resource_versions) == {u: HELD[u] for u in UIDS[:2]}
    assert list(first.resource_names_subscribe) == ["*"]
    # No longer subscribed, so no longer kept up to date: gone from the store (asked again on a miss).
    assert [u for u in UIDS[:4] if running.state.workload_by_uid(u) is not None] == UIDS[:2]
    assert set(running.client.resource_versions(ADDRESS_TYPE_URL)) == set(UIDS[:2])
    assert second.type_url == AUTHORIZATION_TYPE_URL


def test_the_cut_request_is_one_a_4_mib_server_accepts() -> None:
    """istiod's default: 4 MiB. The client's default limit is the same, never more."""
    versions = {f"Kubernetes//Pod/ns{i // 100}/w{i}": "0123456789abcdef" for i in range(100_000)}
    opening = initial_request(NODE, ADDRESS_TYPE_URL, versions)
    assert opening.cut
    assert len(opening.request.SerializeToString()) <= 4 * 1024 * 1024


def test_a_refusal_names_the_control_planes_limit() -> None:
    exhausted = StatusCode.RESOURCE_EXHAUSTED
    assert refused_limit(exhausted, "grpc: received message larger than max (5564923 vs. 4194304)") == 4194304
    assert refused_limit(exhausted, "SERVER: Received message larger than max (9000 vs. 4096)") == 4096
    assert refused_limit(exhausted, "too many requests") is None
    assert refused_limit(StatusCode.INTERNAL, "received message larger than max (2 vs. 1)") is None


async def test_a_control_plane_that_takes_less_is_asked_within_its_limit(
    tmp_path: Path, clients: list[Running], caplog: pytest.LogCaptureFixture
) -> None:
    """The development control plane taking 4 KiB: the proxy's reconnect listing 200 workloads is
    refused, and the next one, cut to what it said, is taken; nothing is lost on the way."""
    caplog.set_level(logging.INFO)
    mesh = tmp_path / "mesh.yaml"
    mesh.write_text(
        "workloads:\n"
        + "".join(
            f"  - {{uid: 'c//v1/Pod/ns/w{i}', name: w{i}, namespace: ns, workloadIps: ['10.0.{i // 200}.{i % 200 + 1}']}}\n"
            for i in range(200)
        )
    )
    cp = ControlPlane(mesh, listen="127.0.0.1:0", ca_dir=tmp_path / "ca", max_recv_msg_size=4096)
    await cp.start()
    try:
        running = await run_client(cp.address, node=NODE)
        clients.append(running)
        async with asyncio.timeout(TIMEOUT):
            await running.client.wait_synced()
        uids = [f"c//v1/Pod/ns/w{i}" for i in range(200)]
        assert len(running.client.initial_requests()[0].SerializeToString()) > 4096

        assert cp.ads is not None
        cp.ads.close()  # ends the stream: the proxy reconnects, listing its 200 workloads
        await eventually_async(
            lambda: any(r.getMessage().startswith("the control plane refused") for r in caplog.records),
            "the refusal heeded",
        )
        await eventually_async(
            lambda: any(KEPT.search(r.getMessage()) for r in caplog.records), "a cut reconnect taken"
        )
        assert len(running.client.initial_requests()[0].SerializeToString()) <= 4096
        assert any(r.getMessage().startswith(CUT_LINE) for r in caplog.records)
        await eventually_async(
            lambda: any("no longer has" in r.getMessage() for r in caplog.records), "the answer applied"
        )
        assert set(running.client.resource_versions(ADDRESS_TYPE_URL)) == set(uids)
        assert all(running.state.workload_by_uid(u) is not None for u in uids)
    finally:
        await cp.stop(grace=0)
