"""The store a worker reads (the parent's image in shared memory, and the policies as changes) answers
as the parent's, change after change: a local file, xDS-like upserts and removals, policies, a
service removed by name, a batch, and the whole store for a worker that starts late (the messages go
through pickle as on the socket pair, the image's memfd is mapped as a worker maps it)."""

from __future__ import annotations

import gc
import os
import pickle
from collections.abc import Sequence

import pytest

from mesh.localconfig import parse_local_config
from ztunnel.state.memfd import map_image, write_image
from ztunnel.state.replication import Replication, apply_changes
from ztunnel.state.shared import install, worker_state
from ztunnel.state.store import ProxyState, demand_arrived
from ztunnel.workers.messages import StateChanges, StateImageReady, ToWorker

FILE = """
workloads:
  - uid: c//v1/Pod/ns/a
    name: a
    namespace: ns
    serviceAccount: sa
    workloadIps: ["10.0.0.1"]
    services: {"ns/svc.ns.svc.cluster.local": {"80": 8080}}
  - uid: c//v1/Pod/ns/b
    name: b
    namespace: ns
    serviceAccount: sb
    workloadIps: ["10.0.0.2"]
services:
  - name: svc
    namespace: ns
    hostname: svc.ns.svc.cluster.local
    vips: ["/10.96.0.1"]
    ports: {"80": 8080}
policies:
  - name: deny-b
    namespace: ns
    scope: Namespace
    action: Deny
    dryRun: false
    rules:
      - - - principals: [!Exact "cluster.local/ns/ns/sa/sb"]
"""


class Worker:
    """A worker's store fed as on the socket pair: messages through pickle, an image's fd mapped."""

    def __init__(self) -> None:
        self.state, self.view = worker_state()
        self.images = 0

    def take(self, message: ToWorker, fds: Sequence[int]) -> None:
        message = pickle.loads(pickle.dumps(message))
        if isinstance(message, StateImageReady):
            dup = os.dup(fds[0])
            try:
                assert install(
                    self.state, self.view, map_image(dup, message.size), message.generation, message.base
                )
            finally:
                os.close(dup)
            self.images += 1
        else:
            assert isinstance(message, StateChanges) and not fds
            apply_changes(self.state, message)


def same(worker: ProxyState, parent: ProxyState) -> None:
    """The worker answers as the parent does (it holds no staged memberships: those are the parent's)."""
    ours, theirs = worker.dump(), parent.dump()
    assert ours["stagedServices"] == {}
    del ours["stagedServices"], theirs["stagedServices"]
    assert ours == theirs


def test_a_worker_store_follows_the_parent_change_by_change() -> None:
    sent: list[tuple[ToWorker, Sequence[int]]] = []
    parent = ProxyState()
    replication = Replication(parent, lambda message, fds: sent.append((message, list(fds))))
    worker = Worker()
    notified: list[int] = []
    worker.state.subscribe(lambda: notified.append(len(sent)))

    def replay() -> None:
        while sent:
            worker.take(*sent.pop(0))
        same(worker.state, parent)

    config = parse_local_config(FILE)
    parent.apply_local_config(config)
    assert [type(m) for m, _ in sent] == [StateChanges, StateImageReady]  # the policies, the image
    replay()
    assert len(worker.state.workloads()) == 2 and len(worker.state.policies()) == 1

    b = config.workloads[1]
    with parent.batch():  # one xDS response: one image (and the policies' change), one notification each
        parent.remove(b.uid)
        parent.upsert_workload(b)
    assert [type(m) for m, _ in sent] == [StateImageReady]
    before = len(notified)
    replay()
    assert len(notified) == before + 1
    parent.remove_policy(config.policies[0].key)
    assert [type(m) for m, _ in sent] == [StateChanges]  # policies alone: no new image
    replay()
    assert worker.state.policies() == []

    assert parent.remove("ns/svc.ns.svc.cluster.local")  # a service removed by its xDS name
    replay()
    assert worker.state.services() == [] and worker.state.endpoints("ns/svc.ns.svc.cluster.local") == []
    assert "ns/svc.ns.svc.cluster.local" in parent.dump()["stagedServices"]  # a's membership stays

    parent.upsert_policy(config.policies[0])
    late = Worker()  # a worker started now gets the whole store at once: policies, then the image
    for message, fds in replication.snapshot():
        late.take(message, fds)
    same(late.state, parent)
    replay()
    same(worker.state, late.state)
    replication.close()


