"""The control-plane process: one grpc.aio server on one port with the ADS and CA services, the file
watch feeding it, and `run` (start-up lines, signals, shutdown) for `ztunnel control-plane`.

Plaintext by default, since proxies in development reach it as `http://…`; with `tls` it serves a
certificate signed by its own CA for the listen host, so a proxy verifies it with the printed root
(`https://…` plus `XDS_ROOT_CA`/`CA_ROOT_CA`).
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import signal
import socket
from collections.abc import Mapping
from pathlib import Path

import grpc
import uvloop

from controlplane import DEFAULT_LISTEN
from controlplane.ads import AggregatedDiscoveryService, add_to_server
from controlplane.auth import CallerCheck
from controlplane.ca import CaDirectoryError, CertificateAuthority, CertificateService, default_ca_dir
from controlplane.kube.cluster import Options
from controlplane.source import DEFAULT_POLL_INTERVAL, ConfigSource
from mesh.localconfig import LocalConfigError
from xds.client import MAX_MESSAGE_BYTES  # what the proxy receives: a large file is sent whole
from xds.gen.istio.v1.auth import ca_pb2_grpc

log = logging.getLogger(__name__)

SHUTDOWN_GRACE = 1.0
# What istiod receives in one gRPC message, and the variable that changes it there: a proxy's
# request larger than this ends its stream with RESOURCE_EXHAUSTED, as istiod's does.
MAX_RECV_MSG_SIZE_ENV = "ISTIO_GPRC_MAXRECVMSGSIZE"
DEFAULT_MAX_RECV_MSG_SIZE = 4 * 1024 * 1024
_GRPC_MAX_MESSAGE = 2**31 - 1  # gRPC's limits are C ints


class ControlPlaneStartError(Exception):
    """The control plane cannot start; the message is one line naming what is wrong."""


def parse_listen(listen: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port` into (host, port); raise ControlPlaneStartError when it is neither."""
    host, sep, port_text = listen.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        if not sep or not host:
            raise ValueError
        port = int(port_text)
        if not 0 <= port <= 65535:
            raise ValueError
    except ValueError:
        raise ControlPlaneStartError(f"invalid --listen {listen!r} (expected host:port)") from None
    return host, port


def _host_port(host: str, port: int) -> str:
    try:
        if isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address):
            return f"[{host}]:{port}"
    except ValueError:
        pass
    return f"{host}:{port}"


