"""Open inbound connections, kept so that a policy change can close those it now denies (SPEC §5.5).

Every allowed inbound connection is registered with what authorization saw of it. When the policy
store changes, each one is authorized again against its workload's current policies; those now
denied are cut, logged with `connection closed due to policy change` and recorded as `DENY`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from policy import Authorization, Connection, Deny, authorize
from ztunnel.state import ProxyState

log = logging.getLogger("ztunnel.proxy")

POLICY_CHANGE = "connection closed due to policy change"


@dataclass(eq=False, slots=True)
class Tracked:
    connection: Connection
    workload_uid: str
    reject: Callable[[str], None]  # cut the connection, with this error in its record


class ConnectionTracker:
    def __init__(self, state: ProxyState) -> None:
        self._state = state
        self._open: set[Tracked] = set()
        self._unsubscribe = state.subscribe_policies(self.reevaluate)

    def __len__(self) -> int:
        return len(self._open)

    def register(self, connection: Connection, workload_uid: str, reject: Callable[[str], None]) -> Tracked:
        tracked = Tracked(connection, workload_uid, reject)
        self._open.add(tracked)
        return tracked

    def unregister(self, tracked: Tracked) -> None:
        self._open.discard(tracked)

    def reevaluate(self) -> None:
        """Authorize every open connection again; cut the denied ones."""
        policies: dict[str, list[Authorization] | None] = {}  # per workload uid, looked up once
        for tracked in list(self._open):
            uid = tracked.workload_uid
            if uid not in policies:
                workload = self._state.workload_by_uid(uid)
                policies[uid] = None if workload is None else self._state.policies_for(workload)
            applying = policies[uid]
            if applying is None:
                continue  # the workload's removal is not a policy decision
            decision = authorize(applying, tracked.connection)
            if isinstance(decision, Deny):
                self._open.discard(tracked)
                log.debug("policy change denies %s: %s", tracked.connection, decision.reason)
                tracked.reject(POLICY_CHANGE)

    def close(self) -> None:
        self._unsubscribe()
        self._open.clear()
