"""The workload proxy manager: in-pod mode's ZDS client and the per-pod proxies.

It connects to the node agent on `INPOD_UDS` (AF_UNIX, SOCK_SEQPACKET), says hello, and then answers
each request of the agent, one at a time, driving `ZdsStateMachine`: for an `AddWorkload` it has the
pod's proxy started (its listeners bound inside the pod's namespace and accepting) before
acknowledging; for a delete (or a pod missing from a snapshot) it drains that proxy at once. Where the
proxies run is the `PodRuntime` given at construction: the supervisor's (`ztunnel/workers/`), with
which every data-plane worker runs one proxy per pod and the ACK waits for all of them. A
pod whose proxy fails to start is NACKed and retried every 5 s. The connection is made again with
backoff (10 ms doubling to 1 s) whenever it drops or cannot be made; running proxies survive that.
Readiness `workload proxy manager` is held until a snapshot is applied with nothing pending, and
says what it waits for (no agent at the path yet, the agent's snapshot, a pod's proxy).

A node agent that comes late must still find this proxy: an absent socket (the agent has not
created it yet) or a refused one (a previous agent's file) is tried again within a second, the
connect never blocks the event loop (a listener that does not accept would freeze readiness and the
admin endpoints with it), an agent that accepted but sends nothing within `SNAPSHOT_SILENCE` is left
for a new connection (one left in the backlog of an agent that never serves it would otherwise hold
readiness for good), and an unexpected error costs the connection, not the manager.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from dataclasses import dataclass
from typing import Any, Protocol

from xds import zds
from ztunnel.admin.server import Readiness, ReadinessHandle
from ztunnel.inpod.netns import PodNetns
from ztunnel.inpod.protocol import Outcome, PodInfo, StartProxy, StopProxy, ZdsStateMachine
from ztunnel.metrics.inpod import WorkloadManagerMetrics

log = logging.getLogger("ztunnel.inpod")

READINESS_TASK = "workload proxy manager"
RETRY_INTERVAL = 5.0
RECONNECT_INITIAL = 0.01
# The reference caps at 15 s: an agent that comes late would wait up to that long for us. A connect
# to a local socket costs microseconds, so we look every second.
RECONNECT_MAX = 1.0
# Before its snapshot is complete the agent sends its messages back to back: this much silence means
# it is not serving this connection.
SNAPSHOT_SILENCE = 10.0


class PodRuntime(Protocol):
    """Where the pods' proxies run."""

    async def start(self, pod: PodInfo, netns: PodNetns) -> str | None:
        """Bind and serve the pod's listeners inside `netns`; the error text if that failed."""
        ...

    async def stop(self, uid: str, deadline: float) -> None:
        """Drain the pod's proxy: gracefully for up to `deadline` seconds, at once when 0."""
        ...

    def describe(self, uid: str) -> dict[str, Any]:
        """What `/config_dump` shows of a running pod's proxy (listeners, connections)."""
        ...


class ProtocolError(Exception):
    """The agent broke the protocol in a way the reference answers by exiting (status 1)."""


@dataclass
class PodProxy:
    pod: PodInfo
    netns: PodNetns
    running: bool = False
    error: str = ""


