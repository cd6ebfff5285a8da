"""One data-plane worker process: the listeners and connections, nothing of the control plane.

A worker knows only its channel to the supervisor (it never imports the supervisor): it rebuilds
the store from `StateChanges`, gets certificates through `ParentCa`, binds its listeners (the
dedicated workload's, or ztunnel's own HBONE one and each pod's in in-pod mode) with
`SO_REUSEPORT`, starts accepting on `Synced`, and reports its counters.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import signal
import socket
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import uvloop

from hbone.identity import Identity
from hbone.tls import TlsPolicy, WorkloadCertificate
from hbone.tlsio import preload_revocation
from ztunnel.allocator import IdleTrimmer
from ztunnel.config.settings import Config, WorkloadInfo
from ztunnel.identity.certificates import CaError, SecretManager
from ztunnel.logs import lines as logs
from ztunnel.metrics.families import Metrics
from ztunnel.metrics.series import sweep_stale_series
from ztunnel.proxy.instance import ProxyInputs, ProxyInstance, build_proxy
from ztunnel.sockets import SocketFactory, socket_options
from ztunnel.state.image import LAYOUT
from ztunnel.state.memfd import map_image
from ztunnel.state.replication import apply_changes
from ztunnel.state.shared import install, worker_state
from ztunnel.workers.channel import PEER_GONE, RECV_RETRY, Channel, FdsLost, MessageLost, close_fds
from ztunnel.workers.counters import traffic_snapshot
from ztunnel.workers.loop_metrics import EventLoopMetrics
from ztunnel.workers.messages import (
    CertificateReply,
    CertificateRequest,
    Counters,
    Demand,
    DemandReply,
    Failed,
    Ping,
    PodAdd,
    PodDel,
    PodResult,
    Pong,
    ProfileReply,
    ProfileRequest,
    Ready,
    Scrape,
    SetLogFilter,
    Snapshot,
    Spawn,
    StateChanges,
    StateImageReady,
    StateImageWanted,
    Stop,
    Synced,
)

if TYPE_CHECKING:
    from ztunnel.admin import profiling
    from ztunnel.identity.crl import CrlWatcher
    from ztunnel.workers.pod_proxies import PodProxies

log = logging.getLogger("ztunnel.workers")

SNAPSHOT_INTERVAL = 1.0
# How long a certificate's reply is waited for: past the parent's own bound on a fetch (the CA's
# call deadline, 60 s, and its wait for a newer certificate, 5 s). A reply lost on the way is a
# failed fetch, which the secret manager retries with its backoff.
CERTIFICATE_REPLY_DEADLINE = 90.0


class ParentCa:
    """A worker's CA: the supervisor, which holds the one copy of every certificate."""

    def __init__(self, channel: Channel, deadline: float = CERTIFICATE_REPLY_DEADLINE) -> None:
        self._channel = channel
        self._deadline = deadline
        self._waiting: dict[Identity, list[asyncio.Future[CertificateReply]]] = {}
        self._known: dict[Identity, bytes] = {}

    async def fetch(self, identity: Identity) -> WorkloadCertificate:
        fut: asyncio.Future[CertificateReply] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(identity, []).append(fut)
        try:
            await self._channel.send(CertificateRequest(identity, self._known.get(identity)))
            async with asyncio.timeout(self._deadline):
                reply = await fut
        except TimeoutError:
            raise CaError(f"no certificate from the parent process in {self._deadline:g}s") from None
        finally:
            waiting = self._waiting.get(identity, [])
            if fut in waiting:
                waiting.remove(fut)
            if not waiting:
                self._waiting.pop(identity, None)
        if reply.certificate is None:
            raise CaError(reply.error)
        self._known[identity] = reply.certificate.chain_pem[0]
        return reply.certificate

    def answer(self, reply: CertificateReply) -> None:
        waiting = self._waiting.get(reply.identity)
        if waiting:
            fut = waiting.pop(0)
            if not fut.done():
                fut.set_result(reply)

    async def ask_again(self) -> None:
        """A message from the parent was lost, maybe a reply: every certificate waited for is asked
        again (a second reply to one request finds no one waiting, or the next fetch of the same
        identity)."""
        for identity, waiting in list(self._waiting.items()):
            for _ in waiting:
                await self._channel.send(CertificateRequest(identity, self._known.get(identity)))

    def parent_gone(self) -> None:
        for waiting in self._waiting.values():
            for fut in waiting:
                if not fut.done():
                    fut.set_exception(CaError("the parent process is gone"))
        self._waiting.clear()


