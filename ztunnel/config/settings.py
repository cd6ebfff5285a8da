"""The proxy's configuration: one immutable `Config`, built once from the environment.

This module owns reading and validating every environment variable of `ztunnel proxy`,
the ProxyConfig merge (mesh config file + `PROXY_CONFIG`), the derived defaults (xDS/CA addresses,
termination deadline, worker count) and the fixed port numbers. Everything else receives a `Config`.
The syntax of each value is `envvars.py`'s, ProxyConfig `proxyconfig.py`'s, the worker count
`workercount.py`'s.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, Literal

from hbone.address import format_addr
from hbone.settings import POOL_IDLE_TIMEOUT, POOL_MAX_STREAMS, H2Settings
from ztunnel.config.envvars import (
    Address,
    ConfigError,
    Env,
    env_error,
    grpc_headers,
    int_parser,
    ip_text,
    parse_address,
    parse_bool,
    parse_compliance_policy,
    parse_control_plane_uri,
    parse_duration,
    parse_log_level,
    positive_duration,
)
from ztunnel.config.proxyconfig import ProxyConfig, istio_metadata, load_proxy_config
from ztunnel.config.workercount import worker_count

OUTBOUND_PORT = 15001
INBOUND_PLAINTEXT_PORT = 15006
HBONE_PORT = 15008
SOCKS5_PORT = 15080

DEFAULT_ROOT_CERT = "./var/run/secrets/istio/root-cert.pem"
DEFAULT_TOKEN_PATH = "./var/run/secrets/tokens/istio-token"
MESH_CONFIG_PATH = "./etc/istio/config/mesh"
DEFAULT_INPOD_UDS = "/var/run/ztunnel/ztunnel.sock"
SHARED_MODE_PACKET_MARK = 1337

ProxyMode = Literal["shared", "dedicated"]
LogFormat = Literal["plain", "json"]


def _frozen_map() -> Mapping[str, Any]:
    return MappingProxyType({})


@dataclass(frozen=True)
class WorkloadInfo:
    """The workload a dedicated proxy acts for (`PROXY_WORKLOAD_INFO`)."""

    namespace: str
    name: str
    service_account: str


@dataclass(frozen=True)
class Config:
    """Effective configuration. The defaults are those of an empty environment outside Kubernetes."""

    proxy_mode: ProxyMode = "shared"
    workload_info: WorkloadInfo | None = None
    enable_proxy: bool = True

    local_xds_path: str | None = None
    local_xds: str | None = None
    xds_address: str | None = "https://localhost:15012"
    xds_root_ca: str = DEFAULT_ROOT_CERT
    alt_xds_hostname: str | None = None
    xds_headers: tuple[tuple[str, str], ...] = ()
    xds_on_demand: bool = False
    ca_address: str | None = "https://localhost:15012"
    ca_root_ca: str = DEFAULT_ROOT_CERT
    alt_ca_hostname: str | None = None
    ca_headers: tuple[tuple[str, str], ...] = ()
    fake_ca: bool = False
    auth_token: str | None = None
    auth_token_found: bool = False  # the token file at its default path, AUTH_TOKEN unset
    secret_ttl: float = 86400.0

    cluster_id: str = "Kubernetes"
    trust_domain: str = "cluster.local"
    cluster_domain: str = "cluster.local"
    network: str = ""
    node_name: str | None = None
    pod_name: str | None = None
    pod_namespace: str | None = None
    service_account: str | None = None
    instance_ip: str = "1.1.1.1"

    enable_socks5: bool = False
    inpod_uds: str = DEFAULT_INPOD_UDS
    inpod_port_reuse: bool = True
    packet_mark: int | None = SHARED_MODE_PACKET_MARK
    enable_orig_src: bool | None = None
    ipv6_enabled: bool = True
    localhost_app_tunnel: bool = True
    enable_response_baggage: bool = True
    tls12_enabled: bool = False
    compliance_policy: str = ""  # taken, not enforced (`pqc`, the one the reference enforces, is refused)
    crl_path: str | None = None
    authz_policy_info_logging: bool = False
    prefered_service_namespace: str | None = None

    keepalive_enabled: bool = True
    keepalive_time: float = 180.0
    keepalive_interval: float = 180.0
    keepalive_retries: int = 9
    user_timeout_enabled: bool = False

    pool_max_streams_per_connection: int = POOL_MAX_STREAMS
    pool_unused_release_timeout: float = POOL_IDLE_TIMEOUT
    metrics_stale_series_grace_period: float = 300.0
    http2_stream_window_size: int = H2Settings.stream_window
    http2_connection_window_size: int = H2Settings.connection_window
    http2_frame_size: int = H2Settings.frame_size
    connection_termination_deadline: float = 5.0

    log_format: LogFormat = "plain"
    log_level: str = "info"
    worker_threads: int = 2

    proxy_bind_address: str | None = None
    socks5_address: Address = ("127.0.0.1", SOCKS5_PORT)
    admin_address: Address = ("127.0.0.1", 15000)
    stats_address: Address = ("0.0.0.0", 15020)
    readiness_address: Address = ("0.0.0.0", 15021)

    istio_meta: Mapping[str, str] = field(default_factory=_frozen_map, hash=False)
    istio_meta_json: Mapping[str, Any] = field(default_factory=_frozen_map, hash=False)
    dns_capture: bool = True
    dns_proxy_addr: Address = ("127.0.0.1", 15053)

    @property
    def istio_version(self) -> str:
        return self.istio_meta.get("ISTIO_VERSION", "unknown")

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str], *, mesh_config_path: str | None = MESH_CONFIG_PATH
    ) -> Config:
        """Build the configuration; raise ConfigError naming the first invalid variable."""
        return _build(Env(environ), load_proxy_config(environ, mesh_config_path))

    def to_dump(self) -> dict[str, Any]:
        """The effective configuration for `/config_dump` (camelCase keys). Secrets are left out."""
        out: dict[str, Any] = {}
        for f in fields(self):
            if f.name in _NOT_DUMPED:
                continue
            value = getattr(self, f.name)
            # Header values may carry credentials: show the names only.
            out[_camel(f.name)] = [k for k, _ in value] if f.name.endswith("_headers") else _dump_value(value)
        out["authToken"] = "<redacted>" if self.auth_token is not None else None
        return out


def illegal_ports(cfg: Config) -> frozenset[int]:
    """Ports a workload may not be addressed on: traffic to them would loop into the proxy itself."""
    ports = {OUTBOUND_PORT, INBOUND_PLAINTEXT_PORT, HBONE_PORT}
    if cfg.enable_socks5:
        ports.add(SOCKS5_PORT)
    return frozenset(ports)


# The inline local config can be large and the token is a credential.
_NOT_DUMPED = frozenset({"auth_token", "local_xds"})


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def _dump_value(value: Any) -> Any:
    if isinstance(value, WorkloadInfo):
        return {"namespace": value.namespace, "name": value.name, "serviceAccount": value.service_account}
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], int):
        return format_addr(*value)
    if isinstance(value, tuple):
        return [_dump_value(v) for v in value]
    return value


# --- parsing -----------------------------------------------------------------------------------

# --- the values of this configuration's own types ---------------------------------------------


def parse_proxy_mode(value: str) -> ProxyMode:
    if value == "shared":
        return "shared"
    if value == "dedicated":
        return "dedicated"
    raise ValueError("expected shared or dedicated")


def parse_workload_info(value: str) -> WorkloadInfo:
    parts = value.split("/")
    if len(parts) != 3 or not all(parts):
        raise ValueError("expected namespace/name/serviceaccount")
    return WorkloadInfo(namespace=parts[0], name=parts[1], service_account=parts[2])


def parse_log_format(value: str) -> LogFormat:
    if value == "plain":
        return "plain"
    if value == "json":
        return "json"
    raise ValueError("expected plain or json")


# --- assembly ----------------------------------------------------------------------------------


def _termination_deadline(env: Env) -> float:
    if env.raw("CONNECTION_TERMINATION_DEADLINE") is not None:
        return env.parse("CONNECTION_TERMINATION_DEADLINE", parse_duration, 5.0)
    grace = env.parse("TERMINATION_GRACE_PERIOD_SECONDS", int_parser(0), None)
    if grace is None:
        return 5.0
    # Leave the kubelet time to SIGKILL after our own deadline.
    return float(max(1, grace - 5 if grace > 10 else grace - 1))


def _mode(env: Env) -> tuple[ProxyMode, WorkloadInfo | None]:
    proxy_mode: ProxyMode = env.parse("PROXY_MODE", parse_proxy_mode, "shared")
    workload_info = env.parse("PROXY_WORKLOAD_INFO", parse_workload_info, None)
    if proxy_mode == "dedicated" and workload_info is None:
        raise env.error("PROXY_WORKLOAD_INFO", "required when PROXY_MODE=dedicated")
    return proxy_mode, workload_info


def _local_xds(env: Env) -> tuple[str | None, str | None]:
    local_xds_path = env.text("LOCAL_XDS_PATH")
    local_xds = env.text("LOCAL_XDS")
    if local_xds_path is not None and local_xds is not None:
        raise env.error("LOCAL_XDS", "LOCAL_XDS_PATH and LOCAL_XDS are mutually exclusive")
    return local_xds_path, local_xds


def _istiod(env: Env) -> str:
    if env.raw("KUBERNETES_SERVICE_HOST") is not None:
        return "https://istiod.istio-system.svc:15012"
    return "https://localhost:15012"


def _xds_address(env: Env, pc: ProxyConfig) -> str | None:
    xds_raw = env.raw("XDS_ADDRESS")
    if xds_raw is None:
        return parse_control_plane_uri(pc.discovery_address or _istiod(env))
    return env.parse("XDS_ADDRESS", parse_control_plane_uri, None) if xds_raw else None


def _ca_address(env: Env, fake_ca: bool) -> str | None:
    if fake_ca:
        return None
    ca_raw = env.raw("CA_ADDRESS")
    if ca_raw is None:
        return parse_control_plane_uri(_istiod(env))
    return env.parse("CA_ADDRESS", parse_control_plane_uri, None) if ca_raw else None


def _auth_token(env: Env) -> tuple[str | None, bool]:
    """`AUTH_TOKEN`, else the token file at its default path if there is one (found: True)."""
    auth_token = env.text("AUTH_TOKEN")
    if auth_token is None and os.path.exists(DEFAULT_TOKEN_PATH):
        return DEFAULT_TOKEN_PATH, True
    return auth_token, False


def _dns_proxy_addr(istio_meta: Mapping[str, str]) -> Address:
    if "DNS_PROXY_ADDR" not in istio_meta:
        return ("127.0.0.1", 15053)
    value = istio_meta["DNS_PROXY_ADDR"]
    try:
        host, port = parse_address(value, allow_localhost=True)
    except ValueError as e:
        raise env_error("ISTIO_META_DNS_PROXY_ADDR", value, str(e)) from None
    return ("127.0.0.1" if host == "localhost" else host, port)


def _log_level(env: Env) -> str | None:
    """`LOG_LEVEL`, else `RUST_LOG`, checked as a filter."""
    log_level = env.text("LOG_LEVEL")
    log_level_var = "LOG_LEVEL"
    if log_level is None:
        log_level, log_level_var = env.text("RUST_LOG"), "RUST_LOG"
    if log_level is not None:
        log_level = env.parse(log_level_var, parse_log_level, log_level)
    return log_level


def _packet_mark(env: Env, proxy_mode: ProxyMode) -> int | None:
    default = SHARED_MODE_PACKET_MARK if proxy_mode == "shared" else None
    return env.parse("PACKET_MARK", int_parser(0, 0xFFFFFFFF), default)


def _bind_address(env: Env) -> str | None:
    return env.parse("PROXY_BIND_ADDRESS", ip_text, None) if env.text("PROXY_BIND_ADDRESS") else None


def _admin_default(pc: ProxyConfig) -> Address:
    return ("127.0.0.1", pc.proxy_admin_port if pc.proxy_admin_port is not None else 15000)


def _stats_default(pc: ProxyConfig) -> Address:
    return ("0.0.0.0", pc.stats_port if pc.stats_port is not None else 15020)


def _checked(env: Env, cfg: Config) -> Config:
    """The checks across settings, once each is valid on its own."""
    if cfg.dns_capture and cfg.xds_on_demand:
        raise ConfigError("invalid configuration: the DNS proxy does not support XDS_ON_DEMAND=true")
    if not cfg.enable_proxy and not cfg.dns_capture:
        raise ConfigError("invalid configuration: ztunnel run without any servers enabled")
    return cfg


# The defaults, each written once: in `Config`'s fields. `_build` falls back to them.
DEFAULTS = Config()


def _build(env: Env, pc: ProxyConfig) -> Config:
    d = DEFAULTS
    proxy_mode, workload_info = _mode(env)
    local_xds_path, local_xds = _local_xds(env)
    fake_ca = env.parse("FAKE_CA", parse_bool, False)
    istio_meta, istio_meta_json = istio_metadata(env, pc)
    auth_token, auth_token_found = _auth_token(env)
    cfg = Config(
        proxy_mode=proxy_mode,
        workload_info=workload_info,
        enable_proxy=env.parse("ENABLE_PROXY", parse_bool, d.enable_proxy),
        local_xds_path=local_xds_path,
        local_xds=local_xds,
        xds_address=_xds_address(env, pc),
        xds_root_ca=env.text("XDS_ROOT_CA") or d.xds_root_ca,
        alt_xds_hostname=env.text("ALT_XDS_HOSTNAME"),
        xds_headers=grpc_headers(env, "XDS_HEADER_"),
        xds_on_demand=env.parse("XDS_ON_DEMAND", parse_bool, d.xds_on_demand),
        ca_address=_ca_address(env, fake_ca),
        ca_root_ca=env.text("CA_ROOT_CA") or d.ca_root_ca,
        alt_ca_hostname=env.text("ALT_CA_HOSTNAME"),
        ca_headers=grpc_headers(env, "CA_HEADER_"),
        fake_ca=fake_ca,
        auth_token=auth_token,
        auth_token_found=auth_token_found,
        secret_ttl=env.parse("SECRET_TTL", positive_duration, d.secret_ttl),
        cluster_id=istio_meta.get("CLUSTER_ID") or env.text("CLUSTER_ID") or d.cluster_id,
        trust_domain=env.text("TRUST_DOMAIN") or d.trust_domain,
        cluster_domain=env.text("CLUSTER_DOMAIN") or d.cluster_domain,
        network=env.raw("NETWORK") or d.network,
        node_name=env.text("NODE_NAME"),
        pod_name=env.text("POD_NAME"),
        pod_namespace=env.text("POD_NAMESPACE"),
        service_account=env.text("SERVICE_ACCOUNT"),
        instance_ip=env.parse("INSTANCE_IP", ip_text, d.instance_ip),
        enable_socks5=env.parse("UNSTABLE_ENABLE_SOCKS5", parse_bool, d.enable_socks5),
        inpod_uds=env.text("INPOD_UDS") or d.inpod_uds,
        inpod_port_reuse=env.parse("INPOD_PORT_REUSE", parse_bool, d.inpod_port_reuse),
        packet_mark=_packet_mark(env, proxy_mode),
        enable_orig_src=env.parse("ENABLE_ORIG_SRC", parse_bool, d.enable_orig_src),
        ipv6_enabled=env.parse("IPV6_ENABLED", parse_bool, d.ipv6_enabled),
        localhost_app_tunnel=env.parse("LOCALHOST_APP_TUNNEL", parse_bool, d.localhost_app_tunnel),
        enable_response_baggage=env.parse("ENABLE_RESPONSE_BAGGAGE", parse_bool, d.enable_response_baggage),
        tls12_enabled=env.parse("TLS12_ENABLED", parse_bool, d.tls12_enabled),
        compliance_policy=env.parse("COMPLIANCE_POLICY", parse_compliance_policy, d.compliance_policy),
        crl_path=env.text("CRL_PATH"),
        authz_policy_info_logging=env.parse(
            "AUTHZ_POLICY_INFO_LOGGING", parse_bool, d.authz_policy_info_logging
        ),
        prefered_service_namespace=env.text("PREFERED_SERVICE_NAMESPACE"),
        **_connection_tuning(env),
        connection_termination_deadline=_termination_deadline(env),
        log_format=env.parse("LOG_FORMAT", parse_log_format, d.log_format),
        log_level=_log_level(env) or d.log_level,
        worker_threads=worker_count(env, pc.concurrency),
        proxy_bind_address=_bind_address(env),
        socks5_address=env.parse("SOCKS5_ADDRESS", parse_address, d.socks5_address),
        admin_address=env.parse("ADMIN_ADDRESS", parse_address, _admin_default(pc)),
        stats_address=env.parse("STATS_ADDRESS", parse_address, _stats_default(pc)),
        readiness_address=env.parse("READINESS_ADDRESS", parse_address, d.readiness_address),
        istio_meta=MappingProxyType(istio_meta),
        istio_meta_json=MappingProxyType(istio_meta_json),
        dns_capture=istio_meta.get("DNS_CAPTURE", "true").lower() == "true",
        dns_proxy_addr=_dns_proxy_addr(istio_meta),
    )
    return _checked(env, cfg)


def _connection_tuning(env: Env) -> dict[str, Any]:
    """Keepalive, the pool, stale series and the HTTP/2 windows: `Config`'s fields of those."""
    d = DEFAULTS
    return {
        "keepalive_enabled": env.parse("KEEPALIVE_ENABLED", parse_bool, d.keepalive_enabled),
        "keepalive_time": env.parse("KEEPALIVE_TIME", positive_duration, d.keepalive_time),
        "keepalive_interval": env.parse("KEEPALIVE_INTERVAL", positive_duration, d.keepalive_interval),
        "keepalive_retries": env.parse("KEEPALIVE_RETRIES", int_parser(1), d.keepalive_retries),
        "user_timeout_enabled": env.parse("USER_TIMEOUT_ENABLED", parse_bool, d.user_timeout_enabled),
        "pool_max_streams_per_connection": env.parse(
            "POOL_MAX_STREAMS_PER_CONNECTION", int_parser(1), d.pool_max_streams_per_connection
        ),
        "pool_unused_release_timeout": env.parse(
            "POOL_UNUSED_RELEASE_TIMEOUT", parse_duration, d.pool_unused_release_timeout
        ),
        "metrics_stale_series_grace_period": env.parse(
            "METRICS_STALE_SERIES_GRACE_PERIOD", parse_duration, d.metrics_stale_series_grace_period
        ),
        # HTTP/2 limits (RFC 9113 §6.5.2, §6.9.1): windows up to 2^31-1, frames 16 KiB to 16 MiB-1.
        "http2_stream_window_size": env.parse(
            "HTTP2_STREAM_WINDOW_SIZE", int_parser(1, 2**31 - 1), d.http2_stream_window_size
        ),
        "http2_connection_window_size": env.parse(
            "HTTP2_CONNECTION_WINDOW_SIZE",
            int_parser(65535, 2**31 - 1),
            d.http2_connection_window_size,
        ),
        "http2_frame_size": env.parse("HTTP2_FRAME_SIZE", int_parser(16384, 2**24 - 1), d.http2_frame_size),
    }
