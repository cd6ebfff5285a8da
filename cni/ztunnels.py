"""The agent's side of one ZDS connection: a connected ztunnel.

The conversation is strict request/response: after ztunnel's `ZdsHello`, the agent sends one
`WorkloadRequest` at a time and waits at most 5 s for the `WorkloadResponse`. Anything else drops the
connection: no answer in time, an answer nobody asked for, fds from ztunnel, an undecodable packet.

One reader per connection stays registered with the loop for the connection's whole life (uvloop has
no `sock_recvmsg`), so an idle ztunnel that goes away is noticed at once, and unsolicited data is a
protocol error even when no request is outstanding. It hands each expected packet to the request
waiting for it.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Sequence

from xds import zds

log = logging.getLogger("cni.agent")

RESPONSE_TIMEOUT = 5.0
HELLO_TIMEOUT = 5.0


class ZtunnelGone(Exception):
    """The connection dropped (or was dropped) before ztunnel answered."""


class ZtunnelConnection:
    def __init__(
        self, sock: socket.socket, number: int, on_close: Callable[[ZtunnelConnection], None]
    ) -> None:
        self.sock = sock
        self.number = number
        self.lock = asyncio.Lock()  # held for one exchange, or for a whole snapshot
        self.closed_reason: str | None = None
        self._on_close = on_close
        self._loop = asyncio.get_running_loop()
        self._fileno = sock.fileno()
        sock.setblocking(False)
        # The first packet expected is the hello: wait for it from the start.
        self._waiter: asyncio.Future[bytes] | None = self._loop.create_future()
        self._loop.add_reader(self._fileno, self._readable)

    def __str__(self) -> str:
        return f"ztunnel connection #{self.number}"

    @property
    def closed(self) -> bool:
        return self.closed_reason is not None

    async def hello(self) -> None:
        """Wait for ztunnel's `ZdsHello` (V1). Raises ZtunnelGone, after dropping the connection."""
        waiter = self._waiter
        assert waiter is not None
        try:
            data = await asyncio.wait_for(waiter, HELLO_TIMEOUT)
        except TimeoutError:
            self.close(f"no ZdsHello within {HELLO_TIMEOUT:g}s")
            raise ZtunnelGone(self.closed_reason) from None
        finally:
            self._waiter = None
        try:
            version = zds.decode_hello(data).version
        except zds.ZdsError as e:
            self.close(str(e))
            raise ZtunnelGone(self.closed_reason) from None
        if version != zds.V1:
            self.close(f"unsupported ZDS version {version}")
            raise ZtunnelGone(self.closed_reason)

    async def request(self, data: bytes, fds: Sequence[int] = ()) -> str:
        """Send one message and return ztunnel's answer: "" for ACK, the error text of a NACK."""
        async with self.lock:
            return await self.exchange(data, fds)

    async def exchange(self, data: bytes, fds: Sequence[int] = ()) -> str:
        """`request` for a caller already holding `lock`.

        Raises ZtunnelGone when the connection is or gets dropped, and ZdsError (connection kept)
        when the message cannot be sent at all (larger than a ZDS packet)."""
        if self.closed:
            raise ZtunnelGone(self.closed_reason)
        waiter = self._waiter = self._loop.create_future()
        try:
            async with asyncio.timeout(RESPONSE_TIMEOUT):
                await self._send(data, fds)
                reply = await waiter
        except TimeoutError:
            self.close(f"no WorkloadResponse within {RESPONSE_TIMEOUT:g}s")
            raise ZtunnelGone(self.closed_reason) from None
        except OSError as e:
            self.close(f"write failed: {e.strerror or e}")
            raise ZtunnelGone(self.closed_reason) from None
        finally:
            self._waiter = None
        try:
            return str(zds.decode_response(reply).ack.error)
        except zds.ZdsError as e:
            self.close(str(e))
            raise ZtunnelGone(self.closed_reason) from None

    async def _send(self, data: bytes, fds: Sequence[int]) -> None:
        while True:
            try:
                zds.send_packet(self.sock, data, fds)
                return
            except BlockingIOError:
                writable: asyncio.Future[None] = self._loop.create_future()
                self._loop.add_writer(self._fileno, _wake, writable)
                try:
                    await writable
                finally:
                    if not self.closed:  # once closed, the fd number may belong to someone else
                        self._loop.remove_writer(self._fileno)

    def _readable(self) -> None:
        while not self.closed:
            try:
                packet = zds.recv_packet(self.sock)
            except BlockingIOError:
                return
            except zds.ZdsError as e:
                self.close(str(e))
                return
            except OSError as e:
                self.close(f"read failed: {e.strerror or e}")
                return
            if packet is None:
                self.close("ztunnel closed the connection")
                return
            data, fds = packet
            if fds:
                zds.close_fds(fds)
                self.close("ztunnel sent file descriptors")
                return
            waiter = self._waiter
            if waiter is None or waiter.done():
                self.close("unexpected message from ztunnel (no request outstanding)")
                return
            waiter.set_result(data)

    def close(self, reason: str) -> None:
        if self.closed:
            return
        self.closed_reason = reason
        self._loop.remove_reader(self._fileno)
        self._loop.remove_writer(self._fileno)
        self.sock.close()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(ZtunnelGone(reason))
        log.info("%s closed: %s", self, reason)
        self._on_close(self)


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
