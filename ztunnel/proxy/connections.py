"""Carrying a connection to its end, and the open inbound connections a policy change may close.

`carry` relays the two sides until both are done and completes the connection's record (metrics and
the access log). A drain may end a carried connection gracefully (`_Carried.end`, a deleted pod's):
its app's side is read to its end, so that the relay half-closes towards the peer after what is in
flight, as if the app had closed. Every allowed inbound connection is registered with the `ConnectionTracker` with
what authorization saw of it. When the policy store changes, each one is authorized again against
its workload's current policies; those now denied are cut, logged with `connection closed due to
policy change` and recorded as `DENY` (a late rejection, as the reference's).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass

from hbone.relay import Inbox, RelayResult, start_relay
from hbone.tls import REVOKED
from policy import Authorization, Connection, Deny, authorize
from ztunnel.proxy.telemetry import ConnectionRecord
from ztunnel.state.store import ProxyState

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


def carry(
    downstream: asyncio.Transport,
    upstream: asyncio.Transport,
    record: ConnectionRecord,
    *,
    down_inbox: Inbox | None = None,
    up_inbox: Inbox | None = None,
    tracker: ConnectionTracker | None = None,
    authorized: tuple[Connection, str] | None = None,
) -> asyncio.Future[RelayResult]:
    """Start relaying; the record is completed when both directions have ended. Returns the relay's
    future: done then, and cancelling it (a drain deadline) cuts both sides.

    Nothing waits on a carried connection: it is two protocols and this future, no task or frame
    (what most of a held connection's memory was).

    With a `tracker`, `authorized` (what authorization saw, and the local workload's uid) keeps an
    inbound connection under re-authorization, which cuts it if a policy change now denies it.
    """
    carried = _Carried(downstream, upstream, record)
    if tracker is not None and authorized is not None:
        carried.tracked = tracker.register(*authorized, carried.reject)
        carried.tracker = tracker
    done = start_relay(
        downstream,
        upstream,
        a_inbox=down_inbox,
        b_inbox=up_inbox,
        counts=record.counts,
    )
    done.add_done_callback(carried, context=NO_CONTEXT)
    record.carrier = carried
    return done


# Callbacks of carried connections run in this (empty) context: done callbacks would otherwise copy
# the current one, an object per callback kept for the connection's lifetime.
NO_CONTEXT = contextvars.Context()


class _Carried:
    """What completes a carried connection's record when its relay ends (one small object)."""

    __slots__ = ("downstream", "ending", "record", "rejected", "tracked", "tracker", "upstream")

    def __init__(self, downstream: asyncio.Transport, upstream: asyncio.Transport, record: ConnectionRecord):
        self.downstream = downstream
        self.upstream = upstream
        self.record = record
        self.rejected: str | None = None
        self.ending: str | None = None  # why a drain ends it (`end`)
        self.tracked: Tracked | None = None
        self.tracker: ConnectionTracker | None = None

    def reject(self, error: str) -> None:
        """Cut the connection (a policy change denies it): its record says `error`."""
        self.rejected = error
        self.downstream.abort()
        self.upstream.abort()

    def end(self, reason: str) -> None:
        """End the connection gracefully, for `reason` (its access log says it): no more is read of
        the local app's side once what it has sent is read, so the relay writes that to the peer, then
        the end of it (FIN, END_STREAM), as when the app closes; the peer's own end closes both sides.

        The app's side is a TCP socket in either direction (outbound: the accepted one; inbound: the
        one to the app), ended for reading under its transport, which then reads the end of it."""
        if self.ending is not None or self.rejected is not None:
            return
        self.ending = reason
        app_side = self.downstream if self.record.direction == "outbound" else self.upstream
        sock = app_side.get_extra_info("socket")
        if sock is None or app_side.is_closing():
            return
        try:
            with socket.socket(fileno=os.dup(sock.fileno())) as dup:
                dup.shutdown(socket.SHUT_RD)
        except OSError as e:  # already gone: the relay is ending anyway
            log.debug("ending a connection for %s: %s", reason, e)

    def __call__(self, done: asyncio.Future[RelayResult]) -> None:
        if self.tracked is not None and self.tracker is not None:
            self.tracker.unregister(self.tracked)
        record = self.record
        if done.cancelled():  # a drain deadline
            self.downstream.abort()
            self.upstream.abort()
            record.finish(received=0, sent=0, error="connection closed: drain deadline", reason=self.ending)
            return
        result = done.result()
        revoked = _revoked(self.downstream, self.upstream)
        if revoked is not None:  # a CRL reload tore its HBONE connection down
            record.finish(
                received=result.a_to_b, sent=result.b_to_a, error=str(revoked), flags="CERT_REVOKED"
            )
        elif self.rejected is not None:
            record.finish(received=result.a_to_b, sent=result.b_to_a, error=self.rejected, flags="DENY")
        else:
            # Resets and broken pipes during the copy are normal TCP endings.
            record.finish(received=result.a_to_b, sent=result.b_to_a, reason=self.ending)


def _revoked(*transports: asyncio.Transport) -> object | None:
    """The revocation that tore down the HBONE connection one of `transports` rides on, if any."""
    for transport in transports:
        revoked = transport.get_extra_info(REVOKED)
        if revoked is not None:
            return revoked
    return None
