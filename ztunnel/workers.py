"""One control process and N data-plane worker processes, in both modes.

CPython runs one core per process, so where the reference runs worker threads this runs worker
processes. `ztunnel proxy` is always:

* the parent (`Supervisor`): an `App` without the data plane. It alone does the control work: the
  local config, the one xDS stream, the CA client and the certificates (one request per identity),
  ZDS in in-pod mode, admin (:15000), metrics (:15020) and readiness (:15021). It never carries a
  proxied connection;
* a fork server, forked from the parent before its event loop starts (so before gRPC can have
  started a thread) and after the heavy imports (so workers share that memory copy-on-write). Every
  worker, the first ones and each replacement, is forked from it;
* `worker_threads` workers (`WorkerRuntime`), each owning only listeners and connections: the proxy
  listeners of the dedicated workload, or in in-pod mode each pod's listeners in the pod's network
  namespace (and ztunnel's own HBONE listener), all bound with `SO_REUSEPORT`, so the kernel spreads
  new connections over the workers.

Parent and worker talk over one `SOCK_SEQPACKET` socket pair (`Channel`) in small typed messages
(the dataclasses below). The parent ships the applied state as deltas (`StateChanges`: the model's
own dataclasses, recorded by `ReplicatedState` as the xDS client or the local file change the
store), answers certificate requests (`CertificateRequest` -> `CertificateReply`: chain, key and
roots bytes), passes each pod's namespace fd (`PodAdd`, `SCM_RIGHTS`) and collects the traffic
counters (`Scrape` -> `Counters`). Workers never talk to a control plane.

Dedicated mode: before any worker binds, the parent binds every listener address itself without
`SO_REUSEPORT` (so any other holder of the address is an error naming it) and keeps, for its
lifetime, an abstract Unix socket named after the address as a lock (so a second proxy starting at
the same moment cannot slip in while our workers bind); only then do the workers join the address
with `SO_REUSEPORT`. In-pod mode does neither: a new ztunnel binding beside the old one during an
upgrade (`INPOD_PORT_REUSE`) is the point there.

Readiness: the `proxy` task is pending until every worker's listeners accept, and again whenever a
worker is down: dead, or its loop has not answered the parent's ping for 5 s. A worker that dies is forked again (after 0.5 s, doubling up to 10 s while it keeps
dying young); the others keep serving. In in-pod mode a pod is ACKed only once every running worker
has its listeners up, and a pod delete drains it in every worker. Workers die with the parent
(`PR_SET_PDEATHSIG`, and they stop when their channel closes); the parent drains them on shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import dataclasses
import errno
import gc
import logging
import os
import pickle
import select
import signal
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import uvloop
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from hbone.identity import Identity
from hbone.tls import TlsPolicy, WorkloadCertificate
from policy.model import Authorization
from xds.localconfig import LocalConfig
from xds.model import Service, Workload
from ztunnel import logs, profiling
from ztunnel.admin import ReadinessHandle
from ztunnel.app import App, StartupError, socket_options
from ztunnel.certificates import CaError, CertificateUnavailable, SecretManager
from ztunnel.config import Config, WorkloadInfo
from ztunnel.crl import CrlWatcher
from ztunnel.metrics import (
    OPENMETRICS_CONTENT_TYPE,
    TEXT_CONTENT_TYPE,
    Metrics,
    render_openmetrics,
    wants_openmetrics,
)
from ztunnel.proxy.instance import ProxyInputs, ProxyInstance, build_proxy
from ztunnel.sockets import SocketFactory
from ztunnel.state import ProxyState

log = logging.getLogger("ztunnel.workers")

SNAPSHOT_INTERVAL = 1.0
SCRAPE_TIMEOUT = 1.0
HEARTBEAT_INTERVAL = 1.0
POD_ANSWER_TIMEOUT = 4.0
# How long past its own sampling the parent waits for the workers' profiles.
PROFILE_GRACE = 5.0
HEARTBEAT_TIMEOUT = 5.0
# The families the workers count (the parent shows their sums): connections, DNS, CRL refusals.
DATA_PLANE_PREFIXES = ("istio_tcp_", "istio_dns_", "istio_on_demand_dns", "istio_crl_")
RESTART_DELAY = 0.5
RESTART_DELAY_MAX = 10.0
# A worker that ran at least this long before dying is restarted after the shortest delay again.
STABLE_AFTER = 10.0
# A certificate request for the certificate the worker already has waits this long for a newer one
# (the parent rotates at the same half-life as the worker).
NEWER_CERT_WAIT = 5.0
CHUNK = 60 * 1024
_MORE, _LAST = b"\x01", b"\x00"
PR_SET_PDEATHSIG = 1

LabelPairs = tuple[tuple[str, str], ...]


# -- the messages --------------------------------------------------------------------------------
# They cross only the socket pair between a parent and the workers it forked (the same program), so
# pickle is the codec: the model's frozen dataclasses travel as they are, with no second schema.

StateOp = (
    tuple[str]  # ("clear",)
    | tuple[str, Workload]  # ("workload", w)
    | tuple[str, Service]  # ("service", s)
    | tuple[str, Authorization]  # ("policy", p)
    | tuple[str, str]  # ("remove" | "remove_service" | "remove_policy", name)
)


@dataclass(frozen=True)
class StateChanges:
    """Parent -> worker: one committed change of the store (a whole snapshot starts with clear)."""

    ops: tuple[StateOp, ...]


@dataclass(frozen=True)
class Synced:
    """Parent -> worker: the first state of every xDS type is in; the listeners may accept."""


@dataclass(frozen=True)
class CertificateRequest:
    """Worker -> parent: the identity's certificate; `known` is the leaf the worker already has."""

    identity: Identity
    known: bytes | None


@dataclass(frozen=True)
class CertificateReply:
    identity: Identity
    certificate: WorkloadCertificate | None
    error: str = ""


