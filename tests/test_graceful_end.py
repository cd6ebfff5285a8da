"""A carried connection ended gracefully (a deleted pod's drain, `ConnectionRecord.carrier.end`): the
peer reads what the app had sent, then the end of it, as if the app had closed, and may still
answer; the connection completes once the peer closes too. Real loopback sockets, this test's loop
(in-pod mode's end to end: tests/test_inpod_drain.py, as root)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from hbone.relay import Inbox, RelayResult
from tests.waiting import eventually_async
from ztunnel.metrics.families import Metrics
from ztunnel.proxy.connections import carry
from ztunnel.proxy.telemetry import ConnectionRecord, Peer


@dataclass
class Carried:
    app: socket.socket  # the local app's end (outbound: it connected to the proxy)
    peer: socket.socket  # the far end
    record: ConnectionRecord
    registry: set[ConnectionRecord]
    done: asyncio.Future[RelayResult]


async def _pair(loop: asyncio.AbstractEventLoop) -> tuple[asyncio.Transport, Inbox, socket.socket]:
    """A connection: the proxy's side as a transport (reading paused, as accepted ones are), the
    other side as a non-blocking socket."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    other = socket.socket()
    other.setblocking(False)
    connecting = loop.create_task(loop.sock_connect(other, listener.getsockname()))
    sock, _ = await loop.sock_accept(listener)
    await connecting
    listener.close()
    transport, inbox = await loop.create_connection(Inbox, sock=sock)
    transport.pause_reading()
    return transport, inbox, other


@pytest.fixture
async def carried() -> AsyncIterator[Carried]:
    loop = asyncio.get_running_loop()
    down, down_inbox, app = await _pair(loop)
    up, up_inbox, peer = await _pair(loop)
    registry: set[ConnectionRecord] = set()
    record = ConnectionRecord(
        Metrics(process_metrics=False),
        direction="outbound",
        src_addr="127.0.0.1:1",
        dst_addr="127.0.0.1:2",
        src=Peer(),
        dst=Peer(),
        registry=registry,
    )
    done = carry(down, up, record, down_inbox=down_inbox, up_inbox=up_inbox)
    yield Carried(app, peer, record, registry, done)
    app.close()
    peer.close()
    down.abort()
    up.abort()


async def _read_to_end(sock: socket.socket) -> bytes:
    loop = asyncio.get_running_loop()
    got = b""
    async with asyncio.timeout(5):
        while chunk := await loop.sock_recv(sock, 65536):
            got += chunk
    return got


async def test_the_peer_reads_what_the_app_sent_then_the_end_and_may_still_answer(carried: Carried) -> None:
    loop = asyncio.get_running_loop()
    await loop.sock_sendall(carried.app, b"x" * 100_000)
    assert carried.record.carrier is not None
    carried.record.carrier.end("pod deleted")
    # What the app sent before the end, then the end (a FIN, no reset), as if the app had closed.
    assert await _read_to_end(carried.peer) == b"x" * 100_000
    assert not carried.done.done() and carried.record in carried.registry
    # The other way is still open: the peer's answer, then its own end, reach the app.
    await loop.sock_sendall(carried.peer, b"bye")
    carried.peer.shutdown(socket.SHUT_WR)
    assert await _read_to_end(carried.app) == b"bye"
    result = await asyncio.wait_for(carried.done, 5)
    assert (result.a_to_b, result.b_to_a) == (100_000, 3)
    await eventually_async(lambda: carried.record not in carried.registry, "the record finished")
    assert carried.record.carrier is None  # no cycle left between the record and its carrier


async def test_ending_twice_or_after_the_app_closed_changes_nothing(carried: Carried) -> None:
    loop = asyncio.get_running_loop()
    await loop.sock_sendall(carried.app, b"hi")
    carried.app.shutdown(socket.SHUT_WR)
    assert await _read_to_end(carried.peer) == b"hi"
    assert carried.record.carrier is not None
    carried.record.carrier.end("pod deleted")
    carried.record.carrier.end("pod deleted")
    carried.peer.close()
    result = await asyncio.wait_for(carried.done, 5)
    assert (result.a_to_b, result.b_to_a) == (2, 0)
