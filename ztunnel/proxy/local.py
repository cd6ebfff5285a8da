"""The proxy's own workload as the store knows it, and the identity it speaks as.

Looked up once per store change (not per connection); a listener that needs it before the control
plane has sent it waits, up to `LOCAL_WORKLOAD_WAIT`. The DNS server learns its client here too.
"""

from __future__ import annotations

import asyncio
import contextlib

from hbone.identity import Identity
from mesh.model import Workload
from ztunnel.config.settings import Config, WorkloadInfo
from ztunnel.state.store import ProxyState

LOCAL_WORKLOAD_WAIT = 5.0


class LocalWorkload:
    def __init__(self, config: Config, state: ProxyState, info: WorkloadInfo) -> None:
        self._config = config
        self._state = state
        self.info = info
        self._local: Workload | None = None
        self._known = False  # `_local` is current until the store changes
        self._waiters: set[asyncio.Future[None]] = set()
        self._unsubscribe = state.subscribe(self._state_changed)

    def _state_changed(self) -> None:
        self._known = False
        for fut in self._waiters:
            if not fut.done():
                fut.set_result(None)
        self._waiters.clear()

    def find_local_workload(self) -> Workload | None:
        """The proxy's own workload now, if the store has it."""
        if not self._known:
            i = self.info
            self._local = self._state.find_local_workload(
                i.name, i.namespace, i.service_account, self._config.node_name
            )
            self._known = True
        return self._local

    async def local_workload(self, timeout: float = LOCAL_WORKLOAD_WAIT) -> Workload | None:
        """The proxy's own workload, waiting up to `timeout` for it to appear."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (w := self.find_local_workload()) is None:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return None
            fut = loop.create_future()
            self._waiters.add(fut)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(fut, remaining)
        return w

    def identity(self, w: Workload | None = None) -> Identity:
        """This proxy's identity as workload `w` (its trust domain) states it, else as configured."""
        td = (w.trust_domain if w else "") or self._config.trust_domain
        return Identity(td, self.info.namespace, self.info.service_account)

    def own_identity(self) -> Identity:
        """This proxy's identity now: as its workload in the store says, else as configured."""
        return self.identity(self.find_local_workload())

    def trust_domain(self) -> str:
        return self.own_identity().trust_domain

    def close(self) -> None:
        with contextlib.suppress(ValueError):
            self._unsubscribe()
