"""The supervisor's store, replicated into every worker as typed changes.

`ReplicatedState` is the supervisor's `ProxyState`: every committed change (one xDS response, the
local file, a batch) is handed to its `publish` callable as one `StateChanges`. A worker applies it
to its own plain `ProxyState` with `apply_changes`, under one notification; a worker that starts
late gets `snapshot()` first.
"""

from __future__ import annotations

import contextlib
import ipaddress
from collections.abc import Callable, Iterator

from policy.model import Authorization
from xds.localconfig import LocalConfig
from xds.model import Service, Workload
from ztunnel.state.store import Demander, ProxyState
from ztunnel.workers.messages import (
    Clear,
    RemovePolicy,
    RemoveService,
    RemoveWorkload,
    StateChanges,
    StateOp,
    UpsertPolicy,
    UpsertService,
    UpsertWorkload,
)

Publish = Callable[[StateChanges], None]


def demand_arrived(state: ProxyState, key: str) -> Callable[[], bool]:
    """Whether the store now holds what an on-demand `key` names: `network/ip` (a workload, or a
    service by VIP) or `namespace/hostname` (a service, or a workload by hostname)."""
    scope, _, name = key.rpartition("/")
    try:
        ip = ipaddress.ip_address(name)
    except ValueError:
        return lambda: (
            state.service_by_key(key) is not None or state.workload_by_hostname(scope, name) is not None
        )
    return lambda: state.workload_by_addr(scope, ip) is not None or bool(state.services_by_vip(scope, ip))


class ReplicatedState(ProxyState):
    """The supervisor's store: every committed change is also handed to `publish`."""

    def __init__(self, publish: Publish, demander: Demander | None = None) -> None:
        super().__init__(demander)
        self._publish = publish
        self._journal: list[StateOp] = []
        self._depth = 0  # ops inside ops (a service removed by name) are recorded once
        self._batches = 0

    @contextlib.contextmanager
    def _op(self, op: StateOp) -> Iterator[None]:
        if self._depth == 0:
            self._journal.append(op)
        self._depth += 1
        try:
            with self.batch():
                yield
        finally:
            self._depth -= 1

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        self._batches += 1
        try:
            with super().batch():
                yield
        finally:
            self._batches -= 1
        if self._batches == 0 and self._journal:
            ops, self._journal = tuple(self._journal), []
            self._publish(StateChanges(ops))

    def snapshot(self) -> StateChanges:
        ops: list[StateOp] = [Clear()]
        ops += [UpsertWorkload(w) for w in self.workloads()]
        ops += [UpsertService(s) for s in self.services()]
        ops += [UpsertPolicy(p) for p in self.policies()]
        return StateChanges(tuple(ops))

    def upsert_workload(self, w: Workload) -> None:
        with self._op(UpsertWorkload(w)):
            super().upsert_workload(w)

    def remove(self, name: str) -> bool:
        with self._op(RemoveWorkload(name)):
            return super().remove(name)

    def upsert_service(self, s: Service) -> None:
        with self._op(UpsertService(s)):
            super().upsert_service(s)

    def remove_service(self, key: str) -> bool:
        with self._op(RemoveService(key)):
            return super().remove_service(key)

    def upsert_policy(self, p: Authorization) -> None:
        with self._op(UpsertPolicy(p)):
            super().upsert_policy(p)

    def remove_policy(self, key: str) -> bool:
        with self._op(RemovePolicy(key)):
            return super().remove_policy(key)

    def apply_local_config(self, cfg: LocalConfig) -> None:
        with self.batch():
            if self._depth == 0:
                self._journal.append(Clear())  # then the file's upserts, one by one
            super().apply_local_config(cfg)


def apply_changes(state: ProxyState, changes: StateChanges) -> None:
    """A worker applies one change of the supervisor's store, with one notification."""
    with state.batch():
        for op in changes.ops:
            if isinstance(op, Clear):
                state.apply_local_config(LocalConfig())
            elif isinstance(op, UpsertWorkload):
                state.upsert_workload(op.workload)
            elif isinstance(op, UpsertService):
                state.upsert_service(op.service)
            elif isinstance(op, UpsertPolicy):
                state.upsert_policy(op.policy)
            elif isinstance(op, RemoveWorkload):
                state.remove(op.name)
            elif isinstance(op, RemoveService):
                state.remove_service(op.key)
            elif isinstance(op, RemovePolicy):
                state.remove_policy(op.key)
