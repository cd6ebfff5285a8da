"""The control runtime of `ztunnel proxy`: everything the supervisor process does besides its workers.

It runs the local config file, the one xDS stream, the CA client and the certificates (their
cryptography in a short-lived helper process, `ztunnel/identity/certhelper.py`), the CRL watcher, the
operator endpoints (readiness :15021, admin :15000, metrics :15020) and, in in-pod mode, the
workload proxy manager (ZDS). It carries no proxied connection: the data plane is the workers'.
What the supervisor adds is given at construction (`ControlHooks`): the store it
replicates, the metrics that sum the workers', the hooks the endpoints call (a scrape first asks
the workers, a log filter is passed on to them, profilers sample every process, `/config_dump`
adds the workers, `/quitquitquit` stops the supervisor) and where the pods' proxies run.

Start-up order follows the reference: state first (the local file is applied synchronously), then
readiness, admin and metrics servers; `/healthz/ready` turns 200 when nothing is pending.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hbone import build as hbone_build
from hbone.identity import Identity
from hbone.tls import TlsPolicy
from mesh.localconfig import LocalConfig, LocalConfigError, load_local_config, parse_local_config
from ztunnel import __version__
from ztunnel.admin.explain import explain_route
from ztunnel.admin.server import (
    CpuProfiler,
    HeapProfiler,
    HttpServer,
    Readiness,
    admin_server,
    pprof_routes,
    readiness_server,
    stats_server,
)
from ztunnel.config.settings import Config
from ztunnel.identity.certhelper import CertHelper
from ztunnel.identity.certificates import FakeCA, SecretManager
from ztunnel.lifecycle import StartupError
from ztunnel.metrics.certs import CertExpiry
from ztunnel.metrics.families import Metrics
from ztunnel.state.store import ProxyState

if TYPE_CHECKING:
    from xds.channel import AuthToken
    from xds.client import XdsClient
    from ztunnel.identity.caclient import GrpcCaClient
    from ztunnel.identity.crl import CrlWatcher
    from ztunnel.inpod.manager import PodRuntime, WorkloadProxyManager

log = logging.getLogger("ztunnel.control")


def build_info() -> dict[str, str]:
    return {
        "version": __version__,
        "gitRevision": "unknown",
        "rustVersion": "n/a (CPython)",
        "buildProfile": "release",
        "buildStatus": "Modified",
        "istioVersion": os.environ.get("ISTIO_META_ISTIO_VERSION", "unknown"),
        "cryptoProvider": "openssl",
        # Which build of HBONE's hot path runs (from its modules' files): compiled by mypyc, or pure.
        "pythonBuild": hbone_build.summary(),
    }


def control_imports(config: Config) -> list[str]:
    """The modules `ControlRuntime` imports when it starts with `config`, beyond this module's own:
    the local file's YAML, our gRPC client with the protocol modules (protobuf) for xDS and the CA,
    in-pod mode's manager. `ztunnel proxy` loads them before it forks its workers."""
    names = []
    if config.local_xds_path or config.local_xds:
        names += ["yaml", "mesh.localyaml", "mesh.yamlstream"]
    if config.xds_address or not config.fake_ca:
        names.append("xds.channel")
    if config.xds_address:
        names.append("xds.client")
    if not config.fake_ca:
        names.append("ztunnel.identity.caclient")
    if config.proxy_mode == "shared":
        names.append("ztunnel.inpod.manager")
    return names


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


@dataclass(frozen=True)
class ControlHooks:
    """What the process running the control runtime supplies."""

    state: ProxyState
    metrics: Metrics
    readiness: Readiness
    shutdown: Callable[[], None]  # /quitquitquit, or a ZDS protocol error
    extra_dump: Callable[[], Mapping[str, Any]]  # /config_dump's sections beside ours
    before_scrape: Callable[[], Awaitable[None]] | None = None  # before /metrics and /config_dump
    on_log_filter: Callable[[str], object] | None = None  # a filter set over /logging
    profilers: tuple[CpuProfiler, HeapProfiler] | None = None  # else this process only
    pod_runtime: PodRuntime | None = None  # in-pod mode: where the pods' proxies run