def _check_bindable(host: str, port: int) -> None:
    """Fail with the OS's reason before gRPC tries: its own bind failure is a multi-line core log."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds
            probe.bind(address)
    except OSError as e:
        raise ControlPlaneStartError(
            f"cannot listen on {_host_port(host, port)}: {e.strerror or e}"
        ) from None


def receive_limit(flag: str | None, environ: Mapping[str, str]) -> int:
    """`--max-recv-msg-size`, else `ISTIO_GPRC_MAXRECVMSGSIZE`, else istiod's 4 MiB; raise
    ControlPlaneStartError naming the one that is not a number of bytes gRPC takes."""
    if flag is not None:
        value, named = flag, f"--max-recv-msg-size {flag!r}"
    elif MAX_RECV_MSG_SIZE_ENV in environ:
        value = environ[MAX_RECV_MSG_SIZE_ENV]
        named = f"env var {MAX_RECV_MSG_SIZE_ENV}={value}"
    else:
        return DEFAULT_MAX_RECV_MSG_SIZE
    size = int(value) if value.isascii() and value.isdigit() else 0
    if not 0 < size <= _GRPC_MAX_MESSAGE:
        raise ControlPlaneStartError(
            f"invalid {named} (expected a number of bytes, 1 to {_GRPC_MAX_MESSAGE})"
        )
    return size


class ControlPlane:
    """The running control plane: `await start()`, then `address` and `root_cert_path`; `await stop()`."""

    def __init__(
        self,
        config_path: Path | None,
        *,
        kube_path: Path | None = None,
        listen: str = DEFAULT_LISTEN,
        tls: bool = False,
        ca_dir: Path | None = None,
        poll_interval: float = DEFAULT_POLL_INTERVAL,
        auth_token: Path | None = None,
        cluster_id: str | None = None,
        max_recv_msg_size: int = DEFAULT_MAX_RECV_MSG_SIZE,
    ) -> None:
        """`config_path`, `kube_path`: the local-config file, the Kubernetes manifests, or both.
        `auth_token`, `cluster_id`: what every caller must present (`controlplane.auth`); the cluster
        id is also the one the manifests' workloads are named in. `max_recv_msg_size`: the largest
        request taken, in bytes."""
        if config_path is None and kube_path is None:
            raise ControlPlaneStartError("nothing to serve: give --config FILE, --kube PATH, or both")
        options = Options(cluster_id=cluster_id) if cluster_id else Options()
        self.source = ConfigSource(config_path, poll_interval, kube=kube_path, kube_options=options)
        self.host, self._port = parse_listen(listen)
        self.tls = tls
        self.max_recv_msg_size = max_recv_msg_size
        # Absolute, so the printed root path works from any directory.
        self.ca_dir = (ca_dir if ca_dir is not None else default_ca_dir()).absolute()
        self._server: grpc.aio.Server | None = None
        self._watch: asyncio.Task[None] | None = None
        self.ads: AggregatedDiscoveryService | None = None
        self.ca: CertificateAuthority | None = None
        self.caller_check = (
            CallerCheck(auth_token, cluster_id) if auth_token is not None or cluster_id is not None else None
        )

    @property
    def address(self) -> str:
        """The URL a proxy puts in `XDS_ADDRESS` and `CA_ADDRESS` (the bound port, not the asked one)."""
        return f"{'https' if self.tls else 'http'}://{_host_port(self.host, self._port)}"

    @property
    def root_cert_path(self) -> Path:
        if self.ca is None:
            raise RuntimeError("the control plane has not started")
        return self.ca.root_path

    async def start(self) -> None:
        try:
            snapshot = self.source.load()
        except LocalConfigError as e:
            raise ControlPlaneStartError(e.message) from None
        _check_bindable(self.host, self._port)
        try:
            self.ca = CertificateAuthority.load_or_create(self.ca_dir)
        except CaDirectoryError as e:
            raise ControlPlaneStartError(str(e)) from None
        self.ads = AggregatedDiscoveryService(snapshot)
        token_path = self.caller_check.token_path if self.caller_check is not None else None
        if token_path is not None and not token_path.is_file():
            raise ControlPlaneStartError(f"--auth-token {token_path}: no such file")
        server = grpc.aio.server(
            interceptors=[self.caller_check] if self.caller_check is not None else None,
            options=[
                ("grpc.max_receive_message_length", self.max_recv_msg_size),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                # gRPC sets SO_REUSEPORT by default: a second control plane would share the port silently.
                ("grpc.so_reuseport", 0),
                # istiod's keepalive enforcement (a PING every 15 s at most, with or without calls):
                # gRPC's default (5 min) would answer the proxy's 30 s keepalive with GOAWAY.
                ("grpc.http2.min_recv_ping_interval_without_data_ms", 15_000),
                ("grpc.http2.min_ping_interval_without_data_ms", 15_000),
                ("grpc.keepalive_permit_without_calls", 1),
            ],
        )
        add_to_server(self.ads, server)
        ca_pb2_grpc.add_IstioCertificateServiceServicer_to_server(CertificateService(self.ca), server)
        target = _host_port(self.host, self._port)
        try:
            if self.tls:
                cert_pem, key_pem = self.ca.serving_certificate(self.host)
                port = server.add_secure_port(target, grpc.ssl_server_credentials([(key_pem, cert_pem)]))
            else:
                port = server.add_insecure_port(target)
        except RuntimeError:
            port = 0
        if port == 0:
            raise ControlPlaneStartError(f"cannot listen on {target} (address in use or not local)")
        self._port = port
        await server.start()
        self._server = server
        self._watch = asyncio.create_task(self.source.watch(self.ads.publish))
        log.info("serving %s from %s", self.address, self.source.path)

    async def stop(self, grace: float = SHUTDOWN_GRACE) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        if self._server is not None:
            if self.ads is not None:
                self.ads.close()
            await self._server.stop(grace)
            self._server = None


async def _serve(control_plane: ControlPlane) -> int:
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    # Before the start-up lines: whoever reads them may signal at once.
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stopping.set)
    await control_plane.start()
    print(f"control plane listening on {control_plane.address}", flush=True)
    print(f"root certificate: {control_plane.root_cert_path}", flush=True)
    try:
        await stopping.wait()
        log.info("shutting down")
    finally:
        await control_plane.stop()
    return 0


def run(
    config: str | None,
    listen: str = DEFAULT_LISTEN,
    tls: bool = False,
    ca_dir: str | None = None,
    *,
    auth_token: str | None = None,
    cluster_id: str | None = None,
    kube: str | None = None,
    max_recv_msg_size: str | None = None,
) -> int:
    """Serve until SIGINT or SIGTERM, then exit 0; raise ControlPlaneStartError if it cannot start.
    `max_recv_msg_size`: the flag's value, if given (`receive_limit`)."""
    control_plane = ControlPlane(
        Path(config) if config is not None else None,
        kube_path=Path(kube) if kube is not None else None,
        listen=listen,
        tls=tls,
        ca_dir=Path(ca_dir) if ca_dir is not None else None,
        auth_token=Path(auth_token) if auth_token is not None else None,
        cluster_id=cluster_id,
        max_recv_msg_size=receive_limit(max_recv_msg_size, os.environ),
    )
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(_serve(control_plane))


def run_with_arguments(args: argparse.Namespace) -> int:
    """`run` as the options of `controlplane.add_arguments` say (`ztunnel control-plane`'s)."""
    return run(
        args.config,
        args.listen,
        args.tls,
        args.ca_dir,
        auth_token=args.auth_token,
        cluster_id=args.cluster_id,
        kube=args.kube,
        max_recv_msg_size=args.max_recv_msg_size,
    )
