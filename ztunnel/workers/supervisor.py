"""The supervisor: the parent process of `ztunnel proxy`. It spawns the workers (the ones forked at
start-up, then replacements: `spawning.py`), reads what they say and dispatches it, and stops them.

It runs the control runtime (`ztunnel/control.py`) with its own collaborators: the store it
replicates to every worker, the metrics that sum theirs, hooks that ask them (a scrape, a profile,
the pods' connections) and tell them (the log filter), and in in-pod mode the pods' runtime. What
to make of a worker's life (readiness, restarts, a silent worker) is the fleet's
(`fleet.py`); the supervisor does the I/O and acts on its decisions.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hbone.identity import Identity
from hbone.tls import WorkloadCertificate
from ztunnel.admin.server import Readiness, ReadinessHandle
from ztunnel.allocator import IdleTrimmer
from ztunnel.config.settings import Config
from ztunnel.control import ControlHooks, ControlRuntime
from ztunnel.identity.certificates import CertificateUnavailable, SecretManager
from ztunnel.lifecycle import StartupError
from ztunnel.logs import lines as logs
from ztunnel.metrics.series import sweep_stale_series
from ztunnel.state.image import LAYOUT
from ztunnel.state.replication import Replication, StateImageReady
from ztunnel.state.store import ProxyState, demand_arrived
from ztunnel.workers import fleet
from ztunnel.workers.channel import PEER_GONE, RECV_RETRY, Channel, FdsLost, MessageLost, close_fds, encode
from ztunnel.workers.counters import SummedMetrics, TrafficSums
from ztunnel.workers.fleet import Fleet, Phase
from ztunnel.workers.fleet_pods import WorkerPods
from ztunnel.workers.listeners import claim_listeners
from ztunnel.workers.messages import (
    CertificateReply,
    CertificateRequest,
    Counters,
    Demand,
    DemandReply,
    Failed,
    Ping,
    PodAdd,
    PodConnections,
    PodDel,
    PodResult,
    Pong,
    ProfileReply,
    ProfileRequest,
    Ready,
    Scrape,
    SetLogFilter,
    Spawn,
    StateImageWanted,
    Stop,
    Synced,
    ToWorker,
)
from ztunnel.workers.spawning import Spawner, exit_code
from ztunnel.workers.worker import collect_profile

if TYPE_CHECKING:
    from ztunnel.admin import profiling

log = logging.getLogger("ztunnel.workers")

SCRAPE_TIMEOUT = 1.0
HEARTBEAT_INTERVAL = 1.0
POD_ANSWER_TIMEOUT = 4.0
# How long past its own sampling the supervisor waits for the workers' profiles.
PROFILE_GRACE = 5.0
# A certificate request for the certificate the worker already has waits this long for a newer one
# (the supervisor rotates at the same half-life as the worker).
NEWER_CERT_WAIT = 5.0
# How long a worker whose channel closed may take to exit before it is killed.
REAP_TIMEOUT = 2.0

Clock = Callable[[], float]


def hold_fds(message: ToWorker, fds: Sequence[int]) -> list[int]:
    """The fds to queue with `message` for a worker. An image's memfd is let go by the state once a
    newer image is made, maybe before the message is written: the queue holds a dup of it."""
    return [os.dup(fd) for fd in fds] if isinstance(message, StateImageReady) else list(fds)


def release_fds(message: ToWorker, fds: Sequence[int]) -> None:
    """`message` was written (or will never be): let go of what `hold_fds` took."""
    if isinstance(message, StateImageReady):
        for fd in fds:
            os.close(fd)


@dataclass
class WorkerSlot:
    """The supervisor's end of one worker: its channel and what waits on its answers."""

    index: int
    pid: int | None = None
    channel: Channel | None = None
    outbox: asyncio.Queue[tuple[ToWorker, list[int], list[bytes] | None]] = field(
        default_factory=asyncio.Queue
    )
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    failure: str = ""  # its start-up error, as it said before exiting
    pod_waiters: dict[int, asyncio.Future[str]] = field(default_factory=dict)  # by request seq
    profile_waiters: dict[int, asyncio.Future[ProfileReply]] = field(default_factory=dict)
    pod_connections: PodConnections = field(default_factory=dict)
    scrape: asyncio.Future[None] | None = None
    scrape_seq: int = 0
    images_resent: int = 0  # the parent's image generation last sent again on its asking
    gone: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def alive(self) -> bool:
        return self.channel is not None and not self.channel.closed

    def send(self, message: ToWorker, fds: Sequence[int] = (), packets: list[bytes] | None = None) -> None:
        if self.alive:
            self.outbox.put_nowait((message, hold_fds(message, fds), packets))

    def new_outbox(self) -> None:
        """A fresh outbox for a new worker; the fds the old one held are let go."""
        while not self.outbox.empty():
            release_fds(*self.outbox.get_nowait()[:2])
        self.outbox = asyncio.Queue()

    def worker_gone(self) -> None:
        """Its channel closed: nothing it was asked is answered now."""
        # A worker that is gone holds up no pod: its replacement gets every pod when it starts.
        for fut in self.pod_waiters.values():
            if not fut.done():
                fut.set_result("")
        self.pod_waiters.clear()
        self.gone.set()