@dataclass(frozen=True)
class PodAdd:
    """Parent -> worker, with the pod's network namespace fd: run this pod's proxy."""

    uid: str
    name: str
    namespace: str
    service_account: str
    netns_key: tuple[int, int]
    seq: int = 0  # echoed in the PodResult; 0: nobody waits for it


@dataclass(frozen=True)
class PodDel:
    uid: str
    deadline: float = 0.0
    seq: int = 0


@dataclass(frozen=True)
class PodResult:
    """Worker -> parent: the outcome of a PodAdd ("" = listening) or a PodDel."""

    uid: str
    error: str = ""
    seq: int = 0


@dataclass(frozen=True)
class Scrape:
    seq: int


@dataclass(frozen=True)
class Counters:
    """Worker -> parent: the worker's traffic counters (as asked by Scrape `seq`, or 0: pushed)."""

    seq: int
    families: dict[str, Any]
    # Each pod's open connections in this worker, as `workloadState` lists them; only an answer to a
    # scrape lists them (None: a periodic push, which says nothing of them).
    pods: dict[str, dict[str, list[dict[str, str]]]] | None = None


@dataclass(frozen=True)
class ProfileRequest:
    """Parent -> worker: sample this process (`kind` "cpu" or "heap") for `seconds`."""

    seq: int
    kind: str
    seconds: float
    frequency: int = 0


@dataclass(frozen=True)
class ProfileReply:
    """Worker -> parent: the profile (`Profile.as_dict()`), or why there is none."""

    seq: int
    profile: dict[str, Any] | None
    error: str = ""


@dataclass(frozen=True)
class Ping:
    """Parent -> worker, every second: a worker whose loop does not answer for a while is down."""


@dataclass(frozen=True)
class Pong:
    pass


@dataclass(frozen=True)
class Ready:
    """Worker -> parent: every listener of the worker accepts."""


@dataclass(frozen=True)
class Failed:
    """Worker -> parent: start-up failed (the worker exits)."""

    error: str


@dataclass(frozen=True)
class LogFilter:
    """Parent -> worker: the log filter now in force (set over the admin `/logging`)."""

    spec: str


@dataclass(frozen=True)
class Stop:
    deadline: float


# -- the channel ----------------------------------------------------------------------------------


def _encode(message: object) -> list[bytes]:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    chunks = [data[i : i + CHUNK] for i in range(0, len(data), CHUNK)] or [b""]
    return [(_LAST if i == len(chunks) - 1 else _MORE) + c for i, c in enumerate(chunks)]


def _recv_packet(sock: socket.socket) -> tuple[bytes, list[int]]:
    data, fds, flags, _ = socket.recv_fds(sock, CHUNK + 1, 4, socket.MSG_CMSG_CLOEXEC)
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        for fd in fds:
            os.close(fd)
        raise ConnectionError("truncated packet on the worker channel")
    return data, fds


class Channel:
    """Messages (and fds) over a SOCK_SEQPACKET socket; large ones in chunks, fds on the last."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        sock.setblocking(False)
        self._lock = asyncio.Lock()
        self.closed = False

    async def send(self, message: object, fds: Sequence[int] = ()) -> None:
        packets = _encode(message)
        async with self._lock:
            for i, packet in enumerate(packets):
                await self._send_packet(packet, list(fds) if i == len(packets) - 1 else [])

    async def _send_packet(self, packet: bytes, fds: list[int]) -> None:
        await self._io(lambda: socket.send_fds(self.sock, [packet], fds), writable=True)

    async def recv(self) -> tuple[object, list[int]] | None:
        """The next message and its fds; None once the peer is gone."""
        parts: list[bytes] = []
        while True:
            data, fds = await self._io(lambda: _recv_packet(self.sock), writable=False)
            if not data:
                return None
            parts.append(data[1:])
            if data[:1] == _LAST:
                return pickle.loads(b"".join(parts)), fds
            for fd in fds:
                os.close(fd)

    async def _io(self, call: Any, *, writable: bool) -> Any:
        loop = asyncio.get_running_loop()
        fd = self.sock.fileno()
        while True:
            try:
                return call()
            except (BlockingIOError, InterruptedError):
                pass
            ready: asyncio.Future[None] = loop.create_future()
            (loop.add_writer if writable else loop.add_reader)(fd, _wake, ready)
            try:
                await ready
            finally:
                (loop.remove_writer if writable else loop.remove_reader)(fd)

    def close(self) -> None:
        self.closed = True
        self.sock.close()


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


# -- the store, replicated -------------------------------------------------------------------------


class ReplicatedState(ProxyState):
    """The parent's store: every committed change is also handed to `publish` as one StateChanges."""

    def __init__(self) -> None:
        super().__init__()
        self._journal: list[StateOp] = []
        self._depth = 0  # ops inside ops (a service removed by name) are recorded once
        self._batches = 0
        self.publish: Callable[[StateChanges], None] | None = None

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
            if self.publish is not None:
                self.publish(StateChanges(ops))

    def snapshot(self) -> StateChanges:
        ops: list[StateOp] = [("clear",)]
        ops += [("workload", w) for w in self.workloads()]
        ops += [("service", s) for s in self.services()]
        ops += [("policy", p) for p in self.policies()]
        return StateChanges(tuple(ops))

    def upsert_workload(self, w: Workload) -> None:
        with self._op(("workload", w)):
            super().upsert_workload(w)

    def remove(self, name: str) -> bool:
        with self._op(("remove", name)):
            return super().remove(name)

    def upsert_service(self, s: Service) -> None:
        with self._op(("service", s)):
            super().upsert_service(s)

    def remove_service(self, key: str) -> bool:
        with self._op(("remove_service", key)):
            return super().remove_service(key)

    def upsert_policy(self, p: Authorization) -> None:
        with self._op(("policy", p)):
            super().upsert_policy(p)

    def remove_policy(self, key: str) -> bool:
        with self._op(("remove_policy", key)):
            return super().remove_policy(key)

    def apply_local_config(self, cfg: LocalConfig) -> None:
        with self.batch():
            if self._depth == 0:
                self._journal.append(("clear",))  # then the file's upserts, one by one
            super().apply_local_config(cfg)