class ParentDemands:
    """A worker's on-demand xDS: the supervisor asks its control plane (one stream for all)."""

    def __init__(self, channel: Channel) -> None:
        self._channel = channel
        self._waiting: dict[int, asyncio.Future[bool]] = {}
        self._seq = 0

    async def demand(self, key: str, known: Callable[[], bool]) -> bool:
        """True once the key's answer is in the supervisor's store: the changes that brought it
        reach this worker's store before the reply, on the same channel."""
        self._seq += 1
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._waiting[self._seq] = fut
        try:
            await self._channel.send(Demand(self._seq, key))
            return await fut
        finally:
            self._waiting.pop(self._seq, None)

    def answer(self, reply: DemandReply) -> None:
        fut = self._waiting.get(reply.seq)
        if fut is not None and not fut.done():
            fut.set_result(reply.answered)

    def parent_gone(self) -> None:
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_result(False)


Action = tuple[object, list[int]]


class WorkerRuntime:
    """One data-plane worker's listeners and connections, driven by its channel."""

    def __init__(self, config: Config, index: int, channel: Channel) -> None:
        self.config = config
        self.index = index
        self.channel = channel
        self.demands = ParentDemands(channel)
        on_demand = config.xds_on_demand and bool(config.xds_address)  # asked of the supervisor's xDS
        # The parent's images, read through `view`; the rules and the policies, `state`'s.
        self.state, self.view = worker_state(self.demands.demand if on_demand else None)
        # Only the traffic counters are reported to the parent: no /proc reads for process_* here.
        self.metrics = Metrics(config.istio_version, process_metrics=False)
        self.loop_metrics = EventLoopMetrics(index)
        self.metrics.registry.register(self.loop_metrics)
        self.ca = ParentCa(channel)
        # The CRL is a local file, not control-plane state: each worker watches it for its contexts.
        self.crl: CrlWatcher | None = None
        if config.crl_path:
            from ztunnel.identity.crl import CrlWatcher

            self.crl = CrlWatcher.load(config.crl_path, self.metrics)
        tls = TlsPolicy(tls12=config.tls12_enabled, revocation=self.crl.revocation if self.crl else None)
        self.secrets = SecretManager(self.ca, tls=tls)
        self.options = socket_options(config, workers=True)
        self.proxies: list[ProxyInstance] = []
        self.pods: PodProxies | None = None  # in-pod mode
        self.actions: asyncio.Queue[Action] = asyncio.Queue()
        self._profiles: set[asyncio.Task[None]] = set()
        # What the reader answers at once, without waiting behind a pod's start.
        self._now: dict[type, Callable[[Any], Awaitable[None]]] = {
            StateChanges: self._on_changes,
            CertificateReply: self._on_certificate,
            DemandReply: self._on_demand_reply,
            Scrape: self._on_scrape,
            Ping: self._on_ping,
            ProfileRequest: self._on_profile,
            SetLogFilter: self._on_log_filter,
        }

    def bind(self) -> None:
        """Bind this worker's own listeners (the dedicated workload's, or ztunnel's own HBONE one)."""
        cfg = self.config
        if cfg.proxy_mode == "dedicated":
            assert cfg.workload_info is not None
            self.proxies.append(self._instance(cfg.workload_info, SocketFactory(self.options)))
            return
        # In-pod mode's modules are loaded by its workers only.
        from ztunnel.inpod.netns import NetnsSocketFactory
        from ztunnel.workers.pod_proxies import PodProxies

        self.pods = PodProxies(
            lambda info, netns: self._instance(info, NetnsSocketFactory(netns, self.options))
        )
        if cfg.pod_name and cfg.pod_namespace and cfg.service_account:
            info = WorkloadInfo(
                namespace=cfg.pod_namespace, name=cfg.pod_name, service_account=cfg.service_account
            )
            self.proxies.append(self._instance(info, SocketFactory(self.options), inbound_only=True))

    def _instance(
        self, info: WorkloadInfo, factory: SocketFactory, *, inbound_only: bool = False
    ) -> ProxyInstance:
        """A proxy of this worker, its listeners bound (OSError on a conflict)."""
        inputs = ProxyInputs(self.config, self.state, self.secrets, self.metrics)
        return build_proxy(inputs, info, factory, inbound_only=inbound_only)

    def request_stop(self, deadline: float) -> None:
        self.actions.put_nowait((Stop(deadline), []))

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self.loop_metrics.start(loop)
        reader = loop.create_task(self._read())
        pusher = loop.create_task(self._push_counters())
        janitor = loop.create_task(self._drop_stale_series())
        # The heap's free memory, given back once traffic stops (looked at as connections close).
        trimmer = IdleTrimmer()
        trimmer.start(loop)
        self.metrics.traffic.on_connection_closed = trimmer.poke
        try:
            while True:
                message, fds = await self.actions.get()
                if isinstance(message, Stop):
                    await self._drain(message.deadline)
                    break
                await self._act(message, fds)
        finally:
            self.loop_metrics.stop()
            self.metrics.traffic.on_connection_closed = None
            trimmer.stop()
            janitor.cancel()
            pusher.cancel()
            reader.cancel()
            with contextlib.suppress(OSError, RuntimeError):
                await self.channel.send(self._counters(0))
            self.channel.close()
        return 0

    async def _read(self) -> None:
        """Messages that need an answer now are handled here; the rest go to the action queue in
        order (a pod's start waits for its certificate, which comes in on this same channel). Only
        the channel's end means the parent is gone: any other error is logged and the reading goes
        on (a message lost may have been an image: the current ones are asked for again)."""
        while True:
            try:
                got = await self.channel.recv()
            except FdsLost as e:
                log.error("data-plane worker %d: %s", self.index, e)
                got = e.message, e.fds
            except MessageLost as e:
                log.error("data-plane worker %d: a message from the parent was lost: %s", self.index, e)
                await self._want_images(0, str(e))
                with contextlib.suppress(OSError):
                    await self.ca.ask_again()
                continue
            except OSError as e:
                if e.errno not in PEER_GONE:
                    log.error("data-plane worker %d: reading from the parent failed: %s", self.index, e)
                    await asyncio.sleep(RECV_RETRY)
                    continue
                got = None
            if got is None:
                self.ca.parent_gone()
                self.demands.parent_gone()
                self.request_stop(0.0)  # the parent is gone: never outlive it
                return
            message, fds = got
            try:
                await self._dispatch(message, fds)
            except Exception:
                log.exception(
                    "data-plane worker %d: a %s from the parent failed", self.index, type(message).__name__
                )

    async def _dispatch(self, message: object, fds: list[int]) -> None:
        handler = self._now.get(type(message))
        if isinstance(message, StateImageReady):
            await self._on_image(message, fds)
        elif handler is None:
            self.actions.put_nowait((message, fds))
        else:
            close_fds(fds)
            await handler(message)

    async def _on_changes(self, message: StateChanges) -> None:
        apply_changes(self.state, message)

    async def _on_image(self, message: StateImageReady, fds: list[int]) -> None:
        """Map the parent's new image and read the workloads and services from it from now on. An
        image that cannot be taken leaves the store as it was (serving), and the current images are
        asked for again."""
        try:
            if len(fds) != 1:
                raise ValueError(f"{len(fds)} fds with the state image")
            image = map_image(fds[0], message.size)
        except Exception as e:  # any error: an image that cannot be read must not end the reader
            log.error("state image %d refused: %s", message.generation, e)
            await self._want_images(message.generation, str(e))
            return
        finally:
            close_fds(fds)
        if not install(self.state, self.view, image, message.generation, message.base):
            why = f"a delta over base {message.base}, this worker holds base {self.view.base_generation}"
            log.error("state image %d refused: %s", message.generation, why)
            await self._want_images(message.generation, why)

    async def _want_images(self, refused: int, reason: str) -> None:
        with contextlib.suppress(OSError):
            await self.channel.send(StateImageWanted(refused, self.view.base_generation, reason))

    async def _on_certificate(self, message: CertificateReply) -> None:
        self.ca.answer(message)

    async def _on_demand_reply(self, message: DemandReply) -> None:
        self.demands.answer(message)

    async def _on_scrape(self, message: Scrape) -> None:
        await self.channel.send(self._counters(message.seq))

    async def _on_ping(self, message: Ping) -> None:
        await self.channel.send(Pong())

    async def _on_profile(self, message: ProfileRequest) -> None:
        task = asyncio.get_running_loop().create_task(self._profile(message))
        self._profiles.add(task)
        task.add_done_callback(self._profiles.discard)

    async def _on_log_filter(self, message: SetLogFilter) -> None:
        with contextlib.suppress(ValueError):
            logs.set_filter(message.spec, True)

    async def _act(self, message: object, fds: list[int]) -> None:
        if isinstance(message, Synced):
            for proxy in self.proxies:
                await proxy.serve()
                log.info(
                    "worker %d: proxy ready: %s",
                    self.index,
                    ", ".join(f"{n} {h}:{p}" for n, (h, p) in sorted(proxy.addresses.items())),
                )
            await self.channel.send(Ready())
        elif isinstance(message, PodAdd):
            await self.channel.send(await self._pod_add(message, fds))
        elif isinstance(message, PodDel):
            if self.pods is not None:
                await self.pods.stop(message.uid, message.deadline, deleted=message.deleted)
            await self.channel.send(PodResult(message.uid, seq=message.seq))
        else:
            close_fds(fds)

    async def _pod_add(self, message: PodAdd, fds: list[int]) -> PodResult:
        if len(fds) != 1 or self.pods is None:
            close_fds(fds)
            return PodResult(message.uid, "no network namespace", message.seq)
        running = self.pods.running_in(message.uid)
        if running == message.netns_key:
            os.close(fds[0])  # already running in that namespace
            return PodResult(message.uid, seq=message.seq)
        if running is not None:
            await self.pods.stop(message.uid, 0.0)
        from ztunnel.inpod.netns import PodNetns

        info = WorkloadInfo(
            namespace=message.namespace, name=message.name, service_account=message.service_account
        )
        error = await self.pods.start(message.uid, info, PodNetns(fds[0], message.netns_key))
        return PodResult(message.uid, error or "", message.seq)

    async def _drain(self, deadline: float) -> None:
        drains: list[Awaitable[object]] = [
            proxy.drain(deadline, graceful=deadline > 0) for proxy in self.proxies
        ]
        if self.pods is not None:
            drains += [self.pods.stop(uid, deadline) for uid in list(self.pods.instances)]
        await asyncio.gather(*drains, return_exceptions=True)
        await self.secrets.close()
        if self.crl is not None:
            await self.crl.close()

    def _counters(self, seq: int) -> Counters:
        pods = self.pods.connections() if self.pods is not None else {}
        return Counters(seq, traffic_snapshot(self.metrics), pods)

    async def _profile(self, request: ProfileRequest) -> None:
        """Sample this worker as the parent asked, beside its connections (the loop keeps running)."""
        try:
            profile = await collect_profile(request.kind, request.seconds, request.frequency)
            reply = ProfileReply(request.seq, profile.as_dict())
        except Exception as e:
            reply = ProfileReply(request.seq, None, str(e) or type(e).__name__)
        with contextlib.suppress(OSError):
            await self.channel.send(reply)

    async def _drop_stale_series(self) -> None:
        """The series of workloads gone from the state for the grace period, and no longer carried."""
        grace = self.config.metrics_stale_series_grace_period
        if grace <= 0:
            return
        await sweep_stale_series(
            grace,
            self.metrics.series_workloads,
            self.state.series_names_present,
            self.metrics.drop_series,
            asyncio.get_running_loop().time,
        )

    async def _push_counters(self) -> None:
        """About once a second when they changed, so a worker killed outright loses at most that."""
        last: Snapshot | None = None
        while True:
            await asyncio.sleep(SNAPSHOT_INTERVAL)
            snapshot = traffic_snapshot(self.metrics)
            if snapshot != last:
                with contextlib.suppress(OSError):
                    await self.channel.send(Counters(0, snapshot))
                last = snapshot


