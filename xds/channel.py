"""The gRPC channel to a control plane, its credentials and the node identity: what the xDS client
and the CA client share.

Where grpcio differs from the reference's channel: `ALT_*_HOSTNAME` replaces the checked server name
(grpcio has no "either name"), and TCP keepalive is left to the OS; the HTTP/2 keepalive (30 s ping,
10 s timeout), the 5 s connect timeout and the 200 MiB message limit are as the reference's.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import grpc
import grpc.aio

from xds.gen.envoy.config.core.v3 import base_pb2

CONNECT_TIMEOUT = 5.0
MAX_MESSAGE_BYTES = 200 * 1024 * 1024


class ControlPlaneError(Exception):
    """The channel to a control plane cannot be set up (bad address, unreadable root CA or token)."""


class AuthToken:
    """The bearer token of `AUTH_TOKEN`: a file re-read on every request, or a static value."""

    def __init__(self, *, value: str | None = None, path: str | None = None) -> None:
        if (value is None) == (path is None):
            raise ValueError("exactly one of value and path")
        self.value = value
        self.path = path

    @classmethod
    def from_setting(cls, setting: str | None) -> AuthToken | None:
        """`AUTH_TOKEN` as the reference reads it: an existing file's path, else the token itself."""
        if not setting:
            return None
        return cls(path=setting) if os.path.isfile(setting) else cls(value=setting)

    def read(self) -> str:
        if self.value is not None:
            return self.value
        assert self.path is not None
        try:
            with open(self.path, encoding="utf-8") as f:
                token = f.read().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ControlPlaneError(f"cannot read token file {self.path}: {e}") from None
        if not token:
            raise ControlPlaneError(f"token file {self.path} is empty")
        return token


def call_metadata(
    token: AuthToken | None, cluster_id: str, headers: Iterable[tuple[str, str]] = ()
) -> tuple[tuple[str, str], ...]:
    """Per-RPC metadata: `authorization: Bearer …` (token read now), `clusterid`, then extra headers."""
    metadata: list[tuple[str, str]] = []
    if token is not None:
        metadata.append(("authorization", f"Bearer {token.read()}"))
    metadata.append(("clusterid", cluster_id))
    metadata.extend((key.lower(), value) for key, value in headers)
    return tuple(metadata)


def read_root_ca(setting: str) -> bytes | None:
    """`XDS_ROOT_CA` / `CA_ROOT_CA`: a file path, `SYSTEM` (None: the default roots) or inline PEM."""
    if setting == "SYSTEM":
        return None
    if os.path.exists(setting):
        try:
            with open(setting, "rb") as f:
                return f.read()
        except OSError as e:
            raise ControlPlaneError(f"cannot read root certificate {setting}: {e.strerror or e}") from None
    if "-----BEGIN" in setting:
        return setting.encode()
    raise ControlPlaneError(f"root certificate {setting}: no such file")


@dataclass(frozen=True)
class ControlPlaneAddress:
    """`http://host:port` (plaintext gRPC, ours) or `https://host:port` (TLS)."""

    tls: bool
    target: str  # host:port as gRPC takes it
    host: str

    @classmethod
    def parse(cls, uri: str) -> ControlPlaneAddress:
        parts = urlsplit(uri if "://" in uri else "https://" + uri)
        if parts.scheme not in ("http", "https"):
            raise ControlPlaneError(f"invalid control plane address {uri!r}: expected http:// or https://")
        try:
            host, port = parts.hostname, parts.port
        except ValueError:
            raise ControlPlaneError(f"invalid control plane address {uri!r}: invalid port") from None
        if not host:
            raise ControlPlaneError(f"invalid control plane address {uri!r}: missing host")
        tls = parts.scheme == "https"
        port = port or (443 if tls else 80)
        target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        return cls(tls, target, host)


def open_channel(
    address: ControlPlaneAddress, root_ca: str | None = None, alt_hostname: str | None = None
) -> grpc.aio.Channel:
    """A new channel with the reference's settings; for TLS the roots are read now (a rotated file
    is picked up by the next channel)."""
    options: list[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        # Our own backoff decides when to reconnect: each attempt gets a fresh channel.
        ("grpc.enable_retries", 0),
    ]
    if not address.tls:
        return grpc.aio.insecure_channel(address.target, options=options)
    roots = read_root_ca(root_ca) if root_ca is not None else None
    if alt_hostname:
        options.append(("grpc.ssl_target_name_override", alt_hostname))
    return grpc.aio.secure_channel(
        address.target, grpc.ssl_channel_credentials(root_certificates=roots), options=options
    )


async def wait_connected(channel: grpc.aio.Channel, timeout: float = CONNECT_TIMEOUT) -> bool:
    """Wait for the first connection attempt: True once READY, False on failure (the next call then
    fails fast with gRPC's reason); raise TimeoutError after `timeout`."""
    async with asyncio.timeout(timeout):
        state = channel.get_state(try_to_connect=True)
        while state is not grpc.ChannelConnectivity.READY:
            if state in (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN):
                return False
            await channel.wait_for_state_change(state)
            state = channel.get_state(try_to_connect=True)
        return True


def node_from(
    *,
    instance_ip: str | None = None,
    pod_name: str | None = None,
    pod_namespace: str | None = None,
    node_name: str | None = None,
    istio_meta: Mapping[str, str] | None = None,
    istio_meta_json: Mapping[str, Any] | None = None,
    cluster_id: str | None = None,
) -> base_pb2.Node:
    """The xDS node: `ztunnel~<ip>~<pod>.<ns>~<ns>.svc.cluster.local` and the metadata
    istiod reads (NAME, NAMESPACE, INSTANCE_IPS, NODE_NAME, every `ISTIO_META_*` without the prefix,
    every `ISTIO_METAJSON_*` as typed JSON, and CLUSTER_ID)."""
    ip = instance_ip or "1.1.1.1"
    name, namespace = pod_name or "", pod_namespace or ""
    node = base_pb2.Node(id=f"ztunnel~{ip}~{name}.{namespace}~{namespace}.svc.cluster.local")
    metadata: dict[str, Any] = dict(istio_meta or {})
    if cluster_id and "CLUSTER_ID" not in metadata:
        metadata["CLUSTER_ID"] = cluster_id
    for key, value in (istio_meta_json or {}).items():
        # Struct holds JSON values only; a round trip through json makes tuples lists and so on.
        metadata[key] = json.loads(json.dumps(value))
    metadata.update(NAME=name, NAMESPACE=namespace, INSTANCE_IPS=ip, NODE_NAME=node_name or "")
    node.metadata.update(metadata)
    return node
