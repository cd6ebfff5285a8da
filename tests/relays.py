"""Test stand-ins for the mesh's other proxies: a waypoint and an east/west network gateway.

Both terminate HBONE on `<ip>:15008` with their own identity (a certificate from the fake CA, so every
proxy of the tests trusts them and they trust every proxy), and record what they were asked for.

* `start_waypoint`: an L4 "waypoint" that opens HBONE onward, with its own identity, to the endpoint
  its table names for each authority (a real waypoint load-balances; the table stands for that).
* `start_gateway`: a network gateway that forwards each CONNECT's bytes opaquely, as TCP, to the
  proxy its table names for the service hostname of the authority (the inner TLS passes through).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from hbone.client import HboneConnection
from hbone.errors import HboneError, HttpStatusError
from hbone.identity import Identity
from hbone.relay import Inbox, start_relay
from hbone.server import ConnectRequest, HboneServer
from hbone.settings import H2Settings
from hbone.tls import TlsCredentials, WorkloadCertificate
from ztunnel.identity.certificates import FakeCA

TRUST_DOMAIN = "cluster.local"


@dataclass(frozen=True)
class Onward:
    """Where a waypoint sends a CONNECT it received for some authority."""

    next_hop: tuple[str, int]  # the destination proxy's HBONE address
    authority: str  # the CONNECT authority it sends there
    identity: Identity  # the identity the destination proxy must present


@dataclass
class Seen:
    """One CONNECT a relay received."""

    authority: str
    peer_identity: str | None
    headers: dict[str, str]
    status: int = 0


@dataclass
class Relay:
    ip: str
    identity: Identity
    server: HboneServer
    seen: list[Seen] = field(default_factory=list)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    async def close(self) -> None:
        await self.server.shutdown(graceful=False)
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=1.0)


def certificate(identity: Identity) -> WorkloadCertificate:
    return FakeCA().issue(identity)


def _listener(ip: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((ip, port))
    sock.listen(128)
    sock.setblocking(False)
    return sock


async def dial(source_ip: str, addr: tuple[str, int]) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        sock.bind((source_ip, 0))
        await asyncio.get_running_loop().sock_connect(sock, addr)
    except BaseException:
        sock.close()
        raise
    return sock


async def _start(
    ip: str, identity: Identity, handle: Callable[[Relay, ConnectRequest], Awaitable[None]]
) -> Relay:
    cert = certificate(identity)
    relay_: Relay

    async def handler(req: ConnectRequest) -> None:
        task = asyncio.current_task()
        assert task is not None
        relay_.tasks.add(task)
        try:
            await handle(relay_, req)
        finally:
            relay_.tasks.discard(task)

    server = HboneServer(TlsCredentials.build(cert), handler, H2Settings(), TRUST_DOMAIN)
    relay_ = Relay(ip, identity, server)
    await server.serve(_listener(ip, 15008))
    return relay_


async def start_waypoint(ip: str, identity: Identity, table: Mapping[str, Onward]) -> Relay:
    """A waypoint on `<ip>:15008` forwarding each authority of `table` over a new HBONE connection."""
    cert = certificate(identity)

    async def handle(relay_: Relay, req: ConnectRequest) -> None:
        seen = Seen(req.authority, str(req.peer_identity) if req.peer_identity else None, req.headers)
        relay_.seen.append(seen)
        onward = table.get(req.authority)
        if onward is None:
            seen.status = 503
            req.respond(503)
            return
        try:
            sock = await dial(ip, onward.next_hop)
            conn = await HboneConnection.open(
                sock, TlsCredentials.build(cert), [onward.identity], H2Settings()
            )
        except (OSError, HboneError):
            seen.status = 503
            req.respond(503)
            return
        try:
            forwarded = f'for="{req.peer_addr[0]}:{req.peer_addr[1]}"'
            stream = await conn.connect(onward.authority, [("forwarded", forwarded)])
        except HttpStatusError as e:
            # The destination's answer (401 from its policy, 503 ...) goes back to the client.
            seen.status = e.status
            req.respond(e.status)
            conn.close()
            return
        except HboneError:
            seen.status = 503
            req.respond(503)
            conn.abort()
            return
        conn.close()  # one stream per connection: it closes once the stream ends
        seen.status = 200
        req.respond(200)
        start_relay(req.stream, stream)

    return await _start(ip, identity, handle)


async def start_gateway(ip: str, identity: Identity, table: Mapping[str, tuple[str, int]]) -> Relay:
    """An east/west gateway on `<ip>:15008`: `hostname:port` authorities are forwarded as opaque TCP
    to the address `table` gives for the hostname (the remote proxy's HBONE port)."""

    async def handle(relay_: Relay, req: ConnectRequest) -> None:
        seen = Seen(req.authority, str(req.peer_identity) if req.peer_identity else None, req.headers)
        relay_.seen.append(seen)
        hostname = req.authority.rpartition(":")[0]
        target = table.get(hostname)
        if target is None:
            seen.status = 503
            req.respond(503)
            return
        try:
            sock = await dial(ip, target)
        except OSError:
            seen.status = 503
            req.respond(503)
            return
        transport, inbox = await asyncio.get_running_loop().create_connection(Inbox, sock=sock)
        transport.pause_reading()
        seen.status = 200
        req.respond(200)
        start_relay(req.stream, transport, b_inbox=inbox)

    return await _start(ip, identity, handle)
