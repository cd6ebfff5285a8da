"""Keys forged to share a crc32 never move an answer: the parent's store and every worker (the real
a worker's store over the real image bytes, mapped from the parent's sealed memfds) give the same
answer to every lookup, push after push, with VIPs, addresses, uids, hostnames, service keys and pod
names forged to collide with the keys of the mesh (the forge is four bytes: crc32 is affine, so four
chosen bytes reach any value). And a key with a crowd of forged neighbours costs its lookups no
decode of theirs. Then once through `ztunnel proxy`: a forged VIP does not move 10.0.0.1 in its
workers."""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import random
import zlib
from pathlib import Path

import pytest

from mesh.model import (
    Endpoint,
    IPAddress,
    NetworkAddress,
    Service,
    TunnelProtocol,
    Visibility,
    Workload,
)
from tests.apps import echo_server, exchange, loopback_net, socks5_reply
from tests.crcforge import forge, forged_texts, forged_v6
from tests.harness import Fleet, proxy_env
from tests.waiting import eventually
from tests.xds_mesh import opened_per_worker
from ztunnel.state import replication
from ztunnel.state.image import StateImage, addr_key, pair_key
from ztunnel.state.memfd import map_image
from ztunnel.state.replication import Replication
from ztunnel.state.shared import install, worker_state
from ztunnel.state.store import ProxyState
from ztunnel.workers.messages import StateImageReady, ToWorker


def test_the_forge_makes_any_crc32() -> None:
    rng = random.Random(1)
    for _ in range(50):
        prefix, suffix = rng.randbytes(rng.randrange(20)), rng.randbytes(rng.randrange(20))
        target = rng.getrandbits(32)
        assert zlib.crc32(prefix + forge(prefix, suffix, target) + suffix) == target


# -- the mesh and its pushes ------------------------------------------------------------------------

V = ipaddress.ip_address("10.0.0.1")


def _ip(i: int) -> IPAddress:
    return ipaddress.ip_address(0x0A010000 + i)