def apply_changes(state: ProxyState, changes: StateChanges) -> None:
    """A worker applies one change of the parent's store, with one notification."""
    with state.batch():
        for op in changes.ops:
            kind, arg = op[0], op[-1]
            if kind == "clear":
                state.apply_local_config(LocalConfig())
            elif isinstance(arg, Workload):
                state.upsert_workload(arg)
            elif isinstance(arg, Service):
                state.upsert_service(arg)
            elif isinstance(arg, Authorization):
                state.upsert_policy(arg)
            elif kind == "remove":
                state.remove(arg)
            elif kind == "remove_service":
                state.remove_service(arg)
            elif kind == "remove_policy":
                state.remove_policy(arg)


# -- metrics: what a worker reports, and the parent's sum ---------------------------------------


def traffic_snapshot(metrics: Metrics) -> dict[str, Any]:
    """The data-plane counters of one process (connections, DNS, CRL refusals; histograms too):
    `{family: {"type": …, "help": …, "samples": [[sample name, labels, value]]}}`.

    Labels travel as pairs, so the label order of the reference survives the trip.
    """
    out: dict[str, Any] = {}
    for family in metrics.registry.collect():
        if family.type not in ("counter", "histogram") or not family.name.startswith(DATA_PLANE_PREFIXES):
            continue
        samples = [
            [s.name, list(s.labels.items()), s.value]
            for s in family.samples
            if not s.name.endswith("_created")
        ]
        if samples:
            out[family.name] = {"type": family.type, "help": family.documentation, "samples": samples}
    return out


SampleKey = tuple[str, str, LabelPairs]  # (family, sample name, labels in emission order)


class TrafficSums(Collector):
    """The parent's view of the workers' counters: latest report per live worker + retired totals."""

    def __init__(self) -> None:
        self.meta: dict[str, tuple[str, str]] = {}  # family -> (type, help)
        self.live: dict[int, dict[SampleKey, float]] = {}
        self.retired: dict[SampleKey, float] = {}

    def report(self, worker: int, snapshot: dict[str, Any]) -> None:
        values: dict[SampleKey, float] = {}
        for name, family in snapshot.items():
            self.meta[name] = (str(family.get("type", "counter")), str(family.get("help", "")))
            for sample, labels, value in family["samples"]:
                values[(name, str(sample), tuple((str(k), str(v)) for k, v in labels))] = float(value)
        self.live[worker] = values

    def retire(self, worker: int) -> None:
        """A worker is gone: its last report becomes part of the totals for good."""
        for key, value in self.live.pop(worker, {}).items():
            self.retired[key] = self.retired.get(key, 0.0) + value

    def totals(self) -> dict[SampleKey, float]:
        out = dict(self.retired)
        for values in self.live.values():
            for key, value in values.items():
                out[key] = out.get(key, 0.0) + value
        return out

    def opened(self, worker: int, reporter: str | None = None) -> int:
        """Connections the worker opened (by `reporter`: source = outbound, destination = inbound)."""
        return int(
            sum(
                v
                for (name, _, labels), v in self.live.get(worker, {}).items()
                if name == "istio_tcp_connections_opened"
                and (reporter is None or ("reporter", reporter) in labels)
            )
        )

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        # Samples in the order the workers report them (a histogram's buckets ascending).
        for (name, sample, labels), value in self.totals().items():
            family = families.get(name)
            if family is None:
                kind, documentation = self.meta.get(name, ("counter", ""))
                family = families[name] = Metric(name, documentation, kind)
            family.add_sample(sample, dict(labels), value)
        yield from (families[name] for name in sorted(families))


class _SummedView(Collector):
    """The parent's own families, except those the workers' sums replace, then the sums."""

    def __init__(self, own: CollectorRegistry, sums: TrafficSums) -> None:
        self.own = own
        self.sums = sums

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        summed = list(self.sums.collect())
        names = {f.name for f in summed}
        yield from (f for f in self.own.collect() if f.name not in names)
        yield from summed


class SummedMetrics(Metrics):
    """The parent's metrics: its own registry (build info, process, xDS), then the workers' sums."""

    def __init__(self, sums: TrafficSums, istio_version: str) -> None:
        super().__init__(istio_version=istio_version)
        self.sums = sums
        self._view = CollectorRegistry(auto_describe=False)
        self._view.register(_SummedView(self.registry, sums))

    def render(self, accept_header: str | None) -> tuple[bytes, str]:
        content_type = OPENMETRICS_CONTENT_TYPE if wants_openmetrics(accept_header) else TEXT_CONTENT_TYPE
        return render_openmetrics(self._view), content_type


# -- the fork server -----------------------------------------------------------------------------


def _set_pdeathsig(sig: int) -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)


