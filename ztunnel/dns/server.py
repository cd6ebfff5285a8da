"""The DNS proxy's server for one proxy instance: UDP and TCP on one address, answers from the
resolver (kept ready, keyed by the query's bytes and by its question, until the store changes), the
rest forwarded upstream.

It is given everything it uses (the state store, the client workload's source, the socket factory,
the metrics, the forwarder) and touches no globals, so it runs wherever the listeners run: a pod's
proxy creates its sockets inside the pod's namespace, and data-plane workers share the port through
the factory's SO_REUSEPORT.

Bad input costs only itself: a message too short for a header, or a FORMERR reply (answering it
could loop between two servers), is dropped; one that does not parse, a response, or one with other
than one question gets FORMERR; other opcodes NOTIMP; a TCP client
that does not send a whole message within the request timeout is closed. Work waiting on upstreams
or on the client workload is bounded; above the bound, queries get SERVFAIL at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import random
import socket
import time
from collections.abc import Awaitable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

import dns.flags
import dns.message
import dns.opcode
import dns.rcode
import dns.rdatatype

from mesh.model import Workload
from ztunnel.dns.forwarder import Forwarder, UpstreamError
from ztunnel.dns.replies import MIN_UDP_PAYLOAD, answer, question_name, response_for
from ztunnel.dns.resolver import ResolverSettings
from ztunnel.logs.lines import Bare, log_fields
from ztunnel.metrics.dns import DnsMetrics
from ztunnel.metrics.registry import CounterCell
from ztunnel.metrics.traffic import UNKNOWN
from ztunnel.sockets import SocketFactory
from ztunnel.state.store import ProxyState

log = logging.getLogger("dns")

TCP_REQUEST_TIMEOUT = 5.0
LOCAL_WORKLOAD_WAIT = 5.0
MAX_PENDING = 1024  # queries waiting on an upstream or on the client workload, per server
MAX_TCP_CONNECTIONS = 512
MAX_READY = 8192  # cached answers; the cache starts over when full
SHUFFLED_VARIANTS = 6  # ready orders of a multi-address answer (the reference shuffles every answer)
HEADER = 12
MAX_MESSAGE_LIMIT = 2**16 + 2  # the TCP reader's buffer: a length prefix and the largest message


class ClientWorkload(Protocol):
    """Where the server learns its client: the proxy instance's own workload."""

    def find_local_workload(self) -> Workload | None: ...

    def local_workload(self, timeout: float = ...) -> Awaitable[Workload | None]: ...


@dataclass(slots=True)
class _Ready:
    variants: tuple[bytes, ...]  # the reply without its ID
    requests: CounterCell


def _error_reply(data: bytes, rcode: int) -> bytes:
    """A header-only reply to a message we could not (or would not) parse: its ID and opcode kept."""
    flags = 0x8000 | (((data[2] >> 3) & 0x0F) << 11) | (rcode & 0x0F)
    return data[:2] + flags.to_bytes(2, "big") + bytes(8)


