"""Wiring of the node proxy: configuration in, servers up, proxies running, drain on the way out
(SPEC §1.3, §12.1).

Start-up order follows the reference: state first (the local file is applied synchronously), then
readiness, admin and metrics servers, then the proxy listeners are bound (a port conflict stops
start-up) and their accept loops start; `/healthz/ready` turns 200 when nothing is pending.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import signal
from typing import Any

import uvloop

from xds.localconfig import LocalConfig, LocalConfigError, load_local_config, parse_local_config
from ztunnel import __version__
from ztunnel.admin import HttpServer, Readiness, admin_server, readiness_server, stats_server
from ztunnel.config import Config, ConfigError
from ztunnel.identity import FakeCA, SecretManager
from ztunnel.logs import setup_logging
from ztunnel.metrics import Metrics
from ztunnel.proxy.instance import ProxyInstance
from ztunnel.sockets import SocketFactory, SocketOptions
from ztunnel.state import ProxyState

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


class App:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.state = ProxyState()
        self.metrics = Metrics(istio_version=os.environ.get("ISTIO_META_ISTIO_VERSION", "unknown"))
        self.readiness = Readiness()
        self.secrets = SecretManager(FakeCA()) if config.fake_ca else None
        self.static: LocalConfig | None = None
        self.proxies: list[ProxyInstance] = []
        self._stop = asyncio.Event()
        self._servers: list[HttpServer] = []

    def config_dump(self) -> dict[str, Any]:
        dump: dict[str, Any] = dict(self.state.dump())
        dump["staticConfig"] = self.static.raw if self.static is not None else {}
        dump["version"] = build_info()
        dump["config"] = self.config.to_dump()
        dump["certificates"] = self.secrets.dump() if self.secrets else []
        return dump

    def shutdown(self) -> None:
        self._stop.set()

    async def start(self) -> None:
        cfg = self.config
        if cfg.proxy_mode != "dedicated":
            raise StartupError(
                "PROXY_MODE=shared (in-pod mode) is not available yet: run with PROXY_MODE=dedicated"
            )
        if self.secrets is None:
            raise StartupError("CA_ADDRESS: the gRPC CA client is not available yet: set FAKE_CA=true")
        self.static = load_static_config(cfg)
        if cfg.xds_address and self.static is None:
            raise StartupError(
                f"XDS_ADDRESS={cfg.xds_address}: the xDS client is not available yet: "
                "set XDS_ADDRESS= and LOCAL_XDS_PATH"
            )
        state_task = self.readiness.register("state manager")
        proxy_task = self.readiness.register("proxy")
        if self.static is not None:
            self.state.apply_local_config(self.static)
        state_task.release()

        for server, (host, port) in (
            (readiness_server(self.readiness), cfg.readiness_address),
            (admin_server(self.config_dump, self.shutdown), cfg.admin_address),
            (stats_server(self.metrics), cfg.stats_address),
        ):
            try:
                await server.start(host, port)
            except OSError as e:
                raise StartupError(
                    f"failed to bind {server.name} server on {host}:{port}: {e.strerror or e}"
                ) from None
            self._servers.append(server)

        assert cfg.workload_info is not None
        options = SocketOptions(
            keepalive=cfg.keepalive_enabled,
            keepalive_time=int(cfg.keepalive_time),
            keepalive_interval=int(cfg.keepalive_interval),
            keepalive_retries=cfg.keepalive_retries,
            mark=cfg.packet_mark,
        )
        proxy = ProxyInstance(
            cfg, self.state, self.secrets, self.metrics, cfg.workload_info, SocketFactory(options)
        )
        try:
            socks = proxy.bind_listeners()
        except OSError as e:
            raise StartupError(f"failed to bind the proxy listeners: {e.strerror or e}") from None
        self.proxies.append(proxy)
        # The workload's certificate is requested at start-up, without gating readiness.
        self.secrets.prefetch(proxy.identity(proxy.find_local_workload()))
        await proxy.serve(socks)
        proxy_task.release()
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
        return 0

    async def drain(self) -> None:
        deadline = self.config.connection_termination_deadline
        await asyncio.gather(*(p.drain(deadline) for p in self.proxies), return_exceptions=True)
        for server in self._servers:
            with contextlib.suppress(Exception):
                await server.close()
        if self.secrets is not None:
            await self.secrets.close()


def run_proxy(environ: dict[str, str]) -> int:
    try:
        config = Config.from_env(environ)
    except ConfigError as e:
        raise StartupError(str(e)) from None
    setup_logging(config.log_format, config.log_level)
    raise_fd_limit()
    return uvloop.run(App(config).run())