def start_fork_server(config: Config) -> tuple[int, socket.socket]:
    """Fork the fork server now (before any event loop or gRPC thread); its pid and our end."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # the fork server
        code = 1
        try:
            ours.close()
            _set_pdeathsig(signal.SIGKILL)
            if os.getppid() != parent:
                os._exit(0)
            code = _fork_server(config, theirs)
        finally:
            os._exit(code)
    theirs.close()
    return pid, ours


def _fork_server(config: Config, sock: socket.socket) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when everything stops
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    # What the imports made is the workers' for their lifetime: out of the collector's sight, its
    # pages are neither walked by each collection nor copied by one writing their GC headers.
    gc.collect()
    gc.freeze()
    me = os.getpid()
    while True:
        try:
            readable, _, _ = select.select([sock.fileno(), wake_r], [], [])
        except InterruptedError:
            continue
        if wake_r in readable:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 512)
            while True:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                socket.send_fds(sock, _encode(("exited", pid, os.waitstatus_to_exitcode(status))), [])
        if sock.fileno() in readable:
            try:
                data, fds = _recv_packet(sock)
            except (ConnectionError, OSError):
                return 0
            if not data:
                return 0  # the parent is gone; our children follow us (PR_SET_PDEATHSIG)
            _, index = pickle.loads(data[1:])
            pid = os.fork()
            if pid == 0:  # a worker
                code = 1
                try:
                    signal.set_wakeup_fd(-1)
                    for fd in (wake_r, wake_w):
                        os.close(fd)
                    sock.close()
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    _set_pdeathsig(signal.SIGKILL)
                    if os.getppid() != me:
                        os._exit(0)
                    code = run_worker(config, index, fds[0])
                finally:
                    logging.shutdown()
                    os._exit(code)
            for fd in fds:
                os.close(fd)
            socket.send_fds(sock, _encode(("spawned", index, pid)), [])


# -- a worker -------------------------------------------------------------------------------------


class ParentCa:
    """A worker's CA: the parent, which holds the one copy of every certificate."""

    def __init__(self, channel: Channel) -> None:
        self._channel = channel
        self._waiting: dict[Identity, list[asyncio.Future[CertificateReply]]] = {}
        self._known: dict[Identity, bytes] = {}

    async def fetch(self, identity: Identity) -> WorkloadCertificate:
        fut: asyncio.Future[CertificateReply] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(identity, []).append(fut)
        await self._channel.send(CertificateRequest(identity, self._known.get(identity)))
        reply = await fut
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

    def parent_gone(self) -> None:
        for waiting in self._waiting.values():
            for fut in waiting:
                if not fut.done():
                    fut.set_exception(CaError("the parent process is gone"))
        self._waiting.clear()


class WorkerRuntime:
    """One data-plane worker: the listeners and connections, nothing of the control plane."""

    def __init__(self, config: Config, index: int, channel: Channel) -> None:
        self.config = config
        self.index = index
        self.channel = channel
        self.state = ProxyState()
        # Only the traffic counters are reported to the parent: no /proc reads for process_* here.
        self.metrics = Metrics(config.istio_version, process_metrics=False)
        self.ca = ParentCa(channel)
        # The CRL is a local file, not control-plane state: each worker watches it for its contexts.
        self.crl = CrlWatcher.load(config.crl_path, self.metrics) if config.crl_path else None
        tls = TlsPolicy(tls12=config.tls12_enabled, revocation=self.crl.revocation if self.crl else None)
        self.secrets = SecretManager(self.ca, tls=tls)
        self.options = socket_options(config, workers=True)
        self.proxies: list[ProxyInstance] = []
        self.pods: Any = None  # in-pod mode: LocalPods
        self.netns: dict[str, Any] = {}  # uid -> Netns
        self.actions: asyncio.Queue[tuple[object, list[int]]] = asyncio.Queue()
        self._profiles: set[asyncio.Task[None]] = set()
        self.stopped = asyncio.Event()
        self.exit_code = 0

    def bind(self) -> None:
        """Bind this worker's own listeners (the dedicated workload's, or ztunnel's own HBONE one)."""
        cfg = self.config
        if cfg.proxy_mode == "dedicated":
            assert cfg.workload_info is not None
            proxy = self._instance(cfg.workload_info, SocketFactory(self.options))
            self.proxies.append(proxy)
            return
        from ztunnel.inpod.manager import LocalPods
        from ztunnel.inpod.netns import NetnsSocketFactory

        def build(pod: Any, netns: Any) -> ProxyInstance:
            info = WorkloadInfo(namespace=pod.namespace, name=pod.name, service_account=pod.service_account)
            return self._instance(info, NetnsSocketFactory(netns, self.options))

        self.pods = LocalPods(build)
        if cfg.pod_name and cfg.pod_namespace and cfg.service_account:
            info = WorkloadInfo(
                namespace=cfg.pod_namespace, name=cfg.pod_name, service_account=cfg.service_account
            )
            self.proxies.append(self._instance(info, SocketFactory(self.options), inbound_only=True))

    def _instance(
        self, info: WorkloadInfo, factory: SocketFactory, *, inbound_only: bool = False
    ) -> ProxyInstance:
        inputs = ProxyInputs(self.config, self.state, self.secrets, self.metrics)
        return build_proxy(inputs, info, factory, inbound_only=inbound_only)

    async def run(self) -> int:
        reader = asyncio.get_running_loop().create_task(self._read())
        pusher = asyncio.get_running_loop().create_task(self._push_counters())
        try:
            while True:
                message, fds = await self.actions.get()
                if isinstance(message, Stop):
                    await self._drain(message.deadline)
                    break
                await self._act(message, fds)
        finally:
            pusher.cancel()
            reader.cancel()
            with contextlib.suppress(OSError, RuntimeError):
                await self.channel.send(self._counters(0))
            self.channel.close()
        return self.exit_code

    async def _read(self) -> None:
        """Messages that need an answer now are handled here; the rest go to the action queue in
        order (a pod's start waits for its certificate, which comes in on this same channel)."""
        while True:
            try:
                got = await self.channel.recv()
            except OSError:
                got = None
            if got is None:
                self.ca.parent_gone()
                self.actions.put_nowait((Stop(0.0), []))  # the parent is gone: never outlive it
                return
            message, fds = got
            if isinstance(message, StateChanges):
                apply_changes(self.state, message)
            elif isinstance(message, CertificateReply):
                self.ca.answer(message)
            elif isinstance(message, Scrape):
                await self.channel.send(self._counters(message.seq))
            elif isinstance(message, Ping):
                await self.channel.send(Pong())
            elif isinstance(message, ProfileRequest):
                task = asyncio.get_running_loop().create_task(self._profile(message))
                self._profiles.add(task)
                task.add_done_callback(self._profiles.discard)
            elif isinstance(message, LogFilter):
                with contextlib.suppress(ValueError):
                    logs.set_filter(message.spec, True)
            else:
                self.actions.put_nowait((message, fds))

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
            await self._pod_add(message, fds)
        elif isinstance(message, PodDel):
            await self._pod_stop(message.uid, message.deadline)
            await self.channel.send(PodResult(message.uid, seq=message.seq))
        else:
            for fd in fds:
                os.close(fd)

    async def _pod_add(self, message: PodAdd, fds: list[int]) -> None:
        from ztunnel.inpod.netns import Netns
        from ztunnel.inpod.protocol import PodInfo

        if len(fds) != 1 or self.pods is None:
            for fd in fds:
                os.close(fd)
            await self.channel.send(PodResult(message.uid, "no network namespace", message.seq))
            return
        current = self.netns.get(message.uid)
        if current is not None and current.key == message.netns_key:
            os.close(fds[0])  # already running in that namespace
            await self.channel.send(PodResult(message.uid, seq=message.seq))
            return
        if current is not None:
            await self._pod_stop(message.uid, 0.0)
        netns = Netns(fds[0], message.netns_key)
        pod = PodInfo(message.uid, message.name, message.namespace, message.service_account)
        error = await self.pods.start(pod, netns)
        if error is None:
            self.netns[message.uid] = netns
        else:
            netns.close()
        await self.channel.send(PodResult(message.uid, error or "", message.seq))

    async def _pod_stop(self, uid: str, deadline: float) -> None:
        netns = self.netns.pop(uid, None)
        if netns is None:
            return
        await self.pods.stop(uid, deadline)
        netns.close()

    async def _drain(self, deadline: float) -> None:
        drains = [proxy.drain(deadline, graceful=deadline > 0) for proxy in self.proxies]
        drains += [self._pod_stop(uid, deadline) for uid in list(self.netns)]
        await asyncio.gather(*drains, return_exceptions=True)
        await self.secrets.close()
        if self.crl is not None:
            await self.crl.close()

    def _counters(self, seq: int) -> Counters:
        pods = {}
        if self.pods is not None:
            pods = {uid: p.connections_dump() for uid, p in self.pods.instances.items()}
        return Counters(seq, traffic_snapshot(self.metrics), pods)

    async def _profile(self, request: ProfileRequest) -> None:
        """Sample this worker as the parent asked, beside its connections (the loop keeps running)."""
        try:
            profile = await _collect_profile(request.kind, request.seconds, request.frequency)
            reply = ProfileReply(request.seq, profile.as_dict())
        except Exception as e:
            reply = ProfileReply(request.seq, None, str(e) or type(e).__name__)
        with contextlib.suppress(OSError):
            await self.channel.send(reply)

    async def _push_counters(self) -> None:
        """About once a second when they changed, so a worker killed outright loses at most that."""
        last: dict[str, Any] | None = None
        while True:
            await asyncio.sleep(SNAPSHOT_INTERVAL)
            snapshot = traffic_snapshot(self.metrics)
            if snapshot != last:
                with contextlib.suppress(OSError):
                    await self.channel.send(Counters(0, snapshot))
                last = snapshot