class DnsServer:
    def __init__(
        self,
        address: tuple[str, int],
        state: ProxyState,
        client: ClientWorkload,
        sockets: SocketFactory,
        metrics: DnsMetrics,
        forwarder: Forwarder,
        settings: ResolverSettings,
        *,
        cache: bool = True,
        loopback_v6: bool = False,
    ) -> None:
        self.address = address
        # Also `[::1]` on the same port, when this network namespace's loopback has it (the
        # reference's `localhost:15053` with IPv6 enabled).
        self.loopback_v6 = loopback_v6
        self.cache = cache  # off only to measure what it saves (benches/dns.py)
        self.state = state
        self.client = client
        self.sockets = sockets
        self.metrics = metrics
        self.forwarder = forwarder
        self.settings = settings
        # Ready answers by the query's bytes after its ID (the hot path: no parsing at all), and by
        # what of a parsed query decides the answer (for queries whose bytes vary, e.g. EDNS cookies).
        self._ready: dict[str, dict[bytes, _Ready]] = {"udp": {}, "tcp": {}}
        self._by_question: dict[str, dict[tuple[object, ...], _Ready]] = {"udp": {}, "tcp": {}}
        self._cells: dict[tuple[str, str, str, str], CounterCell] = {}
        self._pending = 0
        self._tcp_connections = 0
        self._udp: list[asyncio.DatagramTransport] = []
        self._tcp: list[asyncio.AbstractServer] = []
        self._socks: list[tuple[socket.socket, socket.socket]] | None = None
        self.addresses: list[tuple[str, int]] = []  # every address bound, `address` first
        self._tasks: set[asyncio.Task[Any]] = set()
        self._unsubscribe = state.subscribe(self._state_changed)

    def _state_changed(self) -> None:
        for caches in (self._ready, self._by_question):
            for ready in caches.values():
                ready.clear()

    # -- sockets -------------------------------------------------------------------------------

    def bind(self) -> None:
        """Bind UDP and TCP (an OSError, e.g. the port in use, is for the caller to report)."""
        for _ in range(20 if self.address[1] == 0 else 1):
            try:
                return self._bind()
            except OSError as e:
                if e.errno != errno.EADDRINUSE or self.address[1] != 0:
                    raise
        raise OSError(errno.EADDRINUSE, "no port free for both UDP and TCP")

    def _bind(self) -> None:
        host, port = self.address
        bound = [self._bind_pair(host, port)]
        port = bound[0][0].getsockname()[1]
        try:
            if self.loopback_v6:
                try:
                    bound.append(self._bind_pair("::1", port))
                except OSError as e:
                    if e.errno not in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
                        raise
                    log.debug("DNS proxy: no IPv6 loopback here (%s): 127.0.0.1 only", e.strerror)
        except BaseException:
            for pair in bound:
                for sock in pair:
                    sock.close()
            raise
        self._socks = bound
        self.address = (host, port)
        self.addresses = [(sock.getsockname()[0], port) for sock, _ in bound]

    def _bind_pair(self, host: str, port: int) -> tuple[socket.socket, socket.socket]:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        udp = self.sockets.datagram(family)
        try:
            if self.sockets.options.reuseport:
                udp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            udp.bind((host, port))
            # Port 0 (tests): TCP takes the port UDP was given (`bind` retries when TCP's is taken).
            tcp = self.sockets.listener(host, udp.getsockname()[1])
        except BaseException:
            udp.close()
            raise
        return udp, tcp

    async def start(self) -> None:
        if self._socks is None:
            self.bind()
        assert self._socks is not None
        loop = asyncio.get_running_loop()
        for udp, tcp in self._socks:
            transport, _ = await loop.create_datagram_endpoint(lambda: _UdpProtocol(self), sock=udp)
            self._udp.append(transport)
            self._tcp.append(await asyncio.start_server(self._serve_tcp, sock=tcp, limit=MAX_MESSAGE_LIMIT))

    async def close(self) -> None:
        self._unsubscribe()
        for transport in self._udp:
            transport.close()
        for server in self._tcp:
            server.close()
        if not self._tcp and self._socks is not None:
            for pair in self._socks:
                for sock in pair:
                    sock.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for server in self._tcp:
            with contextlib.suppress(Exception):
                await server.wait_closed()

    # -- one message ---------------------------------------------------------------------------

    def handle(self, data: bytes, protocol: str) -> bytes | Coroutine[Any, Any, bytes | None] | None:
        """The reply to one message now (None: no reply), or a coroutine producing it later."""
        ready = self._ready[protocol].get(data[2:])
        if ready is not None:
            ready.requests.inc()
            variants = ready.variants
            return data[:2] + (variants[0] if len(variants) == 1 else random.choice(variants))
        if len(data) < HEADER:
            return None
        if data[2] & 0x80 and data[3] & 0x0F == dns.rcode.FORMERR:
            # An error reply like ours: answering it could start a loop between two servers.
            return None
        try:
            query = dns.message.from_wire(data)
        except Exception:  # DNSException mostly; dnspython raises a few others on hostile input
            return _error_reply(data, dns.rcode.FORMERR)
        if query.flags & dns.flags.QR:
            return _error_reply(data, dns.rcode.FORMERR)
        if query.opcode() != dns.opcode.QUERY:
            return _error_reply(data, dns.rcode.NOTIMP)
        if len(query.question) != 1:
            return _error_reply(data, dns.rcode.FORMERR)
        client = self.client.find_local_workload()
        if client is not None:
            reply = self._answer(data, query, client, protocol)
            if reply is not None:
                return reply
        if self._pending >= MAX_PENDING:
            return self._wire(response_for(query, dns.rcode.SERVFAIL), query, protocol)
        return self._later(data, query, client, protocol)

    def _answer(
        self, data: bytes, query: dns.message.Message, client: Workload, protocol: str
    ) -> bytes | None:
        """Our own reply (and into the cache with it), or None to forward."""
        key = _question_key(query)
        known = self._by_question[protocol].get(key) if self.cache else None
        if known is not None:
            known.requests.inc()
            return data[:2] + random.choice(known.variants)
        requests = self._requests(query, client, protocol)
        requests.inc()
        response = answer(self.state, client, query, self.settings)
        if response is None:
            return None
        wire = self._wire(response, query, protocol)
        self._log(client, query, "success", response)
        if not self.cache:
            return wire
        variants = [wire[2:]]
        if sum(len(rrset) for rrset in response.answer) > 1:
            for _ in range(SHUFFLED_VARIANTS - 1):
                again = answer(self.state, client, query, self.settings)
                if again is not None:
                    variants.append(self._wire(again, query, protocol)[2:])
        entry = _Ready(tuple(variants), requests)
        by_bytes, by_question = self._ready[protocol], self._by_question[protocol]
        if len(by_bytes) >= MAX_READY or len(by_question) >= MAX_READY:
            by_bytes.clear()
            by_question.clear()
        by_bytes[data[2:]] = by_question[key] = entry
        return wire

    async def _finish(
        self, data: bytes, query: dns.message.Message, client: Workload | None, protocol: str
    ) -> bytes | None:
        if client is None:
            client = await self.client.local_workload(LOCAL_WORKLOAD_WAIT)
            if client is None:
                log_fields(
                    log, logging.DEBUG, "dns request", {"query": _qtype(query), "result": "no workload"}
                )
                return self._wire(response_for(query, dns.rcode.SERVFAIL), query, protocol)
            reply = self._answer(data, query, client, protocol)
            if reply is not None:
                return reply
        labels = self._labels(query, client, protocol)
        self.metrics.upstream_requests.cell(labels).inc()
        started = time.monotonic()
        try:
            reply = await self.forwarder.forward(data, tcp=protocol == "tcp")
        except UpstreamError as e:
            self.metrics.upstream_failures.cell(labels).inc()
            self.metrics.upstream_duration.observe(labels, time.monotonic() - started)
            log_fields(
                log,
                logging.DEBUG,
                "dns request",
                {**self._client_fields(client, query), "result": "upstream failure", "error": str(e)},
            )
            return self._wire(response_for(query, dns.rcode.SERVFAIL), query, protocol)
        self.metrics.upstream_duration.observe(labels, time.monotonic() - started)
        if log.isEnabledFor(logging.DEBUG):
            log_fields(
                log,
                logging.DEBUG,
                "dns request",
                {**self._client_fields(client, query), "result": "forwarded"},
            )
        # Relayed, not ours: never authoritative.
        return reply[:2] + bytes((reply[2] & ~0x04,)) + reply[3:]

    def _later(
        self, data: bytes, query: dns.message.Message, client: Workload | None, protocol: str
    ) -> Coroutine[Any, Any, bytes | None]:
        self._pending += 1

        async def run() -> bytes | None:
            try:
                return await self._finish(data, query, client, protocol)
            finally:
                self._pending -= 1

        return run()

    # -- details -------------------------------------------------------------------------------

    def _labels(
        self, query: dns.message.Message, client: Workload, protocol: str
    ) -> tuple[str, str, str, str]:
        return (
            _qtype(query),
            protocol,
            client.canonical_name or client.workload_name or client.name or UNKNOWN,
            client.canonical_revision or UNKNOWN,
        )

    def _requests(self, query: dns.message.Message, client: Workload, protocol: str) -> CounterCell:
        labels = self._labels(query, client, protocol)
        cell = self._cells.get(labels)
        if cell is None:
            cell = self._cells[labels] = self.metrics.requests.cell(labels)
        return cell

    def _wire(self, response: dns.message.Message, query: dns.message.Message, protocol: str) -> bytes:
        """Over UDP, at most what the client can take (its EDNS payload, else 512): TC set beyond."""
        limit = 0
        if protocol == "udp":
            limit = max(query.payload, MIN_UDP_PAYLOAD) if query.edns >= 0 else MIN_UDP_PAYLOAD
        return response.to_wire(max_size=limit, prefer_truncation=True)

    def _client_fields(self, client: Workload, query: dns.message.Message) -> dict[str, object]:
        return {
            "src.workload": client.workload_name or client.name or None,
            "src.namespace": client.namespace or None,
            "query": _qtype(query),
            "domain": question_name(query),
        }

    def _log(
        self, client: Workload, query: dns.message.Message, result: str, response: dns.message.Message
    ) -> None:
        if not log.isEnabledFor(logging.DEBUG):
            return
        endpoints = [
            r.to_text() for rrset in response.answer if rrset.rdtype != dns.rdatatype.CNAME for r in rrset
        ]
        log_fields(
            log,
            logging.DEBUG,
            "dns request",
            {
                **self._client_fields(client, query),
                "result": result if endpoints else "no records",
                "endpoints": Bare("[" + ", ".join(endpoints) + "]"),
            },
        )

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- transports ----------------------------------------------------------------------------

    async def _serve_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        if self._tcp_connections >= MAX_TCP_CONNECTIONS:
            writer.transport.abort()
            return
        self._tcp_connections += 1
        try:
            while True:
                async with asyncio.timeout(TCP_REQUEST_TIMEOUT):
                    size = int.from_bytes(await reader.readexactly(2), "big")
                    data = await reader.readexactly(size)
                reply = self.handle(data, "tcp")
                if reply is not None and not isinstance(reply, bytes):
                    reply = await reply
                if reply is None:
                    break
                writer.write(len(reply).to_bytes(2, "big") + reply)
                await writer.drain()
        except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
            pass
        except Exception:
            log.exception("dns: TCP request handling failed")
        finally:
            self._tcp_connections -= 1
            writer.close()
            if task is not None:
                self._tasks.discard(task)


