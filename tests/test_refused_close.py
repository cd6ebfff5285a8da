"""A plaintext connection the policy refuses (15006) is closed, never reset: its client reads the
end of stream whether its bytes arrived before the refusal or after it, and the proxy lets go once
the client closed too, or after the linger at the latest. Real loopback sockets, this test's loop."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from hbone.relay import Inbox
from tests.waiting import eventually_async
from ztunnel.proxy.inbound_passthrough import close_refused


@dataclass
class Accepted:
    transport: asyncio.Transport
    inbox: Inbox
    client: socket.socket


@pytest.fixture
async def accepted() -> AsyncIterator[Accepted]:
    """One connection: the proxy's side (a transport and its inbox), the client's (a socket)."""
    loop = asyncio.get_running_loop()
    made: list[Inbox] = []

    def protocol() -> Inbox:
        made.append(Inbox())
        return made[-1]

    server = await loop.create_server(protocol, "127.0.0.1", 0)
    client = socket.socket()
    client.setblocking(False)
    await loop.sock_connect(client, server.sockets[0].getsockname())
    await eventually_async(lambda: made and made[0].transport is not None, "the accepted connection")
    inbox = made[0]
    assert inbox.transport is not None
    try:
        yield Accepted(inbox.transport, inbox, client)
    finally:
        client.close()
        inbox.transport.abort()
        server.close()


async def test_bytes_sent_before_and_after_the_refusal_end_in_a_close(accepted: Accepted) -> None:
    loop = asyncio.get_running_loop()
    await loop.sock_sendall(accepted.client, b"sent before the refusal")
    await eventually_async(lambda: accepted.inbox.buffer, "the client's first bytes at the proxy")
    refusal = asyncio.create_task(close_refused(accepted.transport, accepted.inbox, linger=30))
    assert await asyncio.wait_for(loop.sock_recv(accepted.client, 100), 10) == b""  # the end, no byte
    # A client that sends on after the end: still read (a closed socket would answer with a reset).
    await loop.sock_sendall(accepted.client, b"sent after it")
    accepted.client.shutdown(socket.SHUT_WR)
    await asyncio.wait_for(refusal, 10)  # the proxy let go once the client closed its side
    assert accepted.transport.is_closing()
    assert await asyncio.wait_for(loop.sock_recv(accepted.client, 100), 10) == b""
    assert accepted.client.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0  # never reset


async def test_a_client_that_never_closes_is_let_go_after_the_linger(accepted: Accepted) -> None:
    loop = asyncio.get_running_loop()
    refusal = asyncio.create_task(close_refused(accepted.transport, accepted.inbox, linger=0.2))
    assert await asyncio.wait_for(loop.sock_recv(accepted.client, 100), 10) == b""
    await asyncio.wait_for(refusal, 10)  # ended by the linger: the client kept its side open
    assert accepted.transport.is_closing()
    assert accepted.client.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