async def _collect_profile(kind: str, seconds: float, frequency: int) -> profiling.Profile:
    """This process's `cpu` (sampled at `frequency`) or `heap` profile over `seconds`."""
    if kind == "cpu":
        return await profiling.collect_cpu_profile(seconds, frequency)
    return await profiling.collect_heap_profile(seconds)


def run_worker(config: Config, index: int, fd: int) -> int:
    """The body of a forked worker process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C is the parent's to handle

    async def main() -> int:
        channel = Channel(socket.socket(fileno=fd))
        worker = WorkerRuntime(config, index, channel)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(
            signal.SIGTERM,
            lambda: worker.actions.put_nowait((Stop(config.connection_termination_deadline), [])),
        )
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


# -- the parent -----------------------------------------------------------------------------------


@dataclass
class WorkerSlot:
    index: int
    pid: int | None = None
    state: str = "starting"  # starting | ready | unresponsive | restarting | stopped
    answered: float = 0.0  # when its loop last answered (monotonic)
    restarts: int = 0
    started_at: float = 0.0
    delay: float = RESTART_DELAY
    channel: Channel | None = None
    outbox: asyncio.Queue[tuple[object, list[int]]] = field(default_factory=asyncio.Queue)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    pod_waiters: dict[int, asyncio.Future[str]] = field(default_factory=dict)  # by request seq
    profile_waiters: dict[int, asyncio.Future[ProfileReply]] = field(default_factory=dict)
    pod_connections: dict[str, dict[str, list[dict[str, str]]]] = field(default_factory=dict)
    scrape: asyncio.Future[None] | None = None
    scrape_seq: int = 0
    gone: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def alive(self) -> bool:
        return self.channel is not None and not self.channel.closed

    def send(self, message: object, fds: Sequence[int] = ()) -> None:
        if self.alive:
            self.outbox.put_nowait((message, list(fds)))


class WorkerPods:
    """In-pod mode's `PodRuntime` in the parent: every worker runs each pod's proxy."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor
        self.pods: dict[str, tuple[PodAdd, Any]] = {}  # uid -> (message, Netns), in every worker

    async def start(self, pod: Any, netns: Any) -> str | None:
        message = PodAdd(pod.uid, pod.name, pod.namespace, pod.service_account, netns.key)
        self.pods[pod.uid] = (message, netns)
        results = await self.supervisor.ask_all(message, [netns.fd])
        errors = [f"worker {i}: {e}" for i, e in results.items() if e]
        if not errors:
            return None
        del self.pods[pod.uid]
        self.supervisor.tell_all(PodDel(pod.uid))  # undone where it did start; the NACK goes now
        return "; ".join(errors)

    async def stop(self, uid: str, deadline: float) -> None:
        entry = self.pods.pop(uid, None)
        if entry is None:
            return
        await self.supervisor.ask_all(PodDel(uid, deadline))
        message = entry[0]
        identity = self.supervisor.identity_of(message.name, message.namespace, message.service_account)
        still_used = any(
            self.supervisor.identity_of(m.name, m.namespace, m.service_account) == identity
            for m, _ in self.pods.values()
        )
        if not still_used and self.supervisor.app.secrets is not None:
            self.supervisor.app.secrets.forget(identity)

    def describe(self, uid: str) -> dict[str, Any]:
        """The pod's open connections in every worker (as of their last report: `/config_dump` asks
        for a fresh one first)."""
        alive = [s for s in self.supervisor.slots if s.alive]
        connections: dict[str, list[dict[str, str]]] = {"inbound": [], "outbound": []}
        for slot in alive:
            for direction, entries in slot.pod_connections.get(uid, {}).items():
                connections.setdefault(direction, []).extend(entries)
        for entries in connections.values():
            entries.sort(key=lambda e: (e.get("src", ""), e.get("originalDst", "")))
        return {"workers": len(alive), "connections": connections}


