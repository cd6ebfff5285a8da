"""ZDS as transcripts: packets (and fds) in, replies and actions out. No sockets."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from xds import zds
from ztunnel.inpod.protocol import Outcome, PodInfo, StartProxy, StopProxy, ZdsStateMachine

ACK = zds.ack()


def nack_text(reply: bytes | None) -> str:
    assert reply is not None
    return zds.decode_response(reply).ack.error


def fd_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


class Fds:
    """Namespace-like fds for the tests: each `new(ns)` is a fresh fd naming file `ns`."""

    def __init__(self, tmp_path: os.PathLike[str]) -> None:
        self.dir = tmp_path
        self.opened: list[int] = []

    def new(self, ns: str = "a") -> int:
        path = os.path.join(self.dir, ns)
        if not os.path.exists(path):
            open(path, "w").close()
        fd = os.open(path, os.O_RDONLY)
        self.opened.append(fd)
        return fd

    def close_all(self) -> None:
        zds.close_fds([fd for fd in self.opened if fd_open(fd)])


@pytest.fixture
def fds(tmp_path: os.PathLike[str]) -> Iterator[Fds]:
    f = Fds(tmp_path)
    yield f
    f.close_all()


def add(sm: ZdsStateMachine, uid: str, fd: int, *, start: bool = True) -> list[object]:
    """Send an Add; if it asks to start, report success. Returns the actions."""
    step = sm.receive(zds.add(uid, f"pod-{uid}", "ns", "sa"), [fd])
    assert step.outcome is Outcome.OK
    if start:
        starts = [a for a in step.actions if isinstance(a, StartProxy)]
        assert step.reply is None and len(starts) == 1
        assert sm.started(uid, (os.fstat(fd).st_dev, os.fstat(fd).st_ino)) == ACK
    return list(step.actions)


def test_snapshot_add_then_snapshot_sent(fds: Fds) -> None:
    sm = ZdsStateMachine()
    fd = fds.new()
    step = sm.receive(zds.add("u1", "web", "default", "web-sa"), [fd])
    assert step.reply is None  # waits for the proxy to start
    st = os.fstat(fd)
    assert step.actions == [StartProxy(PodInfo("u1", "web", "default", "web-sa"), fd, (st.st_dev, st.st_ino))]
    assert not sm.ready
    assert sm.started("u1", (os.fstat(fd).st_dev, os.fstat(fd).st_ino)) == ACK
    assert not sm.ready  # the snapshot is not over
    step = sm.receive(zds.snapshot_sent(), [])
    assert (step.reply, step.actions, step.outcome) == (ACK, [], Outcome.OK)
    assert sm.ready


def test_failed_start_is_nacked_and_pending_holds_readiness(fds: Fds) -> None:
    sm = ZdsStateMachine()
    fd = fds.new()
    step = sm.receive(zds.add("u1", "web", "default", "sa"), [fd])
    pod = step.actions[0].pod  # type: ignore[union-attr]
    reply = sm.start_failed(pod, "Address already in use")
    assert nack_text(reply) == "failure to start proxy : Address already in use"
    sm.receive(zds.snapshot_sent(), [])
    assert not sm.ready and "u1" in sm.pending
    sm.started("u1", (1, 2))  # the retry worked
    assert sm.ready


def test_same_netns_again_is_a_no_op_and_closes_the_new_fd(fds: Fds) -> None:
    sm = ZdsStateMachine()
    add(sm, "u1", fds.new("a"))
    again = fds.new("a")
    step = sm.receive(zds.add("u1", "pod-u1", "ns", "sa"), [again])
    assert (step.reply, step.actions) == (ACK, [])
    assert not fd_open(again)


def test_other_netns_replaces_the_proxy(fds: Fds) -> None:
    sm = ZdsStateMachine()
    add(sm, "u1", fds.new("a"))
    other = fds.new("b")
    actions = add(sm, "u1", other)
    assert actions[0] == StopProxy("u1", deleted=False) and isinstance(actions[1], StartProxy)


def test_snapshot_sent_stops_proxies_not_named_in_this_connection(fds: Fds) -> None:
    sm = ZdsStateMachine()
    add(sm, "kept", fds.new("a"))
    add(sm, "gone", fds.new("b"))
    add(sm, "re-added", fds.new("c"))
    sm.receive(zds.snapshot_sent(), [])
    # The agent reconnects (or ztunnel did): a new snapshot.
    sm.connection_reset()
    assert sm.receive(zds.keep("kept"), []).reply == ACK
    step = sm.receive(zds.add("re-added", "pod-re-added", "ns", "sa"), [fds.new("c")])
    assert (step.reply, step.actions) == (ACK, [])  # same namespace: nothing to do
    step = sm.receive(zds.snapshot_sent(), [])
    assert step.actions == [StopProxy("gone", deleted=True)] and step.reply == ACK
    assert set(sm.running) == {"kept", "re-added"}


def test_delete_after_snapshot_stops_and_unknown_uid_is_acked(fds: Fds) -> None:
    sm = ZdsStateMachine()
    sm.receive(zds.snapshot_sent(), [])
    add(sm, "u1", fds.new())
    step = sm.receive(zds.delete("u1"), [])
    assert (step.actions, step.reply) == ([StopProxy("u1", deleted=True)], ACK)
    step = sm.receive(zds.delete("u1"), [])
    assert (step.actions, step.reply) == ([], ACK)


def test_delete_before_snapshot_only_forgets_the_name(fds: Fds) -> None:
    sm = ZdsStateMachine()
    add(sm, "u1", fds.new())
    step = sm.receive(zds.delete("u1"), [])
    assert (step.actions, step.reply) == ([], ACK)
    assert sm.receive(zds.snapshot_sent(), []).actions == [StopProxy("u1", deleted=True)]


def test_delete_of_a_pending_pod_drops_it(fds: Fds) -> None:
    sm = ZdsStateMachine()
    sm.receive(zds.snapshot_sent(), [])
    step = sm.receive(zds.add("u1", "p", "ns", "sa"), [fds.new()])
    sm.start_failed(step.actions[0].pod, "boom")  # type: ignore[union-attr]
    assert not sm.ready
    step = sm.receive(zds.delete("u1"), [])
    assert step.actions == [StopProxy("u1", deleted=True)] and sm.ready


@pytest.mark.parametrize(
    ("packet", "nfds", "error"),
    [
        (b"\xff\xff\xff", 0, "invalid WorkloadRequest"),
        (b"", 0, "WorkloadRequest without a payload"),
        (zds.add("u1", "p", "ns", "sa"), 0, "AddWorkload must carry exactly one fd, got 0"),
        (zds.add("u1", "p", "ns", "sa"), 2, "AddWorkload must carry exactly one fd, got 2"),
        (zds.delete("u1"), 1, "del must not carry fds"),
        (zds.snapshot_sent(), 1, "snapshot_sent must not carry fds"),
    ],
)
def test_decode_errors_nack_close_fds_and_reconnect(fds: Fds, packet: bytes, nfds: int, error: str) -> None:
    sm = ZdsStateMachine()
    given = [fds.new(str(i)) for i in range(nfds)]
    step = sm.receive(packet, given)
    assert step.outcome is Outcome.RECONNECT and step.actions == []
    assert error in nack_text(step.reply)
    assert not any(fd_open(fd) for fd in given)


def test_protocol_errors_exit(fds: Fds) -> None:
    req = zds.WorkloadRequest()
    req.add.uid = "u1"  # no workload_info
    sm = ZdsStateMachine()
    fd = fds.new()
    step = sm.receive(req.SerializeToString(), [fd])
    assert step.outcome is Outcome.EXIT and "without workload_info" in nack_text(step.reply)
    assert not fd_open(fd)

    sm = ZdsStateMachine()
    sm.receive(zds.snapshot_sent(), [])
    step = sm.receive(zds.keep("u1"), [])
    assert step.outcome is Outcome.EXIT and "KeepWorkload u1 after the snapshot" in nack_text(step.reply)

    step = sm.receive(zds.snapshot_sent(), [])
    assert step.outcome is Outcome.EXIT and "second SnapshotSent" in nack_text(step.reply)


def test_wire_bytes_match_the_field_numbers() -> None:
    # zds.proto: DelWorkload.uid is field 2; WorkloadRequest.keep is 5; Ack.error is 1.
    assert zds.delete("u") == bytes([0x12, 0x03, 0x12, 0x01]) + b"u"
    assert zds.keep("u") == bytes([0x2A, 0x03, 0x0A, 0x01]) + b"u"
    assert zds.snapshot_sent() == bytes([0x1A, 0x00])
    assert zds.hello() == bytes([0x08, 0x01])
    assert zds.ack("no") == bytes([0x0A, 0x04, 0x0A, 0x02]) + b"no"
