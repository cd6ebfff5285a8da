"""In-pod mode, in a worker: each pod's `ProxyInstance`, its listeners bound in the pod's namespace."""

from __future__ import annotations

from collections.abc import Callable

from ztunnel.config.settings import WorkloadInfo
from ztunnel.inpod.netns import PodNetns
from ztunnel.proxy.instance import ProxyInstance
from ztunnel.workers.messages import PodConnections

BuildPodProxy = Callable[[WorkloadInfo, PodNetns], ProxyInstance]


class PodProxies:
    """The running pods' proxies of this worker, by pod uid, each with its namespace."""

    def __init__(self, build: BuildPodProxy) -> None:
        self._build = build
        self.instances: dict[str, tuple[ProxyInstance, PodNetns]] = {}

    def running_in(self, uid: str) -> tuple[int, int] | None:
        """The key of the namespace the pod's proxy runs in, if it runs."""
        entry = self.instances.get(uid)
        return entry[1].key if entry is not None else None

    async def start(self, uid: str, info: WorkloadInfo, netns: PodNetns) -> str | None:
        """Bind and serve the pod's listeners in `netns` (ours from now on); the error, if any."""
        try:
            instance = self._build(info, netns)  # binds
        except OSError as e:
            netns.close()
            return e.strerror or str(e)
        try:
            await instance.serve()
        except Exception as e:
            await instance.drain(0, graceful=False)
            netns.close()
            return str(e)
        self.instances[uid] = (instance, netns)
        return None

    async def stop(self, uid: str, deadline: float) -> None:
        """Drain the pod's proxy (gracefully for up to `deadline`, at once when 0)."""
        entry = self.instances.pop(uid, None)
        if entry is None:
            return
        instance, netns = entry
        try:
            await instance.drain(deadline, graceful=deadline > 0)
        finally:
            netns.close()
        self._release_identity(instance)

    def _release_identity(self, stopped: ProxyInstance) -> None:
        """Stop renewing the certificate of a stopped pod's identity, unless another pod shares it."""
        identity = stopped.own_identity()
        if all(other.own_identity() != identity for other, _ in self.instances.values()):
            stopped.secrets.forget(identity)

    def connections(self) -> PodConnections:
        return {uid: instance.connections_dump() for uid, (instance, _) in self.instances.items()}