class _ListenerCheck(SocketFactory):
    """The parent's exclusive check of the dedicated listeners' addresses (never served)."""

    def __init__(self, supervisor: Supervisor) -> None:
        super().__init__(socket_options(supervisor.config))
        self.supervisor = supervisor

    def listener(self, host: str, port: int, *, transparent: bool = False) -> socket.socket:
        where = f"{host or '[::]'}:{port}"
        try:
            sock = super().listener(host, port, transparent=transparent)
        except OSError as e:
            raise OSError(e.errno, f"{where}: {e.strerror or e}") from None
        lock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            lock.bind(f"\0ztunnel-listener {where}")
        except OSError as e:
            lock.close()
            sock.close()
            if e.errno == errno.EADDRINUSE:
                raise OSError(e.errno, f"{where}: in use by another ztunnel") from None
            raise OSError(e.errno, f"{where}: {e.strerror or e}") from None
        self.supervisor.locks.append(lock)
        return sock


class Supervisor:
    """The parent process: the control work and the operator endpoints; connections in the workers."""

    def __init__(self, config: Config, fork_server: tuple[int, socket.socket]) -> None:
        self.config = config
        self.count = max(1, config.worker_threads)
        self.sums = TrafficSums()
        self.state = ReplicatedState()
        self.state.publish = self._publish
        self.app = App(config)
        self.app.state = self.state
        self.app.data_plane = False
        self.app.metrics = SummedMetrics(self.sums, config.istio_version)
        self.app.before_scrape = self.scrape
        self.app.on_log_filter = self._publish_log_filter
        self.app.profilers = (
            lambda seconds, frequency: self.profile("cpu", seconds, frequency),
            lambda seconds: self.profile("heap", seconds),
        )
        self._app_dump = self.app.config_dump
        # The admin server takes these bound methods at start-up; ours add the workers.
        self.app.config_dump = self.config_dump  # type: ignore[method-assign]
        self.app.shutdown = self.shutdown  # type: ignore[method-assign]
        self.pods = WorkerPods(self)
        if config.proxy_mode == "shared":
            self.app.pod_runtime = self.pods
        self.slots = [WorkerSlot(i) for i in range(self.count)]
        self.locks: list[socket.socket] = []
        self.synced = False
        self._fork_pid, fork_sock = fork_server
        self._fork = Channel(fork_sock)
        self._stop = asyncio.Event()
        self._stopping = False
        self._proxy_ready: ReadinessHandle | None = None
        self._started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._seq = 0
        self._tasks: set[asyncio.Task[None]] = set()

    # -- what the workers ask and are told --------------------------------------------------------

    def _publish(self, changes: StateChanges) -> None:
        self.tell_all(changes)

    def _publish_log_filter(self, spec: str) -> None:
        self.tell_all(LogFilter(spec))

    def identity_of(self, name: str, namespace: str, service_account: str) -> Identity:
        w = self.state.find_local_workload(name, namespace, service_account, self.config.node_name)
        td = (w.trust_domain if w else "") or self.config.trust_domain
        return Identity(td, namespace, service_account)

    async def ask_all(self, message: PodAdd | PodDel, fds: Sequence[int] = ()) -> dict[int, str]:
        """Send a pod message to every running worker and wait for each one's result."""
        self._seq += 1
        seq = self._seq
        message = dataclasses.replace(message, seq=seq)
        waits: dict[int, asyncio.Future[str]] = {}
        for slot in self.slots:
            if not slot.alive:
                continue  # a worker being replaced gets every pod when it starts
            fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
            slot.pod_waiters[seq] = fut
            waits[slot.index] = fut
            slot.send(message, fds)
        if waits:
            # Inside the node agent's own deadline for an answer: a pod a worker is slow to start is
            # NACKed, and retried (a worker already running it then just says so).
            await asyncio.wait(waits.values(), timeout=POD_ANSWER_TIMEOUT)
        for slot in self.slots:
            slot.pod_waiters.pop(seq, None)
        return {i: f.result() if f.done() else "no answer in time" for i, f in waits.items()}

    async def profile(self, kind: str, seconds: float, frequency: int = 0) -> profiling.Profile:
        """A profile of the whole proxy: this process's and every running worker's, merged (each
        sample keeps its process's `pid` label). A worker that cannot answer is left out, and said so."""
        self._seq += 1
        seq = self._seq
        request = ProfileRequest(seq, kind, seconds, frequency)
        waits: dict[int, asyncio.Future[ProfileReply]] = {}
        for slot in self.slots:
            if slot.alive and slot.state == "ready":
                fut: asyncio.Future[ProfileReply] = asyncio.get_running_loop().create_future()
                slot.profile_waiters[seq] = fut
                waits[slot.index] = fut
                slot.send(request)
        try:
            own = await _collect_profile(kind, seconds, frequency)
            if waits:
                await asyncio.wait(waits.values(), timeout=PROFILE_GRACE)
        finally:
            for slot in self.slots:
                slot.profile_waiters.pop(seq, None)
        profiles = [own]
        for index, fut in waits.items():
            reply = fut.result() if fut.done() else None
            if reply is None or reply.profile is None:
                why = reply.error if reply is not None else "no answer in time"
                log.warning("data-plane worker %d left out of the %s profile: %s", index, kind, why)
                continue
            profiles.append(profiling.Profile.from_dict(reply.profile))
        return profiling.merge(profiles)

    def tell_all(self, message: object) -> None:
        """Send `message` to every running worker, expecting no answer."""
        for slot in self.slots:
            slot.send(message)

    async def scrape(self) -> None:
        """Before /metrics: every worker's current counters (a worker that does not answer within
        a second is shown with its last report)."""
        waits = []
        self._seq += 1
        for slot in self.slots:
            if slot.alive and slot.state == "ready":
                slot.scrape = asyncio.get_running_loop().create_future()
                slot.scrape_seq = self._seq
                waits.append(slot.scrape)
                slot.send(Scrape(self._seq))
        if waits:
            await asyncio.wait(waits, timeout=SCRAPE_TIMEOUT)

    async def _answer_certificate(self, slot: WorkerSlot, request: CertificateRequest) -> None:
        secrets = self.app.secrets
        assert secrets is not None
        try:
            cert = await secrets.get(request.identity)
            deadline = time.monotonic() + NEWER_CERT_WAIT
            while (
                cert.chain_pem[0] == request.known and _past_half_life(cert) and time.monotonic() < deadline
            ):
                # The worker rotates at the same half-life as we do: give our rotation a moment.
                # (Before that, the worker just forgot it, e.g. a pod stopped and came back.)
                await asyncio.sleep(0.2)
                cert = await secrets.get(request.identity)
            reply = CertificateReply(request.identity, cert)
        except CertificateUnavailable as e:
            reply = CertificateReply(request.identity, None, str(e) or "certificate unavailable")
        slot.send(reply)

    # -- admin --------------------------------------------------------------------------------------

    def config_dump(self) -> dict[str, Any]:
        dump = dict(self._app_dump())
        dump["workers"] = [
            {
                "index": s.index,
                "pid": s.pid,
                "state": s.state,
                "restarts": s.restarts,
                "connectionsOpened": self.sums.opened(s.index),
                "inboundOpened": self.sums.opened(s.index, "destination"),
                "outboundOpened": self.sums.opened(s.index, "source"),
            }
            for s in self.slots
        ]
        return dump

    def shutdown(self) -> None:
        self._stop.set()

    async def _wait_stop(self) -> None:
        await self._stop.wait()

    # -- readiness ----------------------------------------------------------------------------------

    def _update_readiness(self) -> None:
        ready = all(s.state == "ready" for s in self.slots)
        if ready and self._proxy_ready is not None:
            self._proxy_ready.release()
            self._proxy_ready = None
        elif not ready and self._proxy_ready is None:
            self._proxy_ready = self.app.readiness.register("proxy")

    # -- life cycle ---------------------------------------------------------------------------------

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.shutdown)
        self._update_readiness()
        fork_reader = loop.create_task(self._read_fork_server())
        stop = loop.create_task(self._wait_stop())
        try:
            await self.app.start()
            if self.config.proxy_mode == "dedicated":
                await self._check_listeners()
            for slot in self.slots:
                await self._spawn(slot)
            synced = loop.create_task(self._wait_synced())
            heartbeat = loop.create_task(self._heartbeat())
            await asyncio.wait([self._started, stop], return_when=asyncio.FIRST_COMPLETED)
            if self._started.done():
                self._started.result()  # a worker's start-up error stops start-up
                log.info("%d data-plane workers ready: pids %s", self.count, [s.pid for s in self.slots])
            await stop
        finally:
            stop.cancel()
            with contextlib.suppress(UnboundLocalError):
                synced.cancel()
                heartbeat.cancel()
            if self._started.done() and self._started.exception() is None:
                log.info(
                    "shutting down: draining for up to %ss",
                    self.config.connection_termination_deadline,
                )
            await self._stop_workers()
            await self.app.drain()
            fork_reader.cancel()
            self._fork.close()
        return self.app.exit_code

    async def _check_listeners(self) -> None:
        assert self.config.workload_info is not None and self.app.secrets is not None
        inputs = ProxyInputs(
            self.config,
            ProxyState(),
            self.app.secrets,
            Metrics(self.config.istio_version, process_metrics=False),
        )
        try:
            probe = build_proxy(inputs, self.config.workload_info, _ListenerCheck(self))
        except OSError as e:
            raise StartupError(f"failed to bind the proxy listeners: {e.strerror or e}") from None
        # Closes the sockets: the workers bind these addresses with SO_REUSEPORT; the locks stay.
        await probe.drain(0, graceful=False)

    async def _heartbeat(self) -> None:
        """Readiness means every worker's loop runs: one that stops answering counts as down (its
        listeners may be open, but nothing accepts) until it answers again or dies."""
        while True:
            await asyncio.sleep(HEARTBEAT_INTERVAL)
            now = time.monotonic()
            for slot in self.slots:
                if slot.state == "ready" and now - slot.answered > HEARTBEAT_TIMEOUT:
                    log.warning(
                        "data-plane worker %d (pid %s) has not answered for %.0fs",
                        slot.index,
                        slot.pid,
                        now - slot.answered,
                    )
                    slot.state = "unresponsive"
                    self._update_readiness()
                if slot.state in ("ready", "unresponsive"):
                    slot.send(Ping())

    async def _wait_synced(self) -> None:
        if self.app.xds is not None:
            await self.app.xds.wait_synced()
        self.synced = True
        for slot in self.slots:
            slot.send(Synced())

    async def _spawn(self, slot: WorkerSlot) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            await self._fork.send(("spawn", slot.index), [theirs.fileno()])
        finally:
            theirs.close()
        slot.channel = Channel(ours)
        slot.outbox = asyncio.Queue()
        slot.gone = asyncio.Event()
        slot.pid = None
        slot.state = "starting"
        slot.started_at = time.monotonic()
        # What a new worker is told first: the whole store, the pods, and whether to accept yet.
        slot.send(self.state.snapshot())
        slot.send(LogFilter(logs.current_filter()))
        for message, netns in self.pods.pods.values():
            slot.send(message, [netns.fd])
        if self.synced:
            slot.send(Synced())
        loop = asyncio.get_running_loop()
        slot.tasks = [loop.create_task(self._write(slot)), loop.create_task(self._watch(slot))]

    async def _write(self, slot: WorkerSlot) -> None:
        assert slot.channel is not None
        try:
            while True:
                message, fds = await slot.outbox.get()
                await slot.channel.send(message, fds)
        except OSError:
            pass  # the worker is gone; _watch sees it

    async def _read_fork_server(self) -> None:
        while True:
            try:
                got = await self._fork.recv()
            except OSError:
                got = None
            if got is None:
                if not self._stopping:
                    log.error("the fork server exited; stopping")
                    self.app.exit_code = 1
                    self.shutdown()
                return
            message = got[0]
            assert isinstance(message, tuple)
            if message[0] == "spawned":
                self.slots[message[1]].pid = message[2]
            elif message[0] == "exited":
                _, pid, code = message
                for slot in self.slots:
                    if slot.pid == pid:
                        how = f"signal {-code}" if code < 0 else f"code {code}"
                        (log.info if self._stopping else log.warning)(
                            "data-plane worker %d (pid %d) exited with %s", slot.index, pid, how
                        )

    async def _watch(self, slot: WorkerSlot) -> None:
        channel = slot.channel
        assert channel is not None
        failure = ""
        try:
            while (got := await channel.recv()) is not None:
                message, fds = got
                for fd in fds:
                    os.close(fd)
                slot.answered = time.monotonic()
                if slot.state == "unresponsive":
                    log.warning("data-plane worker %d (pid %s) answers again", slot.index, slot.pid)
                    slot.state = "ready"
                    self._update_readiness()
                if isinstance(message, Ready):
                    slot.state = "ready"
                    self._update_readiness()
                    if all(s.state == "ready" for s in self.slots) and not self._started.done():
                        self._started.set_result(None)
                elif isinstance(message, Counters):
                    self.sums.report(slot.index, message.families)
                    if message.pods is not None:
                        slot.pod_connections = message.pods
                    scrape = slot.scrape
                    if message.seq and message.seq == slot.scrape_seq and scrape and not scrape.done():
                        scrape.set_result(None)
                elif isinstance(message, CertificateRequest):
                    task = asyncio.get_running_loop().create_task(self._answer_certificate(slot, message))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                elif isinstance(message, ProfileReply):
                    waiter = slot.profile_waiters.pop(message.seq, None)
                    if waiter is not None and not waiter.done():
                        waiter.set_result(message)
                elif isinstance(message, PodResult):
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
                elif isinstance(message, Failed):
                    failure = message.error
        except OSError:
            pass
        finally:
            channel.close()
            for task in slot.tasks:
                if task is not asyncio.current_task():
                    task.cancel()
            # A worker that is gone holds up no pod: its replacement gets every pod when it starts.
            for fut in slot.pod_waiters.values():
                if not fut.done():
                    fut.set_result("")
            slot.pod_waiters.clear()
            self.sums.retire(slot.index)
            slot.gone.set()
        if self._stopping:
            slot.state = "stopped"
            return
        slot.state = "restarting"
        self._update_readiness()
        if failure and not self._started.done():
            self._started.set_exception(StartupError(failure))
            return
        ran = time.monotonic() - slot.started_at
        delay = RESTART_DELAY if ran >= STABLE_AFTER else slot.delay
        slot.delay = min(delay * 2, RESTART_DELAY_MAX)  # for the next time, should it die young again
        log.warning(
            "data-plane worker %d (pid %s) is gone%s; starting another in %.1fs",
            slot.index,
            slot.pid,
            f" ({failure})" if failure else "",
            delay,
        )
        await asyncio.sleep(delay)
        if self._stopping:
            slot.state = "stopped"
            return
        slot.restarts += 1
        try:
            await self._spawn(slot)
        except OSError as e:
            log.error("data-plane worker %d: restart failed: %s", slot.index, e)
            slot.state = "stopped"

    async def _stop_workers(self) -> None:
        self._stopping = True
        deadline = self.config.connection_termination_deadline
        for slot in self.slots:
            slot.send(Stop(deadline))
        waits = [asyncio.ensure_future(s.gone.wait()) for s in self.slots if s.alive]
        if waits:
            _, pending = await asyncio.wait(waits, timeout=deadline + 5.0)
            for task in pending:
                task.cancel()
        for slot in self.slots:
            if slot.alive and slot.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(slot.pid, signal.SIGKILL)


def _past_half_life(cert: WorkloadCertificate) -> bool:
    start, end = cert.not_before.timestamp(), cert.not_after.timestamp()
    return time.time() >= start + (end - start) / 2


def run_supervisor(config: Config) -> int:
    # Forked before the event loop (and so before any gRPC thread) and after the heavy imports.
    if config.proxy_mode == "shared":
        import ztunnel.inpod.manager  # noqa: F401  (in the workers' shared memory)
    fork_server = start_fork_server(config)

    async def main() -> int:
        return await Supervisor(config, fork_server).run()

    try:
        return uvloop.run(main())
    finally:
        fork_server[1].close()  # the fork server exits when its channel closes
        _reap(fork_server[0])


def _reap(pid: int, timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return
            time.sleep(0.01)
