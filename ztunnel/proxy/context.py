"""What every listener of one proxy receives: a frozen `ProxyContext`.

It holds the proxy's inputs (configuration, store, secret manager, metrics, socket factory, the
workload it serves), what was decided when it was built (its bind address, HTTP/2 settings and
admission rules, whether the app sees the client's own address included), and the shared pieces
of its connections: its own workload (`LocalWorkload`), the connection tracker, the task set a
drain waits on, and the open connections `/config_dump` lists. Listeners call its few operations
(dialling, admission, credentials); none of them reaches its owner or a sibling listener.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from hbone.relay import Inbox
from hbone.settings import H2Settings
from hbone.tls import TlsCredentials
from mesh.model import Workload
from ztunnel.config.settings import Config, WorkloadInfo
from ztunnel.decisions.admission import (
    AdmissionRules,
    Admit,
    InboundRequest,
    Reject,
    admit,
    parse_authority,
)
from ztunnel.decisions.rejection import RejectionKind
from ztunnel.dns.resolver import ResolverSettings
from ztunnel.identity.certificates import SecretManager
from ztunnel.metrics.families import Metrics
from ztunnel.proxy.connections import ConnectionTracker
from ztunnel.proxy.local import LocalWorkload
from ztunnel.proxy.tasks import TaskSet
from ztunnel.proxy.telemetry import ConnectionRecord
from ztunnel.sockets import SocketFactory
from ztunnel.state.store import ProxyState

CONNECT_TIMEOUT = 10.0


@dataclass(frozen=True, eq=False)
class ProxyContext:
    config: Config
    state: ProxyState
    secrets: SecretManager
    metrics: Metrics
    sockets: SocketFactory
    info: WorkloadInfo
    bind: str | None  # the source address of what the proxy dials; None: the kernel's choice
    settings: H2Settings
    rules: AdmissionRules
    resolver: ResolverSettings  # how SOCKS5 resolves mesh names: as this proxy's DNS server would
    local: LocalWorkload
    tracker: ConnectionTracker
    tasks: TaskSet
    # Every connection carried now, for `/config_dump` (records leave it when they finish).
    connections: set[ConnectionRecord]

    def hold(self, carried: asyncio.Future[Any]) -> asyncio.Future[Any]:
        """A carried connection: a drain waits for it, then cuts it."""
        return self.tasks.hold(carried)

    async def connect_tcp(
        self, addr: tuple[str, int], *, source_ip: str | None = None, transparent: bool = False
    ) -> tuple[asyncio.Transport, Inbox]:
        """A TCP connection from this proxy (from `source_ip`, else its bind address, with its socket
        options; `transparent`: `source_ip` is the client's); what arrives before it is relayed waits
        in its `Inbox`."""
        sock = await self.sockets.connect(
            addr, source_ip=source_ip or self.bind, transparent=transparent, timeout=CONNECT_TIMEOUT
        )
        transport, inbox = await asyncio.get_running_loop().create_connection(Inbox, sock=sock)
        transport.pause_reading()
        return transport, inbox

    async def credentials(self) -> TlsCredentials:
        """Our own certificate with its TLS contexts (waiting for an in-flight fetch): what the
        inbound listener serves, looked up on every handshake so a rotation is served at once."""
        return await self.secrets.credentials(self.local.own_identity())

    async def admit(self, request: InboundRequest) -> Admit | Reject:
        """`admit()` with this proxy's rules, waiting (up to 5 s) for its own workload to be known.
        What can be refused without the workload is refused at once."""
        local = self.local.find_local_workload()
        if self.state.demander is not None:
            await self._fetch_authority(request, local)
        if local is None:
            early = admit(self.state, None, request, self.rules)
            if not (isinstance(early, Reject) and early.kind is RejectionKind.NO_LOCAL_WORKLOAD):
                return early
            local = await self.local.local_workload()
        return admit(self.state, local, request, self.rules)

    async def _fetch_authority(self, request: InboundRequest, local: Workload | None) -> None:
        """XDS_ON_DEMAND: what a CONNECT's authority names (another address, or a service hostname)
        is asked for before admission looks it up."""
        target = parse_authority(request.authority or "")
        if target is None:
            return
        host = target[0]
        if isinstance(host, str):
            namespace = local.namespace if local is not None else self.info.namespace
            await self.state.fetch_hostname(namespace, host)
        elif host != request.local[0]:
            await self.state.fetch_address(self.config.network, host)