class _UdpProtocol(asyncio.DatagramProtocol):
    def __init__(self, server: DnsServer) -> None:
        self.server = server
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: Any) -> None:
        try:
            reply = self.server.handle(data, "udp")
        except Exception:
            log.exception("dns: UDP request handling failed")
            return
        if reply is None:
            return
        if isinstance(reply, bytes):
            self._send(reply, addr)
        else:
            self.server._spawn(self._later(reply, addr))

    async def _later(self, reply: Coroutine[Any, Any, bytes | None], addr: Any) -> None:
        try:
            out = await reply
        except Exception:
            log.exception("dns: UDP request handling failed")
            return
        if out is not None:
            self._send(out, addr)

    def _send(self, data: bytes, addr: Any) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.sendto(data, addr)

    def error_received(self, exc: Exception) -> None:
        pass  # e.g. a client's ICMP port unreachable: nothing to do


def _question_key(query: dns.message.Message) -> tuple[object, ...]:
    """What of a query its answer depends on: the question as written (the reply echoes its case),
    the flags copied into the reply, and the EDNS echoed."""
    q = query.question[0]
    return (
        q.name.to_wire(),
        q.rdtype,
        q.rdclass,
        query.flags & (dns.flags.RD | dns.flags.CD),
        query.edns,
        query.ednsflags & dns.flags.DO,
        query.payload,
    )


def _qtype(query: dns.message.Message) -> str:
    return dns.rdatatype.to_text(query.question[0].rdtype).lower()