class Supervisor:
    """The parent process: the control work and the operator endpoints; connections in the workers."""

    def __init__(self, config: Config, spawner: Spawner, *, clock: Clock = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.fleet = Fleet(max(1, config.worker_threads))
        self.slots = [WorkerSlot(i) for i in range(self.fleet.count)]
        self.sums = TrafficSums()
        on_demand = config.xds_on_demand and bool(config.xds_address)
        self.state = ProxyState(self._demand if on_demand else None)
        self.replication = Replication(self.state, self.tell_all)  # every change, to the workers
        self.readiness = Readiness()
        self.pods = WorkerPods(self) if config.proxy_mode == "shared" else None
        self.control = ControlRuntime(
            config,
            ControlHooks(
                state=self.state,
                metrics=SummedMetrics(self.sums, config.istio_version, self._helper_pids),
                readiness=self.readiness,
                shutdown=self.shutdown,
                extra_dump=self._workers_dump,
                before_scrape=self.scrape,
                on_log_filter=lambda spec: self.tell_all(SetLogFilter(spec)),
                profilers=(
                    lambda seconds, frequency: self.profile("cpu", seconds, frequency),
                    lambda seconds: self.profile("heap", seconds),
                ),
                pod_runtime=self.pods,
            ),
        )
        self.locks: list[socket.socket] = []
        self.synced = False
        self.spawner = spawner
        self._stop = asyncio.Event()
        self._proxy_ready: ReadinessHandle | None = self._hold_proxy_ready()
        self._started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._seq = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._reaps: dict[int, asyncio.Task[None]] = {}  # by pid: the workers gone, being collected
        # What each worker message does; every message also tells the fleet the worker is alive.
        self._dispatch: dict[type, Callable[[WorkerSlot, Any], None]] = {
            Ready: self._on_ready,
            Counters: self._on_counters,
            CertificateRequest: self._on_certificate_request,
            Demand: self._on_demand,
            ProfileReply: self._on_profile_reply,
            PodResult: self._on_pod_result,
            Failed: self._on_failed,
            StateImageWanted: self._on_image_wanted,
            Pong: lambda slot, message: None,
        }

    def _hold_proxy_ready(self) -> ReadinessHandle:
        handle = self.readiness.register("proxy")
        self.readiness.waiting_for(
            "proxy", f"each of the {self.fleet.count} data-plane workers serving (its listeners accepting)"
        )
        return handle

    def _helper_pids(self) -> list[int]:
        """The workers alive now, and the certificate helper while one runs (the processes
        `process_*` sum with this one; a helper's CPU seconds, once it is reaped, are this one's)."""
        pids = [s.pid for s in self.slots if s.alive and s.pid is not None]
        helper = self.control.certwork.pid
        return pids if helper is None else [*pids, helper]

    @property
    def secrets(self) -> SecretManager:
        assert self.control.secrets is not None, "the control runtime is not started"
        return self.control.secrets

    # -- what the workers are told and asked (also the pods' `Workers`) ---------------------------------

    def tell_all(self, message: ToWorker, fds: Sequence[int] = ()) -> None:
        """Send `message` to every running worker, expecting no answer; pickled once for all."""
        packets = encode(message)
        for slot in self.slots:
            slot.send(message, fds, packets)

    def identity_of(self, name: str, namespace: str, service_account: str) -> Identity:
        return self.control.identity_of(name, namespace, service_account)

    def forget_identity(self, identity: Identity) -> None:
        if self.control.secrets is not None:
            self.control.secrets.forget(identity)

    def pod_connections(self) -> list[PodConnections]:
        return [s.pod_connections for s in self.slots if s.alive]

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    async def ask_all(self, message: PodAdd | PodDel, fds: Sequence[int] = ()) -> dict[int, str]:
        """Send a pod message to every running worker and wait for each one's result."""
        seq = self._next_seq()
        message = dataclasses.replace(message, seq=seq)
        waits: dict[int, asyncio.Future[str]] = {}
        for slot in self.slots:
            if not slot.alive:
                continue  # a worker being replaced gets every pod when it starts
            waits[slot.index] = slot.pod_waiters[seq] = asyncio.get_running_loop().create_future()
            slot.send(message, fds)
        if waits:
            # Inside the node agent's own deadline for an answer: a pod a worker is slow to start is
            # NACKed, and retried (a worker already running it then just says so).
            await asyncio.wait(waits.values(), timeout=POD_ANSWER_TIMEOUT)
        for slot in self.slots:
            slot.pod_waiters.pop(seq, None)
        return {i: f.result() if f.done() else "no answer in time" for i, f in waits.items()}

    def _serving(self) -> list[WorkerSlot]:
        return [s for s in self.slots if s.alive and self.fleet.phase(s.index) is Phase.READY]

    async def profile(self, kind: str, seconds: float, frequency: int = 0) -> profiling.Profile:
        """A profile of the whole proxy: this process's and every running worker's, merged (each
        sample keeps its process's `pid` label). A worker that cannot answer is left out, and said so."""
        seq = self._next_seq()
        waits: dict[int, asyncio.Future[ProfileReply]] = {}
        for slot in self._serving():
            waits[slot.index] = slot.profile_waiters[seq] = asyncio.get_running_loop().create_future()
            slot.send(ProfileRequest(seq, kind, seconds, frequency))
        try:
            own = await collect_profile(kind, seconds, frequency)
            if waits:
                await asyncio.wait(waits.values(), timeout=PROFILE_GRACE)
        finally:
            for slot in self.slots:
                slot.profile_waiters.pop(seq, None)
        from ztunnel.admin.server import (
            profiling,  # tracemalloc, gzip and the profile's format, when one is asked
        )

        profiles = [own]
        for index, fut in waits.items():
            reply = fut.result() if fut.done() else None
            if reply is None or reply.profile is None:
                why = reply.error if reply is not None else "no answer in time"
                log.warning("data-plane worker %d left out of the %s profile: %s", index, kind, why)
                continue
            profiles.append(profiling.Profile.from_dict(reply.profile))
        return profiling.merge(profiles)

    async def scrape(self) -> None:
        """Before /metrics: every worker's current counters (a worker that does not answer within
        a second is shown with its last report)."""
        seq = self._next_seq()
        waits = []
        for slot in self._serving():
            slot.scrape = asyncio.get_running_loop().create_future()
            slot.scrape_seq = seq
            waits.append(slot.scrape)
            slot.send(Scrape(seq))
        if waits:
            await asyncio.wait(waits, timeout=SCRAPE_TIMEOUT)

    async def _answer_certificate(self, slot: WorkerSlot, request: CertificateRequest) -> None:
        try:
            cert = await self.secrets.get(request.identity)
            deadline = time.monotonic() + NEWER_CERT_WAIT
            while (
                cert.chain_pem[0] == request.known and _past_half_life(cert) and time.monotonic() < deadline
            ):
                # The worker rotates at the same half-life as we do: give our rotation a moment.
                # (Before that, the worker just forgot it, e.g. a pod stopped and came back.)
                await asyncio.sleep(0.2)
                cert = await self.secrets.get(request.identity)
            reply = CertificateReply(request.identity, cert)
        except CertificateUnavailable as e:
            reply = CertificateReply(request.identity, None, str(e) or "certificate unavailable")
        slot.send(reply)

    def _workers_dump(self) -> dict[str, Any]:
        """`/config_dump`'s `workers`."""
        return {
            "workers": [
                {
                    "index": s.index,
                    "pid": s.pid,
                    "state": self.fleet.phase(s.index).value,
                    "restarts": self.fleet.members[s.index].restarts,
                    "connectionsOpened": self.sums.opened(s.index),
                    "inboundOpened": self.sums.opened(s.index, "destination"),
                    "outboundOpened": self.sums.opened(s.index, "source"),
                }
                for s in self.slots
            ]
        }

    def shutdown(self) -> None:
        self._stop.set()

    async def _wait_stop(self) -> None:
        await self._stop.wait()

    # -- the fleet's decisions --------------------------------------------------------------------

    def _act(self, events: list[fleet.Event]) -> None:
        for event in events:
            if isinstance(event, fleet.ReadinessChanged):
                if event.ready and self._proxy_ready is not None:
                    self._proxy_ready.release()
                    self._proxy_ready = None
                elif not event.ready and self._proxy_ready is None:
                    self._proxy_ready = self._hold_proxy_ready()
            elif isinstance(event, fleet.Started):
                if not self._started.done():
                    self._started.set_result(None)
            elif isinstance(event, fleet.Unresponsive):
                pid = self.slots[event.index].pid
                log.warning(
                    "data-plane worker %d (pid %s) has not answered for %.0fs",
                    event.index,
                    pid,
                    event.silent_for,
                )
            elif isinstance(event, fleet.Answers):
                log.warning(
                    "data-plane worker %d (pid %s) answers again", event.index, self.slots[event.index].pid
                )
            elif isinstance(event, fleet.StartupFailed):
                if not self._started.done():
                    self._started.set_exception(StartupError(event.error))
            elif isinstance(event, fleet.Restart):
                self._background(self._restart(event))

    def _background(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _restart(self, event: fleet.Restart) -> None:
        slot = self.slots[event.index]
        log.warning(
            "data-plane worker %d (pid %s) is gone%s; starting another in %.1fs",
            slot.index,
            slot.pid,
            f" ({event.failure})" if event.failure else "",
            event.delay,
        )
        await asyncio.sleep(event.delay)
        if self.fleet.stopping:
            self._act(self.fleet.dropped(slot.index))
            return
        try:
            await self._spawn(slot)
        except OSError as e:
            log.error("data-plane worker %d: restart failed: %s", slot.index, e)
            self._act(self.fleet.dropped(slot.index))

    # -- what the workers say -----------------------------------------------------------------------

    def _on_ready(self, slot: WorkerSlot, message: Ready) -> None:
        self._act(self.fleet.became_ready(slot.index, self.clock()))

    def _on_counters(self, slot: WorkerSlot, message: Counters) -> None:
        self.sums.report(slot.index, message.families)
        if message.pods is not None:
            slot.pod_connections = message.pods
        scrape = slot.scrape
        if message.seq and message.seq == slot.scrape_seq and scrape and not scrape.done():
            scrape.set_result(None)

    def _on_certificate_request(self, slot: WorkerSlot, message: CertificateRequest) -> None:
        self._background(self._answer_certificate(slot, message))

    def _on_demand(self, slot: WorkerSlot, message: Demand) -> None:
        self._background(self._answer_demand(slot, message))

    async def _answer_demand(self, slot: WorkerSlot, message: Demand) -> None:
        answered = await self._demand(message.key, demand_arrived(self.state, message.key))
        slot.send(DemandReply(message.seq, answered))

    async def _demand(self, key: str, arrived: Callable[[], bool]) -> bool:
        return await self.control.demand(key, arrived)

    def _on_profile_reply(self, slot: WorkerSlot, message: ProfileReply) -> None:
        waiter = slot.profile_waiters.pop(message.seq, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(message)

    def _on_pod_result(self, slot: WorkerSlot, message: PodResult) -> None:
        fut = slot.pod_waiters.pop(message.seq, None)
        if fut is not None and not fut.done():
            fut.set_result(message.error)
        elif message.error:
            # E.g. a pod handed to a new worker at its start: nobody waits, so say it.
            log.warning(
                "data-plane worker %d failed to start the proxy of pod %s: %s",
                slot.index,
                message.uid,
                message.error,
            )

    def _on_failed(self, slot: WorkerSlot, message: Failed) -> None:
        slot.failure = message.error

    def _on_image_wanted(self, slot: WorkerSlot, message: StateImageWanted) -> None:
        """A worker could not take an image: it is sent the current ones again, once per generation
        (a worker that fails again waits for the next image: no loop of resends)."""
        generation = self.replication.generation
        if slot.images_resent == generation:
            log.error(
                "data-plane worker %d (pid %s) cannot take state image %d either: it serves from image %d "
                "until the next one",
                slot.index,
                slot.pid,
                message.refused,
                message.holding,
            )
            return
        slot.images_resent = generation
        log.warning(
            "data-plane worker %d (pid %s) refused state image %d (%s): sending it the current images again",
            slot.index,
            slot.pid,
            message.refused,
            message.reason,
        )
        for image, fds in self.replication.images():
            slot.send(image, fds)

    # -- life cycle ---------------------------------------------------------------------------------

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.shutdown)
        stop = loop.create_task(self._wait_stop())
        background: list[asyncio.Task[None]] = []
        trimmer = IdleTrimmer()  # looks once a second: no connection of ours pokes it
        trimmer.start(loop)
        try:
            await self.control.start()
            if self.config.proxy_mode == "dedicated":
                await self._claim_listeners()
            for slot in self.slots:
                await self._spawn(slot)
            background = [
                loop.create_task(self._wait_synced()),
                loop.create_task(self._heartbeat()),
                loop.create_task(self._drop_stale_series()),
            ]
            await asyncio.wait([self._started, stop], return_when=asyncio.FIRST_COMPLETED)
            if self._started.done():
                self._started.result()  # a worker's start-up error stops start-up
                log.info(
                    "%d data-plane workers ready: pids %s", self.fleet.count, [s.pid for s in self.slots]
                )
            await stop
        finally:
            stop.cancel()
            trimmer.stop()
            for task in background:
                task.cancel()
            if self._started.done() and self._started.exception() is None:
                log.info("shutting down: draining for up to %ss", self.config.connection_termination_deadline)
            await self._stop_workers()
            await self.control.drain()
            self.replication.close()
        return self.control.exit_code

    async def _drop_stale_series(self) -> None:
        """What workers that are gone counted for workloads gone from the state (the live workers
        drop their own series)."""
        grace, sums = self.config.metrics_stale_series_grace_period, self.sums
        if grace > 0:
            present = self.state.series_names_present
            await sweep_stale_series(grace, sums.retired_workloads, present, sums.drop_retired, self.clock)

    async def _claim_listeners(self) -> None:
        try:
            self.locks = await claim_listeners(self.config)
        except OSError as e:
            raise StartupError(f"failed to bind the proxy listeners: {e.strerror or e}") from None

    async def _heartbeat(self) -> None:
        """Readiness means every worker's loop runs: one that stops answering counts as down (its
        listeners may be open, but nothing accepts) until it answers again or dies."""
        while True:
            await asyncio.sleep(HEARTBEAT_INTERVAL)
            self._act(self.fleet.tick(self.clock()))
            for index in self.fleet.to_ping():
                self.slots[index].send(Ping())

    async def _wait_synced(self) -> None:
        await self.control.wait_synced()
        self.synced = True
        self.tell_all(Synced())

    async def _spawn(self, slot: WorkerSlot) -> None:
        proc = self.spawner.spawn(slot.index)
        slot.channel = Channel(proc.sock)
        slot.new_outbox()
        slot.gone = asyncio.Event()
        slot.pid = proc.pid
        slot.failure = ""
        slot.images_resent = 0
        self._act(self.fleet.spawned(slot.index, self.clock()))
        # What a new worker is told first: to start, the whole store, the pods, and whether to
        # accept yet.
        slot.send(Spawn(slot.index, LAYOUT))
        for state_message, fds in self.replication.snapshot():
            slot.send(state_message, fds)
        slot.send(SetLogFilter(logs.current_filter()))
        for message, netns in self.pods.running() if self.pods is not None else ():
            slot.send(message, [netns.fd])
        if self.synced:
            slot.send(Synced())
        loop = asyncio.get_running_loop()
        slot.tasks = [loop.create_task(self._write(slot)), loop.create_task(self._watch(slot))]

    async def _write(self, slot: WorkerSlot) -> None:
        assert slot.channel is not None
        try:
            while True:
                message, fds, packets = await slot.outbox.get()
                try:
                    await slot.channel.send(message, fds, packets)
                finally:
                    release_fds(message, fds)
        except OSError:
            pass  # the worker is gone; _watch sees it

    async def _reap(self, index: int, pid: int) -> None:
        """Collect a worker whose channel closed, and say how it ended."""
        try:
            await self._collect(index, pid)
        finally:
            self._reaps.pop(pid, None)

    async def _collect(self, index: int, pid: int) -> None:
        code = exit_code(pid)
        deadline = time.monotonic() + REAP_TIMEOUT
        while code is None and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
            code = exit_code(pid)
        if code is None:  # its channel is closed and it still runs: it is of no use any more
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            await asyncio.sleep(0.05)
            code = exit_code(pid)
            if code is None:
                return
        how = f"signal {-code}" if code < 0 else f"code {code}"
        (log.info if self.fleet.stopping else log.warning)(
            "data-plane worker %d (pid %d) exited with %s", index, pid, how
        )

    async def _watch(self, slot: WorkerSlot) -> None:
        """Read the worker until its channel closes, then tell the fleet it is gone."""
        channel, pid = slot.channel, slot.pid
        assert channel is not None and pid is not None
        try:
            while (got := await self._next_message(slot, channel)) is not None:
                message, fds = got
                close_fds(fds)
                self._act(self.fleet.heard(slot.index, self.clock()))
                if message is None:
                    continue  # lost on the way: the worker is alive all the same
                handler = self._dispatch.get(type(message))
                if handler is not None:
                    handler(slot, message)
        except OSError:
            pass
        finally:
            channel.close()
            for task in slot.tasks:
                if task is not asyncio.current_task():
                    task.cancel()
            slot.worker_gone()
            self.sums.retire(slot.index)
            self._reaps[pid] = asyncio.get_running_loop().create_task(self._reap(slot.index, pid))
        self._act(self.fleet.gone(slot.index, self.clock(), slot.failure))

    async def _next_message(self, slot: WorkerSlot, channel: Channel) -> tuple[object, list[int]] | None:
        """The worker's next message, (None, []) for one lost on the way, None once the worker is
        gone: only the channel's end or a dead socket says so; any other error is logged and the
        reading goes on."""
        while True:
            try:
                return await channel.recv()
            except FdsLost as e:
                log.error("data-plane worker %d: %s", slot.index, e)
                return e.message, e.fds
            except MessageLost as e:
                log.error("data-plane worker %d: a message from it was lost: %s", slot.index, e)
                return None, []
            except OSError as e:
                if e.errno in PEER_GONE:
                    return None
                log.error("data-plane worker %d: reading from it failed: %s", slot.index, e)
                await asyncio.sleep(RECV_RETRY)

    async def _stop_workers(self) -> None:
        self.fleet.stop()
        deadline = self.config.connection_termination_deadline
        self.tell_all(Stop(deadline))
        waits = [asyncio.ensure_future(s.gone.wait()) for s in self.slots if s.alive]
        if waits:
            _, pending = await asyncio.wait(waits, timeout=deadline + 5.0)
            for task in pending:
                task.cancel()
        killed = []
        for slot in self.slots:
            if slot.alive and slot.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(slot.pid, signal.SIGKILL)
                killed.append(asyncio.ensure_future(slot.gone.wait()))
        if killed:
            await asyncio.wait(killed, timeout=1.0)
        if self._reaps:  # every worker gone is collected, and its end said, before the parent exits
            await asyncio.wait(list(self._reaps.values()), timeout=REAP_TIMEOUT + 1.0)


def _past_half_life(cert: WorkloadCertificate) -> bool:
    start, end = cert.not_before.timestamp(), cert.not_after.timestamp()
    return time.time() >= start + (end - start) / 2