class ControlRuntime:
    def __init__(self, config: Config, hooks: ControlHooks) -> None:
        self.config = config
        self.hooks = hooks
        self.state = hooks.state
        self.metrics = hooks.metrics
        self.readiness = hooks.readiness
        self.crl = self._load_crl(config.crl_path) if config.crl_path else None
        # Every TLS context of the process is built under this policy (by the secret manager).
        self.tls = TlsPolicy(tls12=config.tls12_enabled, revocation=self.crl.revocation if self.crl else None)
        # cryptography runs in a helper process started when a certificate is made or checked, and
        # gone a moment later: this process never holds it (but for the CRLs, when configured).
        self.certwork = CertHelper()
        self.secrets = SecretManager(FakeCA(work=self.certwork), tls=self.tls) if config.fake_ca else None
        # The certificates are this process's (the workers get theirs from it): so is their expiry.
        self.metrics.registry.register(
            CertExpiry(lambda: self.secrets.expiries() if self.secrets is not None else ())
        )
        self.static: LocalConfig | None = None
        self._servers: list[HttpServer] = []
        self._ca: GrpcCaClient | None = None
        self.xds: XdsClient | None = None
        self._xds_task: asyncio.Task[None] | None = None
        self.inpod: WorkloadProxyManager | None = None
        self._inpod_task: asyncio.Task[None] | None = None
        self.exit_code = 0

    def _load_crl(self, path: str) -> CrlWatcher:
        # cryptography's X.509, which the CRLs need in this process: loaded only with a CRL file.
        from ztunnel.identity.crl import CrlError, CrlWatcher

        try:
            return CrlWatcher.load(path, self.metrics)
        except CrlError as e:
            raise StartupError(str(e)) from None

    def config_dump(self) -> dict[str, Any]:
        dump: dict[str, Any] = dict(self.state.dump_deferred())  # rendered off the loop
        dump["staticConfig"] = self.static.raw if self.static is not None else {}
        dump["version"] = build_info()
        dump["config"] = self.config.to_dump()
        dump["certificates"] = self.secrets.dump() if self.secrets else []
        if self.inpod is not None:
            dump["workloadState"] = self.inpod.dump()
        dump.update(self.hooks.extra_dump())
        return dump

    async def start(self) -> None:
        cfg = self.config
        if cfg.proxy_mode == "shared":
            # In-pod mode's modules (and protobuf, for ZDS) are loaded only when it runs.
            from ztunnel.inpod.netns import check_privileges

            try:
                check_privileges(cfg.packet_mark)
            except OSError as e:
                raise StartupError(f"PROXY_MODE=shared (in-pod mode): {e.strerror or e}") from None
        ca_address = cfg.ca_address if self.secrets is None else None
        note = plaintext_token_note(cfg, (cfg.xds_address, ca_address))
        if note is not None:
            warning, line = note
            (log.warning if warning else log.info)(line)
        if self.secrets is None:
            self.secrets = self._ca_secrets(self._auth_token(ca_address))
        self.static = load_static_config(cfg)
        if self.crl is not None:
            self.crl.start()
        state_task = self.readiness.register("state manager")
        # The listeners are the workers': the supervisor holds readiness `proxy` until they accept.
        dns_task = self.readiness.register("dns proxy") if cfg.dns_capture else None
        # The local file is applied first; xDS (if any) then builds on it.
        if self.static is not None:
            self.state.apply_local_config(self.static)
        own = self._own_identity()
        if own is not None:
            # A dedicated proxy's own certificate is fetched beside the first xDS push, not after
            # it: its listeners accept once they hold it (at 100,000 workloads, 0.2 s of start-up).
            self.secrets.prefetch(own)
        if cfg.xds_address:

            def synced() -> None:
                state_task.release()
                self._settle_prefetch(own)

            self._start_xds(cfg.xds_address, self._auth_token(cfg.xds_address), synced)
        else:
            state_task.release()
        await self._start_operator_servers()
        if dns_task is not None:
            dns_task.release()
        if cfg.proxy_mode == "shared" and self.hooks.pod_runtime is not None:
            self._start_inpod(self.hooks.pod_runtime)

    def identity_of(self, name: str, namespace: str, service_account: str) -> Identity:
        """A local workload's identity: the trust domain its workload in the store names, else the
        configured one."""
        w = self.state.find_local_workload(name, namespace, service_account, self.config.node_name)
        td = (w.trust_domain if w else "") or self.config.trust_domain
        return Identity(td, namespace, service_account)

    def _own_identity(self) -> Identity | None:
        """A dedicated proxy's identity as the store says now (None in shared mode)."""
        info = self.config.workload_info
        if self.config.proxy_mode != "dedicated" or info is None:
            return None
        return self.identity_of(info.name, info.namespace, info.service_account)

    def _settle_prefetch(self, prefetched: Identity | None) -> None:
        """The state is in: if the proxy's workload names another trust domain than the one its
        certificate was fetched for at start, that certificate is nobody's."""
        if prefetched is not None and self.secrets is not None and self._own_identity() != prefetched:
            self.secrets.forget(prefetched)

    def _auth_token(self, address: str | None) -> AuthToken | None:
        """The token for the control plane at `address` (`token_for`: none over plaintext unless
        AUTH_TOKEN says so)."""
        setting = token_for(self.config, address) if address else None
        if setting is None:
            return None
        # gRPC and the protocol modules cost ~15 MB of RSS: loaded only when a control plane is used.
        from xds.channel import AuthToken

        return AuthToken.from_setting(setting)

    def _ca_secrets(self, token: AuthToken | None) -> SecretManager:
        cfg = self.config
        if not cfg.ca_address:
            raise StartupError("CA_ADDRESS is empty and FAKE_CA is not set: no way to get certificates")
        from ztunnel.identity.caclient import GrpcCaClient

        self._ca = GrpcCaClient(
            cfg.ca_address,
            root_ca=cfg.ca_root_ca,
            alt_hostname=cfg.alt_ca_hostname,
            token=token,
            cluster_id=cfg.cluster_id,
            headers=cfg.ca_headers,
            secret_ttl=cfg.secret_ttl,
            impersonate=cfg.proxy_mode == "shared",
            work=self.certwork,
        )
        return SecretManager(self._ca, tls=self.tls)

    def _start_xds(self, address: str, token: AuthToken | None, on_synced: Callable[[], None]) -> None:
        from xds.channel import node_from
        from xds.client import XdsClient

        cfg = self.config
        self.xds = xds = XdsClient(
            address,
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
            on_synced=on_synced,
        )
        self._xds_task = asyncio.get_running_loop().create_task(xds.run())

    async def demand(self, key: str, arrived: Callable[[], bool]) -> bool:
        """On-demand xDS (the store's demander, for every process): ask the control plane for `key`;
        True once `arrived()` holds after a response, False without xDS or after the timeout."""
        if self.xds is None:
            return False
        return await self.xds.demand(key, arrived=arrived)

    async def wait_synced(self) -> None:
        """Until the first state of every xDS type is in (at once without xDS)."""
        if self.xds is not None:
            await self.xds.wait_synced()

    async def _start_operator_servers(self) -> None:
        cfg, hooks = self.config, self.hooks
        admin = admin_server(
            self.config_dump,
            hooks.shutdown,
            hooks.on_log_filter,
            extra_routes={
                "/debug/explain": explain_route(self.state, cfg),
                **(pprof_routes(*hooks.profilers) if hooks.profilers else {}),
            },
            before_dump=hooks.before_scrape,
        )
        operator_servers = (
            (readiness_server(self.readiness), cfg.readiness_address),
            (admin, cfg.admin_address),
            (stats_server(self.metrics, hooks.before_scrape), cfg.stats_address),
        )
        for server, (host, port) in operator_servers:
            try:
                await server.start(host, port)
            except OSError as e:
                raise StartupError(
                    f"failed to bind {server.name} server on {host}:{port}: {e.strerror or e}"
                ) from None
            self._servers.append(server)

    def _start_inpod(self, pods: PodRuntime) -> None:
        """In-pod mode: pods arrive over ZDS once the first xDS state is in."""
        from ztunnel.inpod.manager import WorkloadProxyManager

        self.inpod = WorkloadProxyManager(
            self.config.inpod_uds,
            pods,
            self.readiness,
            self.metrics.workload_manager(),
            drain_deadline=self.config.connection_termination_deadline,
        )
        self._inpod_task = asyncio.get_running_loop().create_task(self._run_inpod(self.inpod))

    async def _run_inpod(self, manager: WorkloadProxyManager) -> None:
        from ztunnel.inpod.manager import ProtocolError

        await self.wait_synced()
        try:
            await manager.run()
        except ProtocolError:
            self.exit_code = 1  # as the reference: a ZDS protocol error ends the process
            self.hooks.shutdown()

    async def drain(self) -> None:
        deadline = self.config.connection_termination_deadline
        if self.xds is not None:
            await self.xds.close()
        if self._xds_task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(self._xds_task, 2.0)
        if self._inpod_task is not None:
            self._inpod_task.cancel()
        if self.inpod is not None:
            with contextlib.suppress(Exception):
                await self.inpod.close(deadline)
        for server in self._servers:
            with contextlib.suppress(Exception):
                await server.close()
        if self.secrets is not None:
            await self.secrets.close()
        if self.crl is not None:
            await self.crl.close()
        if self._ca is not None:
            await self._ca.close()
        await self.certwork.close()


def plaintext(address: str | None) -> bool:
    """Whether a control-plane address is plaintext gRPC (`http://`)."""
    return address is not None and address[:7].lower() == "http://"


def token_for(cfg: Config, address: str | None) -> str | None:
    """The `AUTH_TOKEN` setting to present to the control plane at `address`: over TLS the token
    there is; over plaintext only one set explicitly, never the token file merely found at its
    default path (the pod's own credential, readable by anyone on the path)."""
    if cfg.auth_token_found and plaintext(address):
        return None
    return cfg.auth_token


def plaintext_token_note(cfg: Config, addresses: tuple[str | None, ...]) -> tuple[bool, str] | None:
    """The one line to log about the token and the plaintext control planes among `addresses`:
    (a warning?, the line), or None when there is nothing to say."""
    clear = sorted({a for a in addresses if a is not None and plaintext(a)})
    if cfg.auth_token is None or not clear:
        return None
    where = ", ".join(clear)
    if cfg.auth_token_found:
        return False, (
            f"the token file {cfg.auth_token} is not sent over plaintext to {where}; "
            "set AUTH_TOKEN to send it anyway"
        )
    return True, f"AUTH_TOKEN is sent over plaintext to {where}: anyone on the path can read it"