async def collect_profile(kind: str, seconds: float, frequency: int) -> profiling.Profile:
    """This process's `cpu` (sampled at `frequency`) or `heap` profile over `seconds`."""
    from ztunnel.admin import profiling  # tracemalloc, gzip and the profile's protobuf, when asked

    if kind == "cpu":
        return await profiling.collect_cpu_profile(seconds, frequency)
    return await profiling.collect_heap_profile(seconds)


def preload(config: Config) -> None:
    """Import what the workers of `config` load beyond the worker body's own imports: called before
    the workers are forked, so that every worker shares these modules instead of loading its own."""
    names = []
    if config.dns_capture:
        names.append("ztunnel.dns.server")  # and dnspython
    if config.proxy_mode == "shared":
        names += ["ztunnel.inpod.netns", "ztunnel.workers.pod_proxies"]
    if config.crl_path:
        names.append("ztunnel.identity.crl")
        preload_revocation()  # cryptography's X.509 for the peers' chains, and the TLS engine
    for name in names:
        importlib.import_module(name)


def run_worker(config: Config, index: int, fd: int) -> int:
    """The body of a worker process (forked at start-up, or a replacement's new interpreter), given
    its channel's fd."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C is the parent's to handle

    async def main() -> int:
        channel = Channel(socket.socket(fileno=fd))
        # Nothing is bound before the parent says so (it claims the listeners' addresses first).
        while (got := await channel.recv()) is not None and not isinstance(got[0], Spawn):
            close_fds(got[1])
        if got is None:
            channel.close()
            return 0  # the parent stopped before this worker started
        layout = getattr(got[0], "layout", None)
        if layout != LAYOUT:  # a replacement of another build: it would misread the parent's images
            await channel.send(
                Failed(
                    f"refused: this worker (another build) reads state images of record layout {LAYOUT:08x}, "
                    f"the parent writes {layout or 0:08x}"
                )
            )
            channel.close()
            return 1
        worker = WorkerRuntime(config, index, channel)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, worker.request_stop, config.connection_termination_deadline)
        if worker.crl is not None:
            worker.crl.start()
        try:
            worker.bind()
        except OSError as e:
            await channel.send(Failed(f"failed to bind the proxy listeners: {e.strerror or e}"))
            channel.close()
            return 1
        return await worker.run()

    try:
        return uvloop.run(main())
    except KeyboardInterrupt:
        return 130
