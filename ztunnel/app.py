"""Wiring of the node proxy: configuration in, servers up, proxies running, drain on the way out.

Start-up order follows the reference: state first (the local file is applied synchronously), then
readiness, admin and metrics servers, then the proxy listeners are bound (a port conflict stops
start-up) and their accept loops start; `/healthz/ready` turns 200 when nothing is pending.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import platform
import resource
import signal
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from hbone.tls import TlsPolicy
from xds.localconfig import LocalConfig, LocalConfigError, load_local_config, parse_local_config
from ztunnel import __version__
from ztunnel.admin import (
    CpuProfiler,
    HeapProfiler,
    HttpServer,
    Readiness,
    ReadinessHandle,
    admin_server,
    pprof_routes,
    readiness_server,
    stats_server,
)
from ztunnel.certificates import FakeCA, SecretManager
from ztunnel.config import Config, ConfigError, WorkloadInfo
from ztunnel.crl import CrlError, CrlWatcher
from ztunnel.explain import explain_route
from ztunnel.logs import setup_logging
from ztunnel.metrics import Metrics
from ztunnel.proxy.instance import ProxyInputs, ProxyInstance, build_proxy
from ztunnel.sockets import SocketFactory, SocketOptions, user_timeout_ms
from ztunnel.state import ProxyState

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from xds.client import XdsClient
    from ztunnel.caclient import GrpcCaClient
    from ztunnel.inpod.manager import PodRuntime, WorkloadProxyManager
    from ztunnel.inpod.netns import Netns
    from ztunnel.inpod.protocol import PodInfo

log = logging.getLogger("ztunnel.app")


class StartupError(Exception):
    """A start-up failure to report in one line (no traceback)."""


def build_info() -> dict[str, str]:
    return {
        "version": __version__,
        "gitRevision": "unknown",
        "rustVersion": "n/a (CPython)",
        "buildProfile": "release",
        "buildStatus": "Modified",
        "istioVersion": os.environ.get("ISTIO_META_ISTIO_VERSION", "unknown"),
        "cryptoProvider": "openssl",
    }


def raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# glibc's allocator, left to itself, maps each block above an adaptive threshold on its own and
# returns the top of the heap to the kernel once more than twice that is free there. A relay's
# buffers (a TLS write of a few hundred KiB, a payload copied out of a read) are allocated and freed
# on every read, so that adaptive pair ends up mapping, zeroing and unmapping them again and again:
# measured at up to ~175,000 page faults per GiB relayed by the sending proxy, ~15 % of its CPU.
# Fixed thresholds keep blocks up to MALLOC_MMAP_THRESHOLD in the heap and up to
# MALLOC_TRIM_THRESHOLD of free heap for reuse. The glibc environment variables of the same names
# (with a trailing underscore) or GLIBC_TUNABLES win when set.
MALLOC_MMAP_THRESHOLD = 4 << 20
MALLOC_TRIM_THRESHOLD = 16 << 20
_M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
_M_MMAP_THRESHOLD = -3


def tune_allocator(environ: Mapping[str, str]) -> bool:
    """Fix glibc's mmap and trim thresholds for this process and the ones it forks; True if set."""
    if any(k in environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")):
        return False
    if platform.libc_ver()[0] != "glibc":
        return False
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(
        mallopt(_M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD)
        and mallopt(_M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD)
    )


def load_static_config(config: Config) -> LocalConfig | None:
    try:
        if config.local_xds_path:
            return load_local_config(config.local_xds_path)
        if config.local_xds:
            return parse_local_config(config.local_xds, "LOCAL_XDS")
    except LocalConfigError as e:
        raise StartupError(str(e)) from None
    except OSError as e:
        raise StartupError(f"LOCAL_XDS_PATH={config.local_xds_path}: {e.strerror or e}") from None
    return None


def socket_options(cfg: Config, *, workers: bool = False) -> SocketOptions:
    """The proxy sockets' options. `workers`: the listeners are shared by several data-plane worker
    processes, so they join with SO_REUSEPORT whatever `INPOD_PORT_REUSE` says (only ours join in
    dedicated mode: the parent holds each address exclusively first, see ztunnel/workers.py)."""
    shared = cfg.proxy_mode == "shared"
    return SocketOptions(
        keepalive=cfg.keepalive_enabled,
        keepalive_time=int(cfg.keepalive_time),
        keepalive_interval=int(cfg.keepalive_interval),
        keepalive_retries=cfg.keepalive_retries,
        mark=cfg.packet_mark,
        reuseport=workers or (cfg.inpod_port_reuse if shared else False),
        backlog=128 if shared else SocketOptions.backlog,
        user_timeout_ms=user_timeout_ms(cfg),
        ipv6=cfg.ipv6_enabled,
    )


class App:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.state = ProxyState()
        self.metrics = Metrics(istio_version=config.istio_version)
        self.readiness = Readiness()
        try:
            self.crl = CrlWatcher.load(config.crl_path, self.metrics) if config.crl_path else None
        except CrlError as e:
            raise StartupError(str(e)) from None
        # Every TLS context of the process is built under this policy (by the secret manager).
        self.tls = TlsPolicy(tls12=config.tls12_enabled, revocation=self.crl.revocation if self.crl else None)
        self.secrets = SecretManager(FakeCA(), tls=self.tls) if config.fake_ca else None
        self.static: LocalConfig | None = None
        self.proxies: list[ProxyInstance] = []
        self._stop = asyncio.Event()
        self._servers: list[HttpServer] = []
        self._ca: GrpcCaClient | None = None
        self.xds: XdsClient | None = None
        self._xds_task: asyncio.Task[None] | None = None
        self._serving: asyncio.Task[None] | None = None
        # With data-plane workers (ztunnel/workers.py) the parent's App runs without the data plane:
        # in in-pod mode its workload proxy manager starts the pods in `pod_runtime` (the workers),
        # every scrape first collects the workers' counters (`before_scrape`), and a log filter set
        # over /logging is passed on to them (`on_log_filter`).
        self.data_plane = True
        self.pod_runtime: PodRuntime | None = None
        self.before_scrape: Callable[[], Awaitable[None]] | None = None
        self.on_log_filter: Callable[[str], object] | None = None
        # With data-plane workers, profilers that sample every process (else this one only).
        self.profilers: tuple[CpuProfiler, HeapProfiler] | None = None
        self.inpod: WorkloadProxyManager | None = None
        self._inpod_task: asyncio.Task[None] | None = None
        self.exit_code = 0

    def config_dump(self) -> dict[str, Any]:
        dump: dict[str, Any] = dict(self.state.dump())
        dump["staticConfig"] = self.static.raw if self.static is not None else {}
        dump["version"] = build_info()
        dump["config"] = self.config.to_dump()
        dump["certificates"] = self.secrets.dump() if self.secrets else []
        if self.inpod is not None:
            dump["workloadState"] = self.inpod.dump()
        return dump

    def shutdown(self) -> None:
        self._stop.set()

    async def start(self) -> None:
        cfg = self.config
        if cfg.proxy_mode == "shared":
            # In-pod mode's modules (and protobuf, for ZDS) are loaded only when it runs.
            from ztunnel.inpod.netns import check_privileges

            try:
                check_privileges(cfg.packet_mark)
            except OSError as e:
                raise StartupError(f"PROXY_MODE=shared (in-pod mode): {e.strerror or e}") from None
        if cfg.xds_address or self.secrets is None:
            # gRPC and the protocol modules cost ~15 MB of RSS: loaded only when a control plane is used.
            from xds.client import AuthToken, XdsClient, node_from
            from ztunnel.caclient import GrpcCaClient

            token = AuthToken.from_setting(cfg.auth_token)
        if self.secrets is None:
            if not cfg.ca_address:
                raise StartupError("CA_ADDRESS is empty and FAKE_CA is not set: no way to get certificates")
            self._ca = GrpcCaClient(
                cfg.ca_address,
                root_ca=cfg.ca_root_ca,
                alt_hostname=cfg.alt_ca_hostname,
                token=token,
                cluster_id=cfg.cluster_id,
                headers=cfg.ca_headers,
                secret_ttl=cfg.secret_ttl,
                impersonate=cfg.proxy_mode == "shared",
            )
            self.secrets = SecretManager(self._ca, tls=self.tls)
        self.static = load_static_config(cfg)
        if self.crl is not None:
            self.crl.start()
        state_task = self.readiness.register("state manager")
        proxy_task = self.readiness.register("proxy")
        # Released once the proxies (and with them the DNS servers) are made, as the reference.
        dns_task = self.readiness.register("dns proxy") if cfg.dns_capture else None
        # The local file is applied first; xDS (if any) then builds on it.
        if self.static is not None:
            self.state.apply_local_config(self.static)
        if cfg.xds_address:
            self.xds = XdsClient(
                cfg.xds_address,
                self.state,
                node_from(
                    instance_ip=cfg.instance_ip,
                    pod_name=cfg.pod_name,
                    pod_namespace=cfg.pod_namespace,
                    node_name=cfg.node_name,
                    istio_meta=cfg.istio_meta,
                    istio_meta_json=cfg.istio_meta_json,
                    cluster_id=cfg.cluster_id,
                ),
                root_ca=cfg.xds_root_ca,
                alt_hostname=cfg.alt_xds_hostname,
                token=token,
                cluster_id=cfg.cluster_id,
                headers=cfg.xds_headers,
                on_demand=cfg.xds_on_demand,
                metrics=self.metrics.xds,
                on_synced=state_task.release,
            )
            self._xds_task = asyncio.get_running_loop().create_task(self.xds.run())
            if cfg.xds_on_demand:
                xds = self.xds
                self.state.demander = lambda key, arrived: xds.demand(key, arrived=arrived)
        else:
            state_task.release()

        operator_servers = (
            (readiness_server(self.readiness), cfg.readiness_address),
            (
                admin_server(
                    self.config_dump,
                    self.shutdown,
                    self.on_log_filter,
                    extra_routes={
                        "/debug/explain": explain_route(self.state, cfg),
                        **(pprof_routes(*self.profilers) if self.profilers else {}),
                    },
                    before_dump=self.before_scrape,
                ),
                cfg.admin_address,
            ),
            (stats_server(self.metrics, self.before_scrape), cfg.stats_address),
        )
        for server, (host, port) in operator_servers:
            try:
                await server.start(host, port)
            except OSError as e:
                raise StartupError(
                    f"failed to bind {server.name} server on {host}:{port}: {e.strerror or e}"
                ) from None
            self._servers.append(server)

        if not self.data_plane:
            proxy_task.release()  # the listeners are the workers'
            if dns_task is not None:
                dns_task.release()
            if cfg.proxy_mode == "shared" and self.pod_runtime is not None:
                self._start_inpod()
            return
        if cfg.proxy_mode == "shared":
            await self._start_self_listener()
            self._start_inpod()
            proxy_task.release()  # each pod's listeners are the workload proxy manager's
            if dns_task is not None:
                dns_task.release()
            return
        assert cfg.workload_info is not None
        try:
            proxy = build_proxy(self._inputs(), cfg.workload_info, SocketFactory(socket_options(self.config)))
        except OSError as e:
            raise StartupError(f"failed to bind the proxy listeners: {e.strerror or e}") from None
        self.proxies.append(proxy)
        if dns_task is not None:
            dns_task.release()
        # The workload's certificate is requested at start-up, without gating readiness.
        self.secrets.prefetch(proxy.own_identity())
        if self.xds is None:
            await self._serve(proxy, proxy_task)
        else:
            # Listeners are bound now; they accept once the first xDS state is in:
            # connections arriving earlier wait in the kernel backlog.
            self._serving = asyncio.get_running_loop().create_task(self._serve(proxy, proxy_task))

    def _inputs(self) -> ProxyInputs:
        assert self.secrets is not None
        return ProxyInputs(self.config, self.state, self.secrets, self.metrics)

    async def _start_self_listener(self) -> None:
        """In-pod mode, when ztunnel knows its own pod (POD_NAME, POD_NAMESPACE, SERVICE_ACCOUNT):
        HBONE on 15008 in its own namespace, so mesh clients reach it, e.g. its metrics."""
        cfg = self.config
        if not (cfg.pod_name and cfg.pod_namespace and cfg.service_account):
            return
        assert self.secrets is not None
        info = WorkloadInfo(
            namespace=cfg.pod_namespace, name=cfg.pod_name, service_account=cfg.service_account
        )
        try:
            proxy = build_proxy(
                self._inputs(), info, SocketFactory(socket_options(self.config)), inbound_only=True
            )
        except OSError as e:
            raise StartupError(f"failed to bind ztunnel's own HBONE listener: {e.strerror or e}") from None
        self.proxies.append(proxy)
        self._serving = asyncio.get_running_loop().create_task(self._serve_self(proxy))

    async def _serve_self(self, proxy: ProxyInstance) -> None:
        if self.xds is not None:
            await self.xds.wait_synced()
        await proxy.serve()

    def _start_inpod(self) -> None:
        """In-pod mode: pods arrive over ZDS once the first xDS state is in."""
        from ztunnel.inpod.manager import LocalPods, WorkloadProxyManager
        from ztunnel.inpod.netns import NetnsSocketFactory

        options = socket_options(self.config)
        secrets = self.secrets
        assert secrets is not None

        def build(pod: PodInfo, netns: Netns) -> ProxyInstance:
            info = WorkloadInfo(namespace=pod.namespace, name=pod.name, service_account=pod.service_account)
            proxy = build_proxy(self._inputs(), info, NetnsSocketFactory(netns, options))
            secrets.prefetch(proxy.own_identity())
            return proxy

        pods = self.pod_runtime if self.pod_runtime is not None else LocalPods(build)
        self.inpod = WorkloadProxyManager(
            self.config.inpod_uds, pods, self.readiness, self.metrics.workload_manager()
        )
        self._inpod_task = asyncio.get_running_loop().create_task(self._run_inpod(self.inpod))

    async def _run_inpod(self, manager: WorkloadProxyManager) -> None:
        from ztunnel.inpod.manager import ProtocolError

        if self.xds is not None:
            await self.xds.wait_synced()
        try:
            await manager.run()
        except ProtocolError:
            self.exit_code = 1  # as the reference: a ZDS protocol error ends the process
            self.shutdown()

    async def _serve(self, proxy: ProxyInstance, ready: ReadinessHandle) -> None:
        if self.xds is not None:
            await self.xds.wait_synced()
        await proxy.serve()
        ready.release()
        log.info(
            "proxy ready: %s",
            ", ".join(f"{name} {h}:{p}" for name, (h, p) in sorted(proxy.addresses.items())),
        )

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.shutdown)
        await self.start()
        await self._stop.wait()
        log.info("shutting down: draining for up to %ss", self.config.connection_termination_deadline)
        await self.drain()
        return self.exit_code

    async def drain(self) -> None:
        deadline = self.config.connection_termination_deadline
        if self._serving is not None:
            self._serving.cancel()
        if self.xds is not None:
            await self.xds.close()
        if self._xds_task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(self._xds_task, 2.0)
        if self._inpod_task is not None:
            self._inpod_task.cancel()
        drains = [p.drain(deadline) for p in self.proxies]
        if self.inpod is not None:
            drains.append(self.inpod.close(deadline))
        await asyncio.gather(*drains, return_exceptions=True)
        for server in self._servers:
            with contextlib.suppress(Exception):
                await server.close()
        if self.secrets is not None:
            await self.secrets.close()
        if self.crl is not None:
            await self.crl.close()
        if self._ca is not None:
            await self._ca.close()


def run_proxy(environ: dict[str, str]) -> int:
    try:
        config = Config.from_env(environ)
    except ConfigError as e:
        raise StartupError(str(e)) from None
    setup_logging(config.log_format, config.log_level)
    raise_fd_limit()
    tune_allocator(environ)
    # One control process and `worker_threads` data-plane worker processes, in both modes.
    from ztunnel.workers import run_supervisor

    return run_supervisor(config)