class WorkloadProxyManager:
    def __init__(
        self,
        uds_path: str,
        pods: PodRuntime,
        readiness: Readiness,
        metrics: WorkloadManagerMetrics,
        *,
        retry_interval: float | None = None,
    ) -> None:
        self.uds_path = uds_path
        self._pods = pods
        self._readiness = readiness
        self._ready_handle: ReadinessHandle | None = readiness.register(READINESS_TASK)
        # What readiness waits for while not connected (the last connect's outcome).
        self._waiting = f"not connected to the node agent at {uds_path} yet"
        readiness.waiting_for(READINESS_TASK, self._waiting)
        self._metrics = metrics
        self._retry_interval = RETRY_INTERVAL if retry_interval is None else retry_interval
        self.sm = ZdsStateMachine()
        self.proxies: dict[str, PodProxy] = {}  # running
        self.pending: dict[str, PodProxy] = {}  # waiting to be retried
        self.connected = False
        self._sock: socket.socket | None = None
        self._retrier: asyncio.Task[None] | None = None
        self._closing = False

    # -- the connection to the agent -----------------------------------------------------------------

    async def run(self) -> None:
        """Keep a conversation with the agent until `close()`. Raises ProtocolError (exit 1)."""
        self._retrier = asyncio.get_running_loop().create_task(self._retry_pending())
        backoff = RECONNECT_INITIAL
        while not self._closing:
            try:
                sock = await self._connect()
            except OSError as e:
                self._waiting = f"no node agent at {self.uds_path} yet ({e.strerror or e})"
                self._update_readiness()
                (log.warning if backoff == RECONNECT_INITIAL else log.debug)(
                    "cannot connect to the node agent at %s (will retry): %s", self.uds_path, e.strerror or e
                )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, RECONNECT_MAX)
                continue
            backoff = RECONNECT_INITIAL
            self._sock = sock
            try:
                self._waiting = await self._converse(sock)
            except OSError as e:
                log.warning("connection to the node agent failed: %s", e.strerror or e)
                self._waiting = f"the connection to the node agent failed ({e.strerror or e}); reconnecting"
            except ProtocolError:
                raise
            except Exception as e:
                log.exception("unexpected error in the conversation with the node agent; reconnecting")
                self._waiting = f"unexpected error with the node agent ({e}); reconnecting"
            finally:
                self._sock = None
                sock.close()
                self.connected = False
                self._update_readiness()
            if not self._closing:
                await asyncio.sleep(backoff)

    async def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, self.uds_path)
        except BaseException:
            sock.close()
            raise
        return sock

    async def _converse(self, sock: socket.socket) -> str:
        """Talk until the connection is to be dropped; why, as readiness says it meanwhile."""
        await _send(sock, zds.hello())
        self.connected = True
        self.sm.connection_reset()
        self._update_readiness()
        log.info("connected to the node agent at %s", self.uds_path)
        while True:
            try:
                # Until the snapshot is complete, silence means the agent is not serving us.
                async with asyncio.timeout(None if self.sm.snapshot_received else SNAPSHOT_SILENCE):
                    packet = await _recv(sock)
            except TimeoutError:
                log.warning(
                    "the node agent at %s sent nothing for %gs before its snapshot; connecting again",
                    self.uds_path,
                    SNAPSHOT_SILENCE,
                )
                return (
                    f"the node agent sent nothing for {SNAPSHOT_SILENCE:g}s before its snapshot; reconnecting"
                )
            except zds.ZdsError as e:
                log.warning("bad packet from the node agent: %s", e)
                await _send(sock, zds.ack(str(e)))
                return f"bad packet from the node agent ({e}); reconnecting"
            if packet is None:
                log.info("the node agent closed the connection")
                return "the node agent closed the connection; reconnecting"
            step = self.sm.receive(*packet)
            reply = step.reply
            for action in step.actions:
                if isinstance(action, StopProxy):
                    await self._stop(action.uid)
                elif isinstance(action, StartProxy):
                    reply = await self._start(action.pod, PodNetns(action.netns_fd, action.netns_key))
            assert reply is not None
            await _send(sock, reply)
            self._update_readiness()
            if step.outcome is Outcome.RECONNECT:
                log.warning("dropping the node agent connection: %s", step.error)
                return f"dropped the node agent connection ({step.error}); reconnecting"
            if step.outcome is Outcome.EXIT:
                log.error("node agent protocol error: %s", step.error)
                raise ProtocolError(step.error)

    # -- pods -------------------------------------------------------------------------------------------

    async def _start(self, pod: PodInfo, netns: PodNetns) -> bytes:
        entry = PodProxy(pod, netns)
        log.info(
            "pod received, starting proxy: uid=%s name=%s namespace=%s netns=%s",
            pod.uid,
            pod.name,
            pod.namespace,
            entry.netns.key[1],
        )
        error = await self._try_start(entry)
        if error is None:
            return self.sm.started(pod.uid, entry.netns.key)
        self.pending[pod.uid] = entry
        self._metrics.pending.set(len(self.pending))
        log.warning("failed to start proxy for pod %s (will retry): %s", pod.uid, error)
        return self.sm.start_failed(pod, error)

    async def _try_start(self, entry: PodProxy) -> str | None:
        """Bind and serve the pod's listeners inside its namespace; the error text if that failed."""
        error = await self._pods.start(entry.pod, entry.netns)
        if error is not None:
            entry.error = error
            return error
        entry.running = True
        entry.error = ""
        self.proxies[entry.pod.uid] = entry
        self._metrics.started.inc()
        self._metrics.active.set(len(self.proxies))
        return None

    async def _stop(self, uid: str, *, deadline: float = 0.0) -> None:
        entry = self.proxies.pop(uid, None)
        if entry is None:
            pending = self.pending.pop(uid, None)
            if pending is not None:
                pending.netns.close()
                self._metrics.pending.set(len(self.pending))
            return
        log.info("pod deleted, stopping proxy: uid=%s", uid)
        if entry.running:
            await self._pods.stop(uid, deadline)
        entry.netns.close()
        self._metrics.stopped.inc()
        self._metrics.active.set(len(self.proxies))

    async def _retry_pending(self) -> None:
        while True:
            await asyncio.sleep(self._retry_interval)
            for uid, entry in list(self.pending.items()):
                if self.pending.get(uid) is not entry:
                    continue  # deleted or replaced meanwhile
                if await self._try_start(entry) is None:
                    del self.pending[uid]
                    self.sm.started(uid, entry.netns.key)
                    log.info("proxy for pod %s started on retry", uid)
            self._metrics.pending.set(len(self.pending))
            self._update_readiness()

    def _update_readiness(self) -> None:
        ready = self.connected and self.sm.ready
        if ready and self._ready_handle is not None:
            self._ready_handle.release()
            self._ready_handle = None
        elif not ready:
            if self._ready_handle is None:
                self._ready_handle = self._readiness.register(READINESS_TASK)
            self._readiness.waiting_for(READINESS_TASK, self._waiting_for())

    def _waiting_for(self) -> str:
        """What `/healthz/ready` says the task waits for."""
        if not self.connected:
            return self._waiting
        if not self.sm.snapshot_received:
            return f"connected to the node agent at {self.uds_path}, waiting for its snapshot of the pods"
        pods = ", ".join(f"{uid} ({e.error})" for uid, e in sorted(self.pending.items()))
        return f"pods whose proxy failed to start, retried every {self._retry_interval:g}s: {pods}"

    # -- shutdown and admin -----------------------------------------------------------------------------

    async def close(self, deadline: float) -> None:
        """Stop talking to the agent and drain every pod's proxy, gracefully up to `deadline`."""
        self._closing = True
        if self._retrier is not None:
            self._retrier.cancel()
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
        await asyncio.gather(
            *(self._stop(uid, deadline=deadline) for uid in list(self.proxies)), return_exceptions=True
        )
        for uid in list(self.pending):
            await self._stop(uid)

    def dump(self) -> dict[str, Any]:
        """`workloadState` of `/config_dump`: each pod's proxy, by uid."""
        state: dict[str, Any] = {}
        for status, entries in (("Up", self.proxies), ("Pending", self.pending)):
            for uid, e in entries.items():
                item: dict[str, Any] = {
                    "state": status,
                    "info": {
                        "name": e.pod.name,
                        "namespace": e.pod.namespace,
                        "serviceAccount": e.pod.service_account,
                    },
                    "netnsInode": e.netns.key[1],
                }
                if e.running:
                    item.update(self._pods.describe(uid))
                if e.error:
                    item["error"] = e.error
                state[uid] = item
        return state


async def _recv(sock: socket.socket) -> tuple[bytes, list[int]] | None:
    loop = asyncio.get_running_loop()
    while True:
        try:
            return zds.recv_packet(sock)
        except (BlockingIOError, InterruptedError):
            pass
        ready = loop.create_future()
        loop.add_reader(sock.fileno(), _wake, ready)
        try:
            await ready
        finally:
            loop.remove_reader(sock.fileno())


async def _send(sock: socket.socket, data: bytes) -> None:
    loop = asyncio.get_running_loop()
    while True:
        try:
            zds.send_packet(sock, data)
            return
        except (BlockingIOError, InterruptedError):
            pass
        ready = loop.create_future()
        loop.add_writer(sock.fileno(), _wake, ready)
        try:
            await ready
        finally:
            loop.remove_writer(sock.fileno())


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
