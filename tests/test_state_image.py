"""The image the workers read answers every lookup as the parent's store does, at size.

A large mesh with the hard cases (addresses shared by a pod and a non-pod, an HBONE and a TCP
workload, host-network workloads, services sharing a VIP or a hostname across namespaces,
namespace-only visibility, CIDR VIPs, waypoints, staged memberships, hostnames) is built, changed at
random, and every lookup routing, admission and DNS make is asked of the store and of a worker's
a worker's store over the store's image; the basic ones are checked against a plain dictionary model
as well. Every field of the model survives the image's records.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import random

import pytest

from mesh.localconfig import LocalConfig
from mesh.model import (
    ApplicationTunnel,
    AppTunnelProtocol,
    CidrVip,
    Endpoint,
    GatewayAddress,
    HealthPolicy,
    IPFamilies,
    LoadBalancer,
    LoadBalancingMode,
    LoadBalancingScope,
    Locality,
    NamespacedHostname,
    NetworkAddress,
    NetworkMode,
    Service,
    TunnelProtocol,
    Visibility,
    WeightedWaypoint,
    Workload,
    WorkloadStatus,
)
from ztunnel.state import image as image_module
from ztunnel.state import replication
from ztunnel.state.image import ImageError, StateImage
from ztunnel.state.memfd import map_image
from ztunnel.state.records import service_of, service_record, workload_of, workload_record
from ztunnel.state.replication import Replication
from ztunnel.state.shared import install, worker_state
from ztunnel.state.store import ProxyState
from ztunnel.workers.messages import StateImageReady, ToWorker

FULL_WORKLOAD = Workload(
    uid="c//v1/Pod/ns/full",
    name="full",
    namespace="ns",
    addresses=(ipaddress.ip_address("10.1.2.3"), ipaddress.ip_address("fd00::3")),
    hostname="full.example",
    network="net1",
    tunnel_protocol=TunnelProtocol.HBONE,
    trust_domain="td.local",
    service_account="sa",
    waypoint=GatewayAddress(NetworkAddress("net1", ipaddress.ip_address("10.9.9.9")), 15009),
    network_gateway=GatewayAddress(NamespacedHostname("gw-ns", "gw.example"), 15010),
    node="node-1",
    canonical_name="app",
    canonical_revision="v2",
    workload_type="deployment",
    workload_name="app-deploy",
    native_tunnel=True,
    application_tunnel=ApplicationTunnel(AppTunnelProtocol.PROXY, 15088),
    services=(("ns/a.example", ((80, 8080), (443, 8443))), ("ns/b.example", ())),
    authorization_policies=("ns/p1", "ns/p2"),
    status=WorkloadStatus.UNHEALTHY,
    cluster_id="cluster-2",
    locality=Locality("region", "zone", "subzone"),
    network_mode=NetworkMode.HOST_NETWORK,
    capacity=7,
)

FULL_SERVICE = Service(
    name="a",
    namespace="ns",
    hostname="a.example",
    vips=(
        NetworkAddress("", ipaddress.ip_address("10.96.0.1")),
        NetworkAddress("n", ipaddress.ip_address("fd00::1")),
    ),
    cidr_vips=(CidrVip("", ipaddress.ip_network("10.200.0.0/16")),),
    ports=((80, 8080), (443, 0)),
    subject_alt_names=("spiffe://td/ns/ns/sa/x",),
    waypoint=GatewayAddress(NamespacedHostname("wp", "waypoint.wp"), 15008),
    weighted_waypoints=(
        WeightedWaypoint(GatewayAddress(NetworkAddress("", ipaddress.ip_address("10.8.8.8"))), 3),
    ),
    load_balancer=LoadBalancer(
        (LoadBalancingScope.REGION, LoadBalancingScope.NODE),
        LoadBalancingMode.FAILOVER,
        HealthPolicy.ALLOW_ALL,
    ),
    ip_families=IPFamilies.DUAL,
    canonical=True,
    visibility=Visibility.NAMESPACE,
    endpoints=(Endpoint("c//v1/Pod/ns/full", ((80, 8080),), WorkloadStatus.UNHEALTHY),),
    ingress_use_waypoint=True,
)


def test_every_field_of_the_model_survives_the_records() -> None:
    for value, record, back in (
        (FULL_WORKLOAD, workload_record, workload_of),
        (FULL_SERVICE, service_record, service_of),
        (Workload("c//v1/Pod/ns/bare"), workload_record, workload_of),
        (Service("bare", "ns", "bare.example"), service_record, service_of),
    ):
        assert back(record(value)) == value  # type: ignore[operator]
    # Every field differs from its default above, so a field the records forget fails the test.
    for full, cls in ((FULL_WORKLOAD, Workload), (FULL_SERVICE, Service)):
        for f in dataclasses.fields(cls):
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                continue  # required: every record has it
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            assert getattr(full, f.name) != default, f"{cls.__name__}.{f.name} is not exercised"


def _ip(i: int) -> ipaddress.IPv4Address:
    return ipaddress.IPv4Address(0x0A000000 + i)


def _mesh(rng: random.Random, n: int) -> tuple[list[Workload], list[Service]]:
    namespaces = [f"ns{i}" for i in range(max(2, n // 200))]
    services = []
    for j in range(n // 8):
        ns = rng.choice(namespaces)
        vip = NetworkAddress(
            rng.choice(["", "net1"]), ipaddress.IPv4Address(0x0B000000 + rng.randrange(n // 10))
        )
        services.append(
            Service(
                name=f"s{j}",
                namespace=ns,
                hostname=f"h{rng.randrange(n // 12)}.example",  # hostnames shared across namespaces
                vips=(vip,),
                cidr_vips=(CidrVip("", ipaddress.ip_network(f"10.{200 + j % 3}.{j % 250}.0/24")),)
                if j % 97 == 0
                else (),
                ports=((80, 8080),),
                canonical=rng.random() < 0.3,
                visibility=Visibility.NAMESPACE if rng.random() < 0.2 else Visibility.PUBLIC,
                load_balancer=LoadBalancer(health_policy=HealthPolicy.ALLOW_ALL) if j % 5 == 0 else None,
                endpoints=(Endpoint(f"extra{j}", ((80, 9090),)),) if j % 11 == 0 else (),
            )
        )
    keys = [s.key for s in services] + [f"ns0/staged{k}.example" for k in range(5)]  # staged: no service
    workloads = []
    for i in range(n):
        ns = rng.choice(namespaces)
        members = tuple((k, ((80, 8000 + i % 7),)) for k in rng.sample(keys, rng.randrange(0, 3)))
        workloads.append(
            Workload(
                uid=f"c//v1/{'Pod' if rng.random() < 0.7 else 'WorkloadEntry'}/{ns}/w{i}",
                name=f"w{i % (n // 3)}",  # names repeat across namespaces
                namespace=ns,
                addresses=(_ip(rng.randrange(n // 2)),),  # addresses shared by two on average
                hostname=f"wh{i % 50}.example" if i % 13 == 0 else "",
                network=rng.choice(["", "", "net1"]),
                tunnel_protocol=rng.choice(list(TunnelProtocol)[:2]),
                service_account=f"sa{i % 5}",
                workload_name=f"app{i % 40}" if i % 3 == 0 else "",
                node=f"node{i % 4}",
                services=members,
                status=WorkloadStatus.UNHEALTHY if rng.random() < 0.1 else WorkloadStatus.HEALTHY,
                network_mode=NetworkMode.HOST_NETWORK if rng.random() < 0.03 else NetworkMode.STANDARD,
                waypoint=GatewayAddress(NamespacedHostname(ns, "wp.example")) if i % 17 == 0 else None,
            )
        )
    return workloads, services


def _image_of(state: ProxyState) -> ProxyState:
    shared, view = worker_state()
    install(shared, view, StateImage(b"".join(state.image())))
    return shared


def _same_answers(
    parent: ProxyState, worker: ProxyState, probes: list[NetworkAddress], rng: random.Random
) -> None:
    for addr in probes:
        assert worker.workload_by_addr(addr.network, addr.address) == parent.workload_by_addr(
            addr.network, addr.address
        )
        assert worker.services_by_vip(addr.network, addr.address) == parent.services_by_vip(
            addr.network, addr.address
        )
        ns = rng.choice(["ns0", "ns1", None])
        assert worker.service_for_vip(addr.network, addr.address, ns) == parent.service_for_vip(
            addr.network, addr.address, ns
        )
    for w in parent.workloads():
        assert worker.workload_by_uid(w.uid) == w
        assert worker.services_of_workload(w) == parent.services_of_workload(w)
        if w.hostname:
            assert worker.workload_by_hostname(w.namespace, w.hostname) == parent.workload_by_hostname(
                w.namespace, w.hostname
            )
        for node in (None, "node1"):
            assert worker.find_local_workload(w.name, w.namespace, w.service_account, node) == (
                parent.find_local_workload(w.name, w.namespace, w.service_account, node)
            )
    # A headless service's pods by name (the DNS proxy's per-pod names), in any namespace.
    for name in {w.name for w in rng.sample(parent.workloads(), min(50, len(parent.workloads())))} | {"nope"}:
        assert {w.uid: w for w in worker.workloads_by_name(name)} == {
            w.uid: w for w in parent.workloads_by_name(name)
        }
    for s in parent.services():
        assert worker.service_by_key(s.key) == s
        assert worker.endpoints(s.key) == parent.endpoints(s.key)
        for ns in (s.namespace, "ns1", None):
            assert worker.service_by_hostname(s.hostname, ns, "ns0") == parent.service_by_hostname(
                s.hostname, ns, "ns0"
            )
    # (Those changed since the base image come last from a worker: the listing's order is the parent's.)
    assert {w.uid: w for w in worker.workloads()} == {w.uid: w for w in parent.workloads()}
    assert {s.key: s for s in worker.services()} == {s.key: s for s in parent.services()}
    assert len(worker.workloads()) == len(parent.workloads()) and len(worker.services()) == len(
        parent.services()
    )
    named = {(w.namespace, w.workload_name or w.name) for w in rng.sample(parent.workloads(), 50)}
    named |= {("ns0", "app-gone"), ("nope", "w1")}
    assert (
        worker.series_names_present(named)
        == parent.series_names_present(named)
        == named
        - {
            ("ns0", "app-gone"),
            ("nope", "w1"),
        }
    )
    assert worker.workload_by_uid("nope") is None and worker.service_by_key("ns/nope") is None


def test_a_large_mesh_answers_the_same_from_the_image_as_from_the_store() -> None:
    rng = random.Random(36)
    workloads, services = _mesh(rng, 6000)
    parent = ProxyState()
    with parent.batch():
        for w in workloads:
            parent.upsert_workload(w)
        for s in services:
            parent.upsert_service(s)
    probes = [NetworkAddress(net, _ip(i)) for i in range(0, 3000, 3) for net in ("", "net1")]
    probes += [
        NetworkAddress(net, ipaddress.IPv4Address(0x0B000000 + i)) for i in range(600) for net in ("", "net1")
    ]
    probes += [NetworkAddress("", ipaddress.ip_address(f"10.{200 + k}.{k}.9")) for k in range(3)]  # CIDR VIPs
    _same_answers(parent, _image_of(parent), probes, rng)

    # Then churn, as pushes would: updates that move addresses and memberships, removals, services gone.
    with parent.batch():
        for w in rng.sample(workloads, 600):
            parent.upsert_workload(dataclasses.replace(w, addresses=(_ip(rng.randrange(3000)),), services=()))
        for w in rng.sample(workloads, 400):
            parent.remove(w.uid)
        for s in rng.sample(services, 100):
            parent.remove_service(s.key)
    _same_answers(parent, _image_of(parent), probes, rng)

    # And a plain dictionary model of the basic lookups.
    by_uid = {w.uid: w for w in parent.workloads()}
    by_addr: dict[tuple[str, object], list[Workload]] = {}
    for w in parent.workloads():
        if w.network_mode is not NetworkMode.HOST_NETWORK:
            for ip in w.addresses:
                by_addr.setdefault((w.network, ip), []).append(w)
    worker = _image_of(parent)
    for uid, w in by_uid.items():
        assert worker.workload_by_uid(uid) == w
    for (net, ip), found in by_addr.items():
        assert {w.uid for w in worker.tables.workloads_at(net, ip)} == {w.uid for w in found}  # type: ignore[arg-type]
    assert worker.workload_by_addr("", _ip(10**6)) is None


def test_pushes_reach_a_worker_as_delta_images_over_a_base_and_a_new_base_now_and_then(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(replication, "DELTA_MIN", 150)  # a new base after about four pushes
    rng = random.Random(7)
    workloads, services = _mesh(rng, 3000)
    sent: list[tuple[ToWorker, list[int]]] = []
    parent = ProxyState()
    publisher = Replication(parent, lambda message, fds: sent.append((message, [os.dup(fd) for fd in fds])))
    worker, view = worker_state()

    def deliver() -> list[bool]:
        kinds = []
        for message, fds in sent:
            if isinstance(message, StateImageReady):
                assert install(
                    worker, view, map_image(fds[0], message.size), message.generation, message.base
                )
                kinds.append(message.delta)
            for fd in fds:
                os.close(fd)
        sent.clear()
        return kinds

    with parent.batch():
        for s in services:
            parent.upsert_service(s)
        for w in workloads:
            parent.upsert_workload(w)
    assert deliver() == [False]  # the first state: a base image
    probes = [NetworkAddress(net, _ip(i)) for i in range(0, 1500, 5) for net in ("", "net1")]
    probes += [
        NetworkAddress(net, ipaddress.IPv4Address(0x0B000000 + i)) for i in range(300) for net in ("", "net1")
    ]
    kinds: list[bool] = []
    for round in range(8):  # pushes of 1 %: workloads moved, removed, back; services changed or gone
        with parent.batch():
            for w in rng.sample(workloads, 30):
                moved = dataclasses.replace(
                    w, addresses=(_ip(rng.randrange(1500)),), canonical_revision=f"r{round}"
                )
                parent.upsert_workload(moved)
            for w in rng.sample(workloads, 5):
                parent.remove(w.uid)
            for s in rng.sample(services, 3):
                if rng.random() < 0.5:
                    parent.remove_service(s.key)
                else:
                    parent.upsert_service(
                        dataclasses.replace(s, vips=(NetworkAddress("", _ip(rng.randrange(1500))),))
                    )
        kinds += deliver()
        _same_answers(parent, worker, probes, rng)
    assert kinds[:3] == [True, True, True]  # deltas: only what changed is encoded
    assert False in kinds  # past a sixteenth of the store changed: a new base, the delta let go
    parent.apply_local_config(LocalConfig())  # the store replaced: a base at once
    assert deliver() == [False] and worker.workloads() == [] and view.delta is None
    publisher.close()


def test_the_decoded_records_kept_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(image_module, "CACHE_KEPT", 50)
    parent = ProxyState()
    with parent.batch():
        for i in range(400):
            parent.upsert_workload(
                Workload(f"c//v1/Pod/ns/w{i}", name=f"w{i}", namespace="ns", addresses=(_ip(i),))
            )
    worker, view = worker_state()
    install(worker, view, StateImage(b"".join(parent.image())))
    for i in range(400):
        assert worker.workload_by_uid(f"c//v1/Pod/ns/w{i}") is not None
        assert view.shared.cached() <= 50


def test_bytes_that_are_not_an_image_are_refused() -> None:
    good = b"".join(ProxyState().image())
    for bad in (b"", b"junk" * 10, b"ZTIMAGE0" + good[8:], good[: len(good) // 2]):
        with pytest.raises(ImageError):
            StateImage(bad)
