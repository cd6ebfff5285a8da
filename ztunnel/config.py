"""The proxy's configuration: one immutable `Config`, built once from the environment.

This module owns reading and validating every environment variable of `ztunnel proxy`,
the ProxyConfig merge (mesh config file + `PROXY_CONFIG`), the derived defaults (xDS/CA addresses,
termination deadline, worker count) and the fixed port numbers. Everything else receives a `Config`.
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import re
import ssl
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, Literal, TypeVar
from urllib.parse import urlsplit

import yaml

from hbone.address import format_addr
from ztunnel.logs import parse_filter

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
Address = tuple[str, int]


def _frozen_map() -> Mapping[str, Any]:
    return MappingProxyType({})


T = TypeVar("T")


class ConfigError(Exception):
    """A startup configuration error; its message is one line, fit for a user."""


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
    crl_path: str | None = None
    authz_policy_info_logging: bool = False
    prefered_service_namespace: str | None = None

    keepalive_enabled: bool = True
    keepalive_time: float = 180.0
    keepalive_interval: float = 180.0
    keepalive_retries: int = 9
    user_timeout_enabled: bool = False

    pool_max_streams_per_connection: int = 100
    pool_unused_release_timeout: float = 300.0
    metrics_stale_series_grace_period: float = 300.0
    http2_stream_window_size: int = 4 * 1024 * 1024
    http2_connection_window_size: int = 16 * 1024 * 1024
    http2_frame_size: int = 1024 * 1024
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
        return _build(_Env(environ), _load_proxy_config(environ, mesh_config_path))

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


class _Env:
    """Typed access to the environment; every failure is a one-line ConfigError naming the variable."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self.environ = environ

    def raw(self, name: str) -> str | None:
        return self.environ.get(name)

    def text(self, name: str) -> str | None:
        """A string variable where the empty string means unset."""
        value = self.environ.get(name)
        return value if value else None

    def parse(self, name: str, parser: Callable[[str], T], default: T) -> T:
        value = self.environ.get(name)
        if value is None:
            return default
        try:
            return parser(value)
        except ValueError as e:
            raise env_error(name, value, str(e)) from None

    def error(self, name: str, reason: str) -> ConfigError:
        return env_error(name, self.environ.get(name, ""), reason)


def env_error(name: str, value: str, reason: str) -> ConfigError:
    one_line = value.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")
    return ConfigError(f"invalid env var {name}={one_line} ({reason})")


def parse_bool(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered == "true":
        return True
    if lowered == "false":
        return False
    raise ValueError("expected true or false")


_DURATION_UNITS = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
    "d": 86400.0,
}
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h|d)")
_PLAIN_NUMBER = re.compile(r"\d+(?:\.\d*)?|\.\d+")


def parse_duration(value: str) -> float:
    """Seconds from `500ms`, `30s`, `5m`, `24h`, `1h30m`, or a plain number of seconds."""
    text = value.strip()
    if _PLAIN_NUMBER.fullmatch(text):
        return float(text)
    total = 0.0
    pos = 0
    while pos < len(text):
        m = _DURATION_PART.match(text, pos)
        if m is None:
            break
        total += float(m.group(1)) * _DURATION_UNITS[m.group(2)]
        pos = m.end()
    if pos == 0 or pos != len(text):
        raise ValueError("expected a duration such as 500ms, 30s, 5m, 24h or 1h30m")
    return total


def _int_parser(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    def parse(value: str) -> int:
        try:
            n = int(value.strip(), 10)
        except ValueError:
            raise ValueError("expected an integer") from None
        if n < minimum:
            raise ValueError(f"must be at least {minimum}")
        if maximum is not None and n > maximum:
            raise ValueError(f"must be at most {maximum}")
        return n

    return parse


def _positive_duration(value: str) -> float:
    seconds = parse_duration(value)
    if seconds <= 0:
        raise ValueError("must be greater than zero")
    return seconds


def parse_ip(value: str) -> str:
    try:
        return str(ipaddress.ip_address(value.strip()))
    except ValueError:
        raise ValueError("expected an IP address") from None


def parse_address(value: str, *, allow_localhost: bool = False) -> Address:
    """`ip:port` or `[ipv6]:port` (and `localhost:port` where the reference accepts it)."""
    text = value.strip()
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
        if not sep or ":" not in host:
            raise ValueError("expected ip:port")
    else:
        host, sep, port = text.rpartition(":")
        if not sep or ":" in host:
            raise ValueError("expected ip:port")
    if not (allow_localhost and host == "localhost"):
        try:
            host = str(ipaddress.ip_address(host))
        except ValueError:
            raise ValueError("expected ip:port") from None
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError("expected ip:port with a port in 0-65535")
    return host, int(port)


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


def parse_compliance_policy(value: str) -> None:
    """Only "no policy" can be honoured: `pqc` (key exchange restricted to X25519MLKEM768) needs
    key-exchange group selection, which Python 3.11's ssl module does not offer, and an OpenSSL
    with ML-KEM (3.5 or later). Refused rather than silently ignored."""
    if value == "":
        return None
    if value == "pqc":
        raise ValueError(
            "not supported: it restricts key exchange to X25519MLKEM768, which this build cannot "
            f"select (Python {sys.version_info.major}.{sys.version_info.minor} ssl sets no key-exchange "
            f"groups; {ssl.OPENSSL_VERSION})"
        )
    raise ValueError("expected pqc or empty")


def parse_log_level(value: str) -> str:
    parse_filter(value)
    return value


def parse_control_plane_uri(value: str) -> str:
    """A gRPC server URI; a value without scheme gets `https://` as in the reference."""
    uri = value.strip()
    if "://" not in uri:
        uri = "https://" + uri
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https"):
        raise ValueError("expected an http:// or https:// address")
    try:
        host, _ = parts.hostname, parts.port
    except ValueError:
        raise ValueError("invalid port") from None
    if not host:
        raise ValueError("missing host")
    return uri


_QUANTITY = re.compile(r"(\d+(?:\.\d+)?)(m?)")


def parse_cpu_quantity(value: str) -> int:
    """A Kubernetes CPU quantity (`2`, `1.5`, `500m`), rounded up to whole CPUs."""
    m = _QUANTITY.fullmatch(value.strip())
    if m is None:
        raise ValueError("expected a CPU quantity such as 2, 1.5 or 500m")
    cpus = float(m.group(1)) / (1000.0 if m.group(2) else 1.0)
    return max(1, math.ceil(cpus))


def _worker_threads_parser(cpus: int) -> Callable[[str], int]:
    def parse(value: str) -> int:
        text = value.strip()
        if text.endswith("%"):
            pct = text[:-1]
            if not pct.isdigit() or not 0 < int(pct) <= 100:
                raise ValueError("expected an integer, N% (1-100) or 0")
            return max(1, math.ceil(cpus * int(pct) / 100))
        if not text.isdigit():
            raise ValueError("expected an integer, N% (1-100) or 0")
        n = int(text)
        return cpus if n == 0 else n

    return parse


_HEADER_KEY = re.compile(r"[0-9a-z_.-]+")


def _grpc_headers(env: _Env, prefix: str) -> tuple[tuple[str, str], ...]:
    headers = []
    for name in sorted(env.environ):
        if not name.startswith(prefix):
            continue
        key = name[len(prefix) :].lower()
        value = env.environ[name]
        if not _HEADER_KEY.fullmatch(key) or key.endswith("-bin"):
            raise env_error(name, value, "invalid gRPC metadata key")
        if not all(0x20 <= ord(c) < 0x7F for c in value):
            raise env_error(name, value, "invalid gRPC metadata value")
        headers.append((key, value))
    return tuple(headers)


def _available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


# --- ProxyConfig -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _ProxyConfig:
    discovery_address: str | None = None
    proxy_admin_port: int | None = None
    stats_port: int | None = None
    concurrency: int | None = None
    proxy_metadata: Mapping[str, str] = field(default_factory=_frozen_map)


def _proxy_config_from(doc: object) -> _ProxyConfig:
    if doc is None:
        return _ProxyConfig()
    if not isinstance(doc, Mapping):
        raise ValueError("expected a mapping")

    def port(key: str) -> int | None:
        v = doc.get(key)
        if v is None:
            return None
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= 65535:
            raise ValueError(f"{key}: expected a port number")
        return v

    discovery = doc.get("discoveryAddress")
    if discovery is not None and not isinstance(discovery, str):
        raise ValueError("discoveryAddress: expected a string")
    concurrency = doc.get("concurrency")
    if concurrency is not None and (
        not isinstance(concurrency, int) or isinstance(concurrency, bool) or concurrency < 0
    ):
        raise ValueError("concurrency: expected a non-negative integer")
    meta = doc.get("proxyMetadata") or {}
    if not isinstance(meta, Mapping):
        raise ValueError("proxyMetadata: expected a mapping")
    metadata = {_strip_meta(str(k)): str(v) for k, v in meta.items()}
    return _ProxyConfig(
        discovery, port("proxyAdminPort"), port("statsPort"), concurrency, MappingProxyType(metadata)
    )


def _merge(base: _ProxyConfig, over: _ProxyConfig) -> _ProxyConfig:
    return _ProxyConfig(
        discovery_address=over.discovery_address or base.discovery_address,
        proxy_admin_port=over.proxy_admin_port
        if over.proxy_admin_port is not None
        else base.proxy_admin_port,
        stats_port=over.stats_port if over.stats_port is not None else base.stats_port,
        concurrency=over.concurrency if over.concurrency is not None else base.concurrency,
        proxy_metadata=MappingProxyType({**base.proxy_metadata, **over.proxy_metadata}),
    )


def _load_proxy_config(environ: Mapping[str, str], mesh_config_path: str | None) -> _ProxyConfig:
    mesh = _ProxyConfig()
    if mesh_config_path is not None:
        try:
            with open(mesh_config_path, encoding="utf-8") as f:
                doc = yaml.safe_load(f)
        except FileNotFoundError:
            doc = None
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(
                f"failed parsing mesh config file {mesh_config_path}: {_first_line(e)}"
            ) from None
        try:
            if doc is not None and not isinstance(doc, Mapping):
                raise ValueError("expected a mapping")
            mesh = _proxy_config_from((doc or {}).get("defaultConfig"))
        except ValueError as e:
            raise ConfigError(f"failed parsing mesh config file {mesh_config_path}: {e}") from None
    value = environ.get("PROXY_CONFIG")
    if not value:
        return mesh
    try:
        env_pc = _proxy_config_from(yaml.safe_load(value))
    except yaml.YAMLError as e:
        raise env_error("PROXY_CONFIG", value, _first_line(e)) from None
    except ValueError as e:
        raise env_error("PROXY_CONFIG", value, str(e)) from None
    return _merge(mesh, env_pc)


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


_META_PREFIX = "ISTIO_META_"
_META_JSON_PREFIX = "ISTIO_METAJSON_"


def _strip_meta(key: str) -> str:
    return key[len(_META_PREFIX) :] if key.startswith(_META_PREFIX) else key


# --- assembly ----------------------------------------------------------------------------------


def _termination_deadline(env: _Env) -> float:
    if env.raw("CONNECTION_TERMINATION_DEADLINE") is not None:
        return env.parse("CONNECTION_TERMINATION_DEADLINE", parse_duration, 5.0)
    grace = env.parse("TERMINATION_GRACE_PERIOD_SECONDS", _int_parser(0), None)
    if grace is None:
        return 5.0
    # Leave the kubelet time to SIGKILL after our own deadline.
    return float(max(1, grace - 5 if grace > 10 else grace - 1))


def _worker_threads(env: _Env, pc: _ProxyConfig) -> int:
    limit = env.parse("ZTUNNEL_RESOURCE_CPU_LIMIT", parse_cpu_quantity, None)
    request = env.parse("ZTUNNEL_RESOURCE_CPU_REQUEST", parse_cpu_quantity, None)
    # Istio's chart sets ZTUNNEL_CPU_LIMIT from the container's CPU limit, `0` when it has none.
    cpus = limit or env.parse("ZTUNNEL_CPU_LIMIT", _int_parser(0), None) or _available_cpus()
    threads = env.parse("ZTUNNEL_WORKER_THREADS", _worker_threads_parser(cpus), None)
    if threads is None and pc.concurrency is not None:
        threads = cpus if pc.concurrency == 0 else pc.concurrency
    if threads is None:
        if limit is not None:
            threads = max(limit, request or 0)
        else:
            threads = max(math.ceil(cpus * 0.25), request or 0, 2)
    return max(1, threads)


def _build(env: _Env, pc: _ProxyConfig) -> Config:
    proxy_mode: ProxyMode = env.parse("PROXY_MODE", parse_proxy_mode, "shared")
    workload_info = env.parse("PROXY_WORKLOAD_INFO", parse_workload_info, None)
    if proxy_mode == "dedicated" and workload_info is None:
        raise env.error("PROXY_WORKLOAD_INFO", "required when PROXY_MODE=dedicated")

    local_xds_path = env.text("LOCAL_XDS_PATH")
    local_xds = env.text("LOCAL_XDS")
    if local_xds_path is not None and local_xds is not None:
        raise env.error("LOCAL_XDS", "LOCAL_XDS_PATH and LOCAL_XDS are mutually exclusive")

    istiod = (
        "https://istiod.istio-system.svc:15012"
        if env.raw("KUBERNETES_SERVICE_HOST") is not None
        else "https://localhost:15012"
    )
    xds_raw = env.raw("XDS_ADDRESS")
    xds_address: str | None
    if xds_raw is None:
        xds_raw = pc.discovery_address or istiod
        xds_address = parse_control_plane_uri(xds_raw)
    else:
        xds_address = env.parse("XDS_ADDRESS", parse_control_plane_uri, None) if xds_raw else None

    fake_ca = env.parse("FAKE_CA", parse_bool, False)
    ca_address: str | None = None
    if not fake_ca:
        ca_raw = env.raw("CA_ADDRESS")
        if ca_raw is None:
            ca_address = parse_control_plane_uri(istiod)
        elif ca_raw:
            ca_address = env.parse("CA_ADDRESS", parse_control_plane_uri, None)

    auth_token = env.text("AUTH_TOKEN")
    if auth_token is None and os.path.exists(DEFAULT_TOKEN_PATH):
        auth_token = DEFAULT_TOKEN_PATH

    istio_meta = {**pc.proxy_metadata}
    istio_meta_json: dict[str, Any] = {}
    for name, value in env.environ.items():
        if name.startswith(_META_PREFIX):
            istio_meta[name[len(_META_PREFIX) :]] = value
        elif name.startswith(_META_JSON_PREFIX):
            try:
                istio_meta_json[name[len(_META_JSON_PREFIX) :]] = json.loads(value)
            except ValueError:
                raise env_error(name, value, "expected JSON") from None

    cluster_id = istio_meta.get("CLUSTER_ID") or env.text("CLUSTER_ID") or "Kubernetes"
    dns_capture = istio_meta.get("DNS_CAPTURE", "true").lower() == "true"
    dns_proxy_addr: Address = ("127.0.0.1", 15053)
    if "DNS_PROXY_ADDR" in istio_meta:
        value = istio_meta["DNS_PROXY_ADDR"]
        try:
            dns_proxy_addr = parse_address(value, allow_localhost=True)
        except ValueError as e:
            raise env_error("ISTIO_META_DNS_PROXY_ADDR", value, str(e)) from None
        if dns_proxy_addr[0] == "localhost":
            dns_proxy_addr = ("127.0.0.1", dns_proxy_addr[1])

    admin_default: Address = ("127.0.0.1", pc.proxy_admin_port if pc.proxy_admin_port is not None else 15000)
    stats_default: Address = ("0.0.0.0", pc.stats_port if pc.stats_port is not None else 15020)

    log_level = env.text("LOG_LEVEL")
    log_level_var = "LOG_LEVEL"
    if log_level is None:
        log_level, log_level_var = env.text("RUST_LOG"), "RUST_LOG"
    if log_level is not None:
        log_level = env.parse(log_level_var, parse_log_level, log_level)

    cfg = Config(
        proxy_mode=proxy_mode,
        workload_info=workload_info,
        enable_proxy=env.parse("ENABLE_PROXY", parse_bool, True),
        local_xds_path=local_xds_path,
        local_xds=local_xds,
        xds_address=xds_address,
        xds_root_ca=env.text("XDS_ROOT_CA") or DEFAULT_ROOT_CERT,
        alt_xds_hostname=env.text("ALT_XDS_HOSTNAME"),
        xds_headers=_grpc_headers(env, "XDS_HEADER_"),
        xds_on_demand=env.parse("XDS_ON_DEMAND", parse_bool, False),
        ca_address=ca_address,
        ca_root_ca=env.text("CA_ROOT_CA") or DEFAULT_ROOT_CERT,
        alt_ca_hostname=env.text("ALT_CA_HOSTNAME"),
        ca_headers=_grpc_headers(env, "CA_HEADER_"),
        fake_ca=fake_ca,
        auth_token=auth_token,
        secret_ttl=env.parse("SECRET_TTL", _positive_duration, 86400.0),
        cluster_id=cluster_id,
        trust_domain=env.text("TRUST_DOMAIN") or "cluster.local",
        cluster_domain=env.text("CLUSTER_DOMAIN") or "cluster.local",
        network=env.raw("NETWORK") or "",
        node_name=env.text("NODE_NAME"),
        pod_name=env.text("POD_NAME"),
        pod_namespace=env.text("POD_NAMESPACE"),
        service_account=env.text("SERVICE_ACCOUNT"),
        instance_ip=env.parse("INSTANCE_IP", parse_ip, "1.1.1.1"),
        enable_socks5=env.parse("UNSTABLE_ENABLE_SOCKS5", parse_bool, False),
        inpod_uds=env.text("INPOD_UDS") or DEFAULT_INPOD_UDS,
        inpod_port_reuse=env.parse("INPOD_PORT_REUSE", parse_bool, True),
        packet_mark=env.parse(
            "PACKET_MARK",
            _int_parser(0, 0xFFFFFFFF),
            SHARED_MODE_PACKET_MARK if proxy_mode == "shared" else None,
        ),
        enable_orig_src=env.parse("ENABLE_ORIG_SRC", parse_bool, None),
        ipv6_enabled=env.parse("IPV6_ENABLED", parse_bool, True),
        localhost_app_tunnel=env.parse("LOCALHOST_APP_TUNNEL", parse_bool, True),
        enable_response_baggage=env.parse("ENABLE_RESPONSE_BAGGAGE", parse_bool, True),
        tls12_enabled=env.parse("TLS12_ENABLED", parse_bool, False),
        crl_path=env.text("CRL_PATH"),
        authz_policy_info_logging=env.parse("AUTHZ_POLICY_INFO_LOGGING", parse_bool, False),
        prefered_service_namespace=env.text("PREFERED_SERVICE_NAMESPACE"),
        keepalive_enabled=env.parse("KEEPALIVE_ENABLED", parse_bool, True),
        keepalive_time=env.parse("KEEPALIVE_TIME", _positive_duration, 180.0),
        keepalive_interval=env.parse("KEEPALIVE_INTERVAL", _positive_duration, 180.0),
        keepalive_retries=env.parse("KEEPALIVE_RETRIES", _int_parser(1), 9),
        user_timeout_enabled=env.parse("USER_TIMEOUT_ENABLED", parse_bool, False),
        pool_max_streams_per_connection=env.parse("POOL_MAX_STREAMS_PER_CONNECTION", _int_parser(1), 100),
        pool_unused_release_timeout=env.parse("POOL_UNUSED_RELEASE_TIMEOUT", parse_duration, 300.0),
        metrics_stale_series_grace_period=env.parse(
            "METRICS_STALE_SERIES_GRACE_PERIOD", parse_duration, 300.0
        ),
        # HTTP/2 limits (RFC 9113 §6.5.2, §6.9.1): windows up to 2^31-1, frames 16 KiB to 16 MiB-1.
        http2_stream_window_size=env.parse(
            "HTTP2_STREAM_WINDOW_SIZE", _int_parser(1, 2**31 - 1), 4 * 1024 * 1024
        ),
        http2_connection_window_size=env.parse(
            "HTTP2_CONNECTION_WINDOW_SIZE", _int_parser(65535, 2**31 - 1), 16 * 1024 * 1024
        ),
        http2_frame_size=env.parse("HTTP2_FRAME_SIZE", _int_parser(16384, 2**24 - 1), 1024 * 1024),
        connection_termination_deadline=_termination_deadline(env),
        log_format=env.parse("LOG_FORMAT", parse_log_format, "plain"),
        log_level=log_level or "info",
        worker_threads=_worker_threads(env, pc),
        proxy_bind_address=env.parse("PROXY_BIND_ADDRESS", parse_ip, None)
        if env.text("PROXY_BIND_ADDRESS")
        else None,
        socks5_address=env.parse("SOCKS5_ADDRESS", parse_address, ("127.0.0.1", SOCKS5_PORT)),
        admin_address=env.parse("ADMIN_ADDRESS", parse_address, admin_default),
        stats_address=env.parse("STATS_ADDRESS", parse_address, stats_default),
        readiness_address=env.parse("READINESS_ADDRESS", parse_address, ("0.0.0.0", 15021)),
        istio_meta=MappingProxyType(istio_meta),
        istio_meta_json=MappingProxyType(istio_meta_json),
        dns_capture=dns_capture,
        dns_proxy_addr=dns_proxy_addr,
    )
    env.parse("COMPLIANCE_POLICY", parse_compliance_policy, None)
    if cfg.dns_capture and cfg.xds_on_demand:
        raise ConfigError("invalid configuration: the DNS proxy does not support XDS_ON_DEMAND=true")
    if not cfg.enable_proxy and not cfg.dns_capture:
        raise ConfigError("invalid configuration: ztunnel run without any servers enabled")
    return cfg