class Scene:
    """A mesh with forged keys and the pushes that move them, replayed into the parent's store."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.workloads: dict[str, Workload] = {}
        self.services: dict[str, Service] = {}
        self.vips = [NetworkAddress("", V)] + [
            NetworkAddress("", forged_v6("", addr_key("", V), n)) for n in range(4)
        ]
        self.addrs = [NetworkAddress(net, _ip(i)) for i in range(40) for net in ("", "net1")]
        popular = self.addrs[0]
        self.addrs += [
            NetworkAddress("", forged_v6("", addr_key(popular.network, popular.address), n)) for n in range(4)
        ]
        uid0 = "c//v1/Pod/ns0/web-0"
        self.uids = [uid0] + [f"c//v1/Pod/ns{i % 3}/w{i}" for i in range(1, 60)]
        self.uids += list(forged_texts("c//v1/Pod/evil/x", str.encode, uid0.encode(), 4))
        self.names = ["web-0"] + [f"w{i}" for i in range(1, 12)]
        self.names += list(forged_texts("p", str.encode, b"web-0", 4))
        self.names += list(forged_texts("q", lambda t: pair_key("ns0", t), pair_key("ns0", "web-0"), 3))
        self.hosts = ["wh.example"]
        self.hosts += forged_texts("h", lambda t: pair_key("ns0", t), pair_key("ns0", "wh.example"), 3)
        svc0 = "ns0/web.ns0.svc.cluster.local"
        self.svchosts = ["web.ns0.svc.cluster.local", "db.ns1.svc.cluster.local", "shared.example"]
        self.svchosts += list(forged_texts("s", str.encode, self.svchosts[0].encode(), 3))  # by hostname
        self.svchosts += list(forged_texts("k", lambda t: f"ns0/{t}".encode(), svc0.encode(), 3))  # by key
        self.namespaces = ["ns0", "ns1", "evil"]

    def workload(self, uid: str) -> Workload:
        rng = self.rng
        ns = uid.split("/")[3]
        keys = [f"{n}/{h}" for h in self.svchosts for n in self.namespaces]
        return Workload(
            uid=uid,
            name=rng.choice(self.names),
            namespace=ns,
            addresses=tuple(a.address for a in rng.sample(self.addrs, rng.choice((1, 1, 2)))),
            network=rng.choice(("", "", "net1")),
            hostname=rng.choice(self.hosts) if rng.random() < 0.3 else "",
            tunnel_protocol=rng.choice((TunnelProtocol.NONE, TunnelProtocol.HBONE)),
            service_account=f"sa{rng.randrange(2)}",
            workload_name=rng.choice(("", "app", "web-0")),
            services=tuple((k, ((80, 8080),)) for k in rng.sample(keys, rng.randrange(3))),
        )

    def service(self, ns: str, hostname: str) -> Service:
        rng = self.rng
        return Service(
            name=hostname.split(".")[0],
            namespace=ns,
            hostname=hostname,
            vips=tuple(rng.sample(self.vips, rng.randrange(1, 3))),
            canonical=rng.random() < 0.2,
            visibility=Visibility.NAMESPACE if rng.random() < 0.2 else Visibility.PUBLIC,
            endpoints=(Endpoint(rng.choice(self.uids), ((80, 9090),)),) if rng.random() < 0.2 else (),
        )

    def push(self, state: ProxyState) -> None:
        """One xDS-like response: workloads and services added, moved, removed."""
        rng = self.rng
        with state.batch():
            for _ in range(rng.randrange(1, 12)):
                roll = rng.random()
                if roll < 0.5:
                    state.upsert_workload(self.workload(rng.choice(self.uids)))
                elif roll < 0.65:
                    state.remove(rng.choice(self.uids))
                elif roll < 0.9:
                    state.upsert_service(self.service(rng.choice(self.namespaces), rng.choice(self.svchosts)))
                else:
                    state.remove_service(f"{rng.choice(self.namespaces)}/{rng.choice(self.svchosts)}")


def hijack(state: ProxyState, vips: list[NetworkAddress]) -> tuple[Service, Service]:
    """The issue's case: B holds a forged VIP sharing 10.0.0.1's crc32, A claims 10.0.0.1, then B
    claims it too. A was first: the parent answers A."""
    b = Service("b", "evil", "b.example", vips=(vips[1],))
    a = Service("a", "ns0", "a.example", vips=(vips[0],))
    state.upsert_service(b)
    state.upsert_service(a)
    b = dataclasses.replace(b, vips=(vips[1], vips[0]))
    state.upsert_service(b)
    return a, b


class Worker:
    """A worker's view: images mapped from the parent's memfds as a worker maps them."""

    def __init__(self) -> None:
        self.state, self.view = worker_state()

    def take(self, message: ToWorker, fds: list[int]) -> None:
        if isinstance(message, StateImageReady):
            assert install(
                self.state, self.view, map_image(fds[0], message.size), message.generation, message.base
            )


def same_answers(scene: Scene, parent: ProxyState, worker: ProxyState) -> int:
    """Every lookup of every key the scene uses, asked of both; how many were asked."""
    asked = 0

    def check(question: str, ours: object, theirs: object) -> None:
        nonlocal asked
        asked += 1
        assert ours == theirs, question

    clients = [None, *scene.namespaces]
    for addr in [*scene.vips, *scene.addrs]:
        net, ip = addr.network, addr.address
        for n in {net, "", "net1"}:
            check(
                f"workloads at {n}/{ip}", worker.tables.workloads_at(n, ip), parent.tables.workloads_at(n, ip)
            )
            check(f"workload at {n}/{ip}", worker.workload_by_addr(n, ip), parent.workload_by_addr(n, ip))
            check(f"services at {n}/{ip}", worker.services_by_vip(n, ip), parent.services_by_vip(n, ip))
            for client in clients:
                check(
                    f"service for {n}/{ip} from {client}",
                    worker.service_for_vip(n, ip, client),
                    parent.service_for_vip(n, ip, client),
                )
    for uid in scene.uids:
        check(f"workload {uid}", worker.workload_by_uid(uid), parent.workload_by_uid(uid))
    for name in scene.names:
        check(f"pods named {name}", worker.workloads_by_name(name), parent.workloads_by_name(name))
        for ns in scene.namespaces:
            for sa in ("sa0", "sa1"):
                check(
                    f"local workload {ns}/{name}",
                    worker.find_local_workload(name, ns, sa, None),
                    parent.find_local_workload(name, ns, sa, None),
                )
    for ns in scene.namespaces:
        for host in scene.hosts:
            check(
                f"workload by hostname {ns}/{host}",
                worker.workload_by_hostname(ns, host),
                parent.workload_by_hostname(ns, host),
            )
        series = {(ns, name) for name in [*scene.names, "app"]}
        check(f"series of {ns}", worker.series_names_present(series), parent.series_names_present(series))
    for host in [*scene.svchosts, "a.example", "b.example"]:
        for client in clients:
            check(
                f"service {host} from {client}",
                worker.service_by_hostname(host, client),
                parent.service_by_hostname(host, client),
            )
        for ns in scene.namespaces:
            key = f"{ns}/{host}"
            check(f"service {key}", worker.service_by_key(key), parent.service_by_key(key))
            check(f"endpoints of {key}", worker.endpoints(key), parent.endpoints(key))
    check("every workload", sorted(worker.workloads(), key=str), sorted(parent.workloads(), key=str))
    check("every service", sorted(worker.services(), key=str), sorted(parent.services(), key=str))
    return asked


def test_forged_collisions_give_every_worker_the_parents_answers_push_after_push(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(replication, "DELTA_MIN", 40)  # bases now and then, deltas between
    rng = random.Random(42)
    scene = Scene(rng)
    first = Worker()
    workers = [first]
    sent: list[tuple[ToWorker, list[int]]] = []
    parent = ProxyState()
    publisher = Replication(parent, lambda message, fds: sent.append((message, [os.dup(fd) for fd in fds])))

    def deliver() -> None:
        for message, fds in sent:
            for worker in workers:
                worker.take(message, fds)
            for fd in fds:
                os.close(fd)
        sent.clear()

    with parent.batch():  # the first state, a base image
        for uid in scene.uids[::2]:
            parent.upsert_workload(scene.workload(uid))
        a, _ = hijack(parent, scene.vips)
    deliver()
    assert parent.service_for_vip("", V, None) == a
    assert first.state.service_for_vip("", V, None) == a  # was b: the forged VIP came first
    asked = same_answers(scene, parent, first.state)

    kinds = set()
    for round in range(60):
        scene.push(parent)
        kinds.update(m.delta for m, _ in sent if isinstance(m, StateImageReady))
        deliver()
        if round == 20:  # a worker that starts late: the parent's base and delta at once
            late = Worker()
            for message, fds in publisher.snapshot():
                late.take(message, list(fds))
            workers.append(late)
        for worker in workers:
            asked += same_answers(scene, parent, worker.state)
    assert kinds == {True, False}  # deltas over bases, and new bases
    assert asked > 100_000
    publisher.close()


def test_a_crowd_of_forged_keys_costs_a_lookup_no_decode_of_theirs() -> None:
    parent = ProxyState()
    web0 = Workload("c//v1/Pod/ns0/web-0", name="web-0", namespace="ns0", addresses=(V,))
    with parent.batch():
        parent.upsert_workload(web0)
        for n, name in enumerate(forged_texts("crowd", str.encode, b"web-0", 300)):
            parent.upsert_workload(
                Workload(f"c//v1/Pod/evil/{name}", name=name, namespace="evil", addresses=(_ip(n),))
            )
        for n in range(300):
            ip = forged_v6("", addr_key("", V), n)
            parent.upsert_workload(
                Workload(f"c//v1/Pod/evil/v{n}", name=f"v{n}", namespace="evil", addresses=(ip,))
            )
    image = StateImage(b"".join(parent.image()))
    assert image.workloads_of_pod_name("web-0") == [web0]
    assert image.cached() == 1  # web-0's record alone was decoded
    assert image.workloads_at("", V) == [web0] and image.cached() == 1
    assert image.workload_by_uid("c//v1/Pod/evil/v7") is not None and image.cached() == 2
    assert image.workloads_of_pod_name("web-1") == [] and image.cached() == 2


# -- through a proxy --------------------------------------------------------------------------------


def _e2e_mesh(net: str, vip_b: tuple[str, ...], with_a: bool, revision: int) -> str:
    """The client, the app A's VIP goes to (an echo server), B's endpoint (nothing listens there),
    and 600 filler workloads whose revision a push changes (past a sixteenth: the next image is a
    new base, the store's order laid out afresh)."""
    out = [
        "workloads:",
        f"  - {{uid: x//v1/Pod/demo/client, name: client, namespace: demo, serviceAccount: client,"
        f" workloadIps: ['{net}.2'], protocol: HBONE}}",
        f"  - {{uid: x//v1/Pod/ns0/app, name: app, namespace: ns0, serviceAccount: app, workloadIps: ['{net}.3'],"
        f" protocol: TCP, services: {{'ns0/a.example': {{80: 8080}}}}}}",
        f"  - {{uid: x//v1/Pod/evil/b, name: b, namespace: evil, serviceAccount: b, workloadIps: ['{net}.4'],"
        f" protocol: TCP, services: {{'evil/b.example': {{80: 8080}}}}}}",
    ]
    out += [
        f"  - {{uid: x//v1/Pod/fill/f{i}, name: f{i}, namespace: fill, workloadIps: ['10.50.{i // 250}.{i % 250}'],"
        f" canonicalRevision: r{revision}}}"
        for i in range(600)
    ]
    out += [
        "services:",
        f"  - {{name: b, namespace: evil, hostname: b.example, vips: {list(vip_b)}, ports: {{80: 8080}}}}",
    ]
    if with_a:
        out.append(
            f"  - {{name: a, namespace: ns0, hostname: a.example, vips: ['/{V}'], ports: {{80: 8080}}}}"
        )
    return "\n".join(out) + "\n"


def test_a_forged_vip_does_not_move_10_0_0_1_in_a_proxys_workers(tmp_path: Path, fleet: Fleet) -> None:
    """Through `ztunnel proxy` (two workers) and the development control plane: B holds a VIP
    forged to share 10.0.0.1's crc32, A claims 10.0.0.1, then B claims it too in a push big enough
    to make a new base image. A was first: the parent says A, and every connection to 10.0.0.1
    through either worker reaches A's app (B's endpoint has nothing listening)."""
    net = loopback_net()
    forged = f"/{forged_v6('', addr_key('', V), 1)}"
    with echo_server(f"{net}.3", 8080):
        cp = fleet.control_plane(tmp_path / "cp", f"{net}.10", _e2e_mesh(net, (forged,), False, 1))
        (proxy,) = fleet.start_all(cp.wire(proxy_env(f"{net}.2", INSTANCE_IP=f"{net}.2")))

        def services() -> list[str]:
            return [f"{s['namespace']}/{s['name']}" for s in proxy.config_dump()["services"]]

        eventually(lambda: services() == ["evil/b"], "B first", timeout=60)
        cp.push(_e2e_mesh(net, (forged,), True, 1))
        eventually(lambda: services() == ["evil/b", "ns0/a"], "then A", timeout=60)
        cp.push(_e2e_mesh(net, (forged, f"/{V}"), True, 2))
        eventually(
            lambda: len(proxy.config_dump()["services"][0]["vips"]) == 2, "B claims 10.0.0.1 too", timeout=60
        )
        held = []
        try:
            for _ in range(8):  # spread over both workers
                s, code = socks5_reply(f"{net}.2", str(V), 80)
                held.append(s)
                assert code == 0, f"10.0.0.1 went to B in a worker (SOCKS5 reply {code})"
                assert exchange(s, b"to A") == b"to A"
        finally:
            for s in held:
                s.close()
        assert all(n > 0 for n in opened_per_worker(proxy).values()), "both workers answered"
