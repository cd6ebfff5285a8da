"""ztunnel's side of the ZDS conversation as a state machine.

It reads and writes no socket: the manager moves the packets. Its one system call is `fstat` on the
namespace fds it is handed (their device and inode tell one network namespace from another), and it
closes the fds of a message it rejects.

`ZdsStateMachine.receive(packet, fds)` takes one packet from the node agent and returns a `Step`: the
actions for the proxy manager (start or stop a pod's proxy) and the reply to send. A start's outcome is
reported back with `started()` or `start_failed()`, which return the reply for that `AddWorkload`.

What lasts across connections to the agent: the pods whose proxy runs, and the pods waiting to be
retried. What each new connection resets: whether the snapshot was received and which uids it named.

Errors come in two kinds, as in the reference:
* a packet that cannot be decoded (bad protobuf, an fd on a message other than Add, an Add with no fd or
  several) is NACKed and the connection is dropped and made again;
* a protocol error (an Add without `workload_info`, a Keep after the snapshot, a second SnapshotSent)
  is NACKed and ztunnel exits with status 1.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

from xds import zds

NetnsKey = tuple[int, int]  # (st_dev, st_ino) of a namespace fd


@dataclass(frozen=True)
class PodInfo:
    uid: str
    name: str
    namespace: str
    service_account: str


@dataclass(frozen=True)
class StartProxy:
    """Start the pod's proxy in the namespace of `netns_fd` (now owned by the manager)."""

    pod: PodInfo
    netns_fd: int
    netns_key: NetnsKey


@dataclass(frozen=True)
class StopProxy:
    """Stop the pod's proxy (or forget the pod if it is only pending). `deleted`: the pod is gone
    (a delete, or left out of a snapshot), its connections are drained before the reply; else (its
    Add names another namespace) the old proxy is cut at once."""

    uid: str
    deleted: bool = False


Action = StartProxy | StopProxy


class Outcome(Enum):
    OK = "ok"
    RECONNECT = "reconnect"  # undecodable packet: NACK, then drop the connection
    EXIT = "exit"  # protocol error: NACK, then exit with status 1


@dataclass
class Step:
    actions: list[Action] = field(default_factory=list)
    reply: bytes | None = None  # None: the reply waits for the start's outcome
    outcome: Outcome = Outcome.OK
    error: str = ""


class ZdsStateMachine:
    def __init__(self) -> None:
        self.running: dict[str, NetnsKey] = {}
        self.pending: dict[str, PodInfo] = {}
        self.snapshot_received = False
        self.snapshot_names: set[str] = set()

    def connection_reset(self) -> None:
        """A new connection to the agent: the snapshot starts again (running proxies are kept)."""
        self.snapshot_received = False
        self.snapshot_names = set()

    @property
    def ready(self) -> bool:
        """Readiness of `workload proxy manager`: snapshot applied and nothing left to retry."""
        return self.snapshot_received and not self.pending

    def receive(self, packet: bytes, fds: Sequence[int]) -> Step:
        try:
            req = zds.decode_request(packet)
        except zds.ZdsError as e:
            return self._reject(fds, str(e), Outcome.RECONNECT)
        kind = req.WhichOneof("payload")
        if kind == "add":
            if len(fds) != 1:
                return self._reject(
                    fds, f"AddWorkload must carry exactly one fd, got {len(fds)}", Outcome.RECONNECT
                )
            return self._add(req.add, fds[0])
        if fds:
            return self._reject(fds, f"{kind} must not carry fds", Outcome.RECONNECT)
        if kind == "keep":
            return self._keep(req.keep.uid)
        if kind == "del":
            return self._delete(getattr(req, "del").uid)
        return self._snapshot_sent()

    # -- messages ---------------------------------------------------------------------------------

    def _add(self, msg: zds.zds_pb2.AddWorkload, fd: int) -> Step:
        if not msg.HasField("workload_info"):
            return self._reject([fd], f"AddWorkload {msg.uid} without workload_info", Outcome.EXIT)
        info = msg.workload_info
        pod = PodInfo(msg.uid, info.name, info.namespace, info.service_account)
        if not self.snapshot_received:
            self.snapshot_names.add(pod.uid)
        key = _key(fd)
        current = self.running.get(pod.uid)
        if current is not None and current == key:
            zds.close_fds([fd])
            return Step(reply=zds.ack())
        actions: list[Action] = []
        if current is not None:
            del self.running[pod.uid]
            actions.append(StopProxy(pod.uid))
        elif pod.uid in self.pending:
            del self.pending[pod.uid]
            actions.append(StopProxy(pod.uid))
        actions.append(StartProxy(pod, fd, key))
        return Step(actions=actions)

    def started(self, uid: str, key: NetnsKey) -> bytes:
        """The pod's proxy runs: ACK its Add (also after a retry, where the reply is not sent)."""
        self.pending.pop(uid, None)
        self.running[uid] = key
        return zds.ack()

    def start_failed(self, pod: PodInfo, error: str) -> bytes:
        """The proxy could not start: the pod waits to be retried, and its Add is NACKed."""
        self.pending[pod.uid] = pod
        return zds.ack(f"failure to start proxy : {error}")

    def _keep(self, uid: str) -> Step:
        if self.snapshot_received:
            return self._reject([], f"KeepWorkload {uid} after the snapshot", Outcome.EXIT)
        self.snapshot_names.add(uid)
        return Step(reply=zds.ack())

    def _delete(self, uid: str) -> Step:
        actions: list[Action] = []
        if uid in self.pending:
            del self.pending[uid]
            actions.append(StopProxy(uid, deleted=True))
        if not self.snapshot_received:
            # Before the snapshot ends, leaving it out of the snapshot is what stops it.
            self.snapshot_names.discard(uid)
        elif uid in self.running:
            del self.running[uid]
            actions.append(StopProxy(uid, deleted=True))
        return Step(actions=actions, reply=zds.ack())

    def _snapshot_sent(self) -> Step:
        if self.snapshot_received:
            return self._reject([], "a second SnapshotSent on the same connection", Outcome.EXIT)
        self.snapshot_received = True
        actions: list[Action] = []
        for uid in sorted(set(self.running) | set(self.pending)):
            if uid not in self.snapshot_names:
                self.running.pop(uid, None)
                self.pending.pop(uid, None)
                actions.append(StopProxy(uid, deleted=True))
        return Step(actions=actions, reply=zds.ack())

    @staticmethod
    def _reject(fds: Sequence[int], error: str, outcome: Outcome) -> Step:
        zds.close_fds(fds)
        return Step(reply=zds.ack(error), outcome=outcome, error=error)


def _key(fd: int) -> NetnsKey:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino
