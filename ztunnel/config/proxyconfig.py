"""Istio's ProxyConfig as the proxy reads it: the mesh config file's `defaultConfig`, overlaid by
`PROXY_CONFIG`, and the node metadata (`ISTIO_META_*`, `ISTIO_METAJSON_*`) over its `proxyMetadata`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ztunnel.config.envvars import ConfigError, Env, env_error


def _frozen_map() -> Mapping[str, str]:
    return MappingProxyType({})


@dataclass(frozen=True)
class ProxyConfig:
    discovery_address: str | None = None
    proxy_admin_port: int | None = None
    stats_port: int | None = None
    concurrency: int | None = None
    proxy_metadata: Mapping[str, str] = field(default_factory=_frozen_map)


def _proxy_config_from(doc: object) -> ProxyConfig:
    if doc is None:
        return ProxyConfig()
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
    return ProxyConfig(
        discovery, port("proxyAdminPort"), port("statsPort"), concurrency, MappingProxyType(metadata)
    )


def _merge(base: ProxyConfig, over: ProxyConfig) -> ProxyConfig:
    return ProxyConfig(
        discovery_address=over.discovery_address or base.discovery_address,
        proxy_admin_port=over.proxy_admin_port
        if over.proxy_admin_port is not None
        else base.proxy_admin_port,
        stats_port=over.stats_port if over.stats_port is not None else base.stats_port,
        concurrency=over.concurrency if over.concurrency is not None else base.concurrency,
        proxy_metadata=MappingProxyType({**base.proxy_metadata, **over.proxy_metadata}),
    )


def _load_yaml_file(path: str) -> Any:
    """The YAML document of `path`, None when there is no such file; ValueError if it does not parse."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return None
    import yaml  # loaded only when there is YAML to read

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(str(e)) from None


def load_proxy_config(environ: Mapping[str, str], mesh_config_path: str | None) -> ProxyConfig:
    mesh = ProxyConfig()
    if mesh_config_path is not None:
        try:
            doc = _load_yaml_file(mesh_config_path)
        except (OSError, ValueError) as e:
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
    import yaml  # loaded only when there is YAML to read

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


def istio_metadata(env: Env, pc: ProxyConfig) -> tuple[dict[str, str], dict[str, Any]]:
    """The node metadata: `proxyMetadata` overlaid by `ISTIO_META_*`, and the `ISTIO_METAJSON_*` values."""
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
    return istio_meta, istio_meta_json
