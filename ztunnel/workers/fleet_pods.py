"""In-pod mode, in the supervisor: the `PodRuntime` the workload proxy manager drives, where every
worker runs each pod's proxy (an ACK waits for all of them)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from hbone.identity import Identity
from ztunnel.inpod.netns import PodNetns
from ztunnel.workers.messages import PodAdd, PodConnections, PodDel, ToWorker

if TYPE_CHECKING:
    from ztunnel.inpod.protocol import PodInfo


class Workers(Protocol):
    """What the pods need of the supervisor."""

    async def ask_all(self, message: PodAdd | PodDel, fds: Sequence[int] = ()) -> dict[int, str]:
        """Send to every running worker; each one's result ("" = done) by worker index."""
        ...

    def tell_all(self, message: ToWorker) -> None: ...

    def identity_of(self, name: str, namespace: str, service_account: str) -> Identity: ...

    def forget_identity(self, identity: Identity) -> None:
        """Stop renewing the identity's certificate."""
        ...

    def pod_connections(self) -> list[PodConnections]:
        """Each running worker's last report of its pods' connections."""
        ...


class WorkerPods:
    def __init__(self, workers: Workers) -> None:
        self._workers = workers
        self._pods: dict[str, tuple[PodAdd, PodNetns]] = {}  # uid -> (message, namespace), in every worker

    def running(self) -> list[tuple[PodAdd, PodNetns]]:
        """Every pod, as a worker that starts now is told of it."""
        return list(self._pods.values())

    async def start(self, pod: PodInfo, netns: PodNetns) -> str | None:
        message = PodAdd(pod.uid, pod.name, pod.namespace, pod.service_account, netns.key)
        self._pods[pod.uid] = (message, netns)
        results = await self._workers.ask_all(message, [netns.fd])
        failed = {i: e for i, e in results.items() if e}
        if not failed:
            return None
        del self._pods[pod.uid]
        self._workers.tell_all(PodDel(pod.uid))  # undone where it did start; the NACK goes now
        # Every worker failing alike is the reference's one cause ("Address already in use"); else
        # the workers that failed are named.
        if len(failed) == len(results) and len(set(failed.values())) == 1:
            return next(iter(failed.values()))
        return "; ".join(f"worker {i}: {e}" for i, e in failed.items())

    async def stop(self, uid: str, deadline: float) -> None:
        entry = self._pods.pop(uid, None)
        if entry is None:
            return
        await self._workers.ask_all(PodDel(uid, deadline))
        identity = self._identity(entry[0])
        if all(self._identity(m) != identity for m, _ in self._pods.values()):
            self._workers.forget_identity(identity)

    def _identity(self, m: PodAdd) -> Identity:
        return self._workers.identity_of(m.name, m.namespace, m.service_account)

    def describe(self, uid: str) -> dict[str, Any]:
        """The pod's open connections in every worker (as of their last report: `/config_dump` asks
        for a fresh one first)."""
        reports = self._workers.pod_connections()
        connections: dict[str, list[dict[str, str | None]]] = {"inbound": [], "outbound": []}
        for report in reports:
            for direction, entries in report.get(uid, {}).items():
                connections.setdefault(direction, []).extend(entries)
        for entries in connections.values():
            entries.sort(key=lambda e: (e.get("src") or "", e.get("originalDst") or ""))
        return {"workers": len(reports), "connections": connections}