def test_an_image_is_sealed_shared_memory_and_a_worker_refuses_another() -> None:
    fd, size = write_image(ProxyState().image())
    try:
        with pytest.raises(OSError):
            os.write(fd, b"x")  # sealed: no process changes what the workers read in place
        assert map_image(fd, size).workload_count() == 0
        with pytest.raises(ValueError, match="bytes, not"):
            map_image(fd, size + 8)
    finally:
        os.close(fd)
    unsealed = os.memfd_create("not-sealed")
    try:
        os.write(unsealed, b"".join(ProxyState().image()))
        with pytest.raises(ValueError, match="not sealed"):
            map_image(unsealed, size)
    finally:
        os.close(unsealed)


def test_the_parent_tells_when_an_on_demand_key_has_arrived() -> None:
    state = ProxyState()
    by_ip, by_vip = demand_arrived(state, "/10.0.0.2"), demand_arrived(state, "/10.96.0.1")
    by_name = demand_arrived(state, "ns/svc.ns.svc.cluster.local")
    assert not (by_ip() or by_vip() or by_name())
    state.apply_local_config(parse_local_config(FILE))
    assert by_ip() and by_vip() and by_name()
    assert not demand_arrived(state, "/10.0.0.9")()
    assert not demand_arrived(state, "other/10.0.0.2")()  # another network


def _images_held() -> int:
    """The state images this process holds open (memfds named `ztunnel-state`). Collected first:
    an earlier test's mapping (an mmap holds its own fd) left for the collector would otherwise be
    let go in the middle of the count."""
    gc.collect()
    held = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            held += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:ztunnel-state")
        except OSError:
            continue
    return held


def test_the_parent_holds_at_most_a_base_and_a_delta_and_a_smaller_mesh_a_smaller_image() -> None:
    before = _images_held()
    sizes: list[int] = []
    parent = ProxyState()
    replication = Replication(
        parent,
        lambda message, fds: sizes.append(message.size) if isinstance(message, StateImageReady) else None,
    )
    config = parse_local_config(FILE)
    parent.apply_local_config(config)
    for _ in range(3):
        parent.upsert_workload(config.workloads[0])
        assert _images_held() - before <= 2  # the previous images are let go as they are replaced
    parent.apply_local_config(parse_local_config("workloads: []\n"))  # the mesh shrinks: a new base
    assert sizes[-1] < sizes[0]
    replication.close()
    assert _images_held() == before


def test_a_worker_refuses_a_delta_over_a_base_it_does_not_hold() -> None:
    sent: list[tuple[ToWorker, Sequence[int]]] = []
    parent = ProxyState()
    replication = Replication(parent, lambda message, fds: sent.append((message, list(fds))))
    config = parse_local_config(FILE)
    parent.apply_local_config(config)
    parent.remove(config.workloads[1].uid)  # a delta over the first base
    images = [(m, fds) for m, fds in sent if isinstance(m, StateImageReady)]
    (base, base_fds), (delta, delta_fds) = images
    assert base.base is None and delta.base == base.generation
    worker, view = worker_state()  # say the base never reached it: the delta alone would mix two states
    assert not install(worker, view, map_image(delta_fds[0], delta.size), delta.generation, delta.base)
    assert worker.workloads() == [] and view.delta is None
    assert install(worker, view, map_image(base_fds[0], base.size), base.generation, base.base)
    assert install(worker, view, map_image(delta_fds[0], delta.size), delta.generation, delta.base)
    for message, _ in sent:
        if isinstance(message, StateChanges):
            apply_changes(worker, message)
    same(worker, parent)
    replication.close()
