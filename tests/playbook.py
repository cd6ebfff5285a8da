"""The listeners' playbook: one proxy's listeners driven in this process, without a network.

A proxy is built as `build_proxy` builds it (`proxy_context`: the real `Config`, `ProxyState` from a
local config, policies, `SecretManager`, `Metrics`, admission rules and connection tracker); only the
edges where it meets the network are fakes, and each records what crossed it:

* `FakeSockets`, the proxy's `SocketFactory`: every TCP dial (address, source, transparency,
  timeout); a dial that succeeds is one end of a socket pair whose other end is the app's
  (`apps`), one to a `refusing` address fails as the kernel's would, one to a `silent` address
  times out when its timeout has passed.
* `FakePeer`, the outbound side's `Tunnels`: every HBONE connection dialled (its pool key) and every
  CONNECT sent on one (authority, headers, early data), answered as told.
* `FakeSession`, the HTTP/2 connection under one real `HboneStream`: the HEADERS, DATA, END_STREAM and
  resets the stream sent.
* The clock: everything runs on `run`'s event loop (asyncio's selector loop, not uvloop, whose
  clock cannot be replaced), whose time moves only when no callback is ready and no socket is, by
  as much as the next timer needs. A 5 s wait or a 10 s timeout takes no real time, and a row can
  state when (`loop.time()`) something was answered. Nothing a playbook waits for may come from a
  thread (a resolver's, an executor's): the clock would jump past it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import selectors
import socket
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from prometheus_client.openmetrics.parser import text_string_to_metric_families

from hbone.errors import HttpStatusError, StreamResetError
from hbone.identity import Identity
from hbone.pool import PoolKey
from hbone.relay import Inbox
from hbone.stream import HboneStream
from hbone.tls import TlsCredentials
from mesh.localconfig import parse_local_config
from ztunnel.config.settings import Config, WorkloadInfo
from ztunnel.identity.certificates import FakeCA, SecretManager
from ztunnel.metrics.families import Metrics
from ztunnel.proxy.context import ProxyContext
from ztunnel.proxy.instance import ProxyInputs, proxy_context
from ztunnel.proxy.local import LocalWorkload
from ztunnel.proxy.upstream import Upstreams
from ztunnel.sockets import SocketFactory, SocketOptions
from ztunnel.state.store import ProxyState

T = TypeVar("T")

# --- the clock ------------------------------------------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0


class _VirtualSelector(selectors.BaseSelector):
    """The loop's selector: it looks at the sockets without waiting; when none is ready and the loop
    would wait for a timer, the clock jumps to that timer instead. With no timer at all it waits
    for the sockets for real (a thread's result arriving)."""

    def __init__(self, clock: _Clock) -> None:
        self._real = selectors.DefaultSelector()
        self._clock = clock

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._real.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.modify(fileobj, events, data)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = self._real.select(0)
        if ready or (timeout is not None and timeout <= 0):
            return ready
        if timeout is None:
            return self._real.select(None)
        self._clock.now += timeout
        return []

    def close(self) -> None:
        self._real.close()

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return self._real.get_map()


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop on a virtual clock (see `_VirtualSelector`)."""

    def __init__(self) -> None:
        self._clock = _Clock()
        super().__init__(_VirtualSelector(self._clock))

    def time(self) -> float:
        return self._clock.now


def run(main: Callable[[], Awaitable[T]], *, limit: float = 600.0) -> T:
    """Run `main()` on a `VirtualTimeLoop`; a playbook that is still waiting `limit` virtual seconds
    later fails (a wait that nothing ends would otherwise spin the clock forever)."""

    async def bounded() -> T:
        async with asyncio.timeout(limit):
            return await main()

    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(bounded())


def now() -> float:
    return asyncio.get_running_loop().time()


# --- TCP: the proxy's sockets ---------------------------------------------------------------------


@dataclass(frozen=True)
class Dial:
    """One TCP connection the proxy asked for."""

    addr: tuple[str, int]
    source_ip: str | None = None
    transparent: bool = False
    timeout: float = 10.0


class App:
    """The far end of a TCP connection the proxy made (the app, or a TCP upstream), or the client
    app of an outbound connection: bytes in and out, and its end."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self._streams is None:
            self._streams = await asyncio.open_connection(sock=self.sock)
        return self._streams

    async def send(self, data: bytes) -> None:
        _, writer = await self._open()
        writer.write(data)
        await writer.drain()

    async def read(self, n: int) -> bytes:
        """Exactly `n` bytes (fewer only if the connection ends first)."""
        reader, _ = await self._open()
        try:
            return await reader.readexactly(n)
        except asyncio.IncompleteReadError as e:
            return e.partial

    async def read_to_end(self) -> bytes:
        """Everything until the proxy ends its side (EOF, or a reset: what came before it)."""
        reader, _ = await self._open()
        try:
            return await reader.read()
        except ConnectionResetError:
            return b""

    async def end(self) -> None:
        """Half-close: the app has nothing more to send."""
        _, writer = await self._open()
        writer.write_eof()

    def close(self) -> None:
        if self._streams is not None:
            self._streams[1].close()
        else:
            self.sock.close()

    async def closed(self) -> None:
        """Closed, its transport's end included (a loop iteration or two)."""
        self.close()
        if self._streams is not None:
            with contextlib.suppress(OSError):  # what ended it (a reset) was observed, or not, before
                await self._streams[1].wait_closed()


class FakeSockets(SocketFactory):
    """The proxy's TCP dials, recorded and answered in this process (see the module's docstring)."""

    def __init__(self) -> None:
        super().__init__(SocketOptions(source_ports=(40000, 40009)))
        self.dials: list[Dial] = []
        self.apps: list[App] = []
        self.refusing: set[tuple[str, int]] = set()
        self.silent: set[tuple[str, int]] = set()

    async def connect(
        self,
        addr: tuple[str, int],
        *,
        source_ip: str | None = None,
        transparent: bool = False,
        timeout: float = 10.0,
    ) -> socket.socket:
        self.dials.append(Dial(addr, source_ip, transparent, timeout))
        if addr in self.refusing:
            raise ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")
        if addr in self.silent:
            await asyncio.sleep(timeout)
            raise TimeoutError
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        theirs.setblocking(False)
        self.apps.append(App(theirs))
        return ours

    def listener(self, host: str, port: int, *, transparent: bool = False) -> socket.socket:
        raise AssertionError("a playbook binds no listener")


# --- HBONE: streams, and the peers the proxy dials -----------------------------------------------


class FakeSession:
    """The HTTP/2 connection one `HboneStream` believes it is on (`hbone.stream.StreamSession`): what
    the stream sends is recorded; the test delivers what the peer sends by the stream's
    `received_*` methods."""

    def __init__(self, peer_identity: Identity | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        self.extra: dict[str, Any] = {}
        self.peer_identity = peer_identity
        self.headers: list[list[tuple[str, str]]] = []  # every HEADERS sent
        self.data = bytearray()  # every DATA payload sent, joined
        self.ended = False  # END_STREAM sent
        self.resets: list[int] = []  # RST_STREAM codes sent
        self.changed = asyncio.Event()

    @property
    def transport(self) -> asyncio.Transport | None:
        return None

    def _sent(self) -> None:
        self.changed.set()

    def send_data(self, stream_id: int, data: bytes | memoryview) -> int:
        self.data += data
        self._sent()
        return len(data)

    def send_headers(
        self, stream_id: int, headers: list[tuple[str, str]], end_stream: bool, *, flush: bool = True
    ) -> bool:
        self.headers.append(list(headers))
        self.ended = self.ended or end_stream
        self._sent()
        return True

    def end_stream(self, stream_id: int) -> None:
        self.ended = True
        self._sent()

    def reset(self, stream_id: int, error_code: int) -> None:
        self.resets.append(error_code)
        self._sent()

    def ack(self, stream_id: int, n: int) -> None:
        pass

    def kick(self) -> None:
        pass

    def want_window(self, stream: HboneStream) -> None:
        pass

    def window_satisfied(self, stream: HboneStream) -> None:
        pass

    def forget(self, stream: HboneStream) -> None:
        pass

    async def wait_for(self, done: Callable[[], bool]) -> None:
        """Until `done()` holds of what the stream has sent."""
        while not done():
            self.changed.clear()
            await self.changed.wait()

    @property
    def status(self) -> int | None:
        """The response status sent (server side)."""
        for headers in self.headers:
            for k, v in headers:
                if k == ":status":
                    return int(v)
        return None

    @property
    def response_headers(self) -> dict[str, str]:
        return {k: v for headers in self.headers[:1] for k, v in headers if not k.startswith(":")}


@dataclass
class Connect:
    """One CONNECT the proxy sent to an HBONE peer."""

    connection: int  # which dialled connection (1 = the first; 0 = an inner one)
    authority: str
    headers: dict[str, str]
    early_data: bytes
    session: FakeSession = field(repr=False)


@dataclass(frozen=True)
class Answer:
    """How a fake HBONE peer answers: a dial fails with `dial_error`, else every CONNECT gets `status`
    (and `headers`), or is reset with `reset`."""

    dial_error: BaseException | None = None
    status: int = 200
    headers: Sequence[tuple[str, str]] = ()
    reset: int | None = None


class FakeConnection:
    """An HBONE connection to a fake peer (`hbone.pool.PooledConnection`)."""

    def __init__(self, peer: FakePeer, number: int) -> None:
        self.peer = peer
        self.number = number
        self.closed = False
        self.streams = 0

    @property
    def max_streams(self) -> int:
        return 100

    @property
    def active_streams(self) -> int:
        return self.streams

    def is_usable(self) -> bool:
        return not self.closed

    async def connect(
        self, authority: str, headers: Sequence[tuple[str, str]] = (), early_data: bytes = b""
    ) -> HboneStream:
        session = FakeSession(self.peer.identity)
        self.peer.connects.append(Connect(self.number, authority, dict(headers), early_data, session))
        answer = self.peer.answer
        if answer.reset is not None:
            raise StreamResetError(answer.reset)
        if answer.status != 200:
            raise HttpStatusError(answer.status, answer.headers)
        self.streams += 1
        stream = HboneStream(session, 2 * self.streams - 1, high_water=1 << 16, client_side=True)
        stream.received_response([(":status", "200"), *answer.headers])
        self.peer.streams.append(stream)
        return stream

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True


class FakePeer:
    """Every HBONE peer the proxy dials (`ztunnel.proxy.upstream.Tunnels`), answering as `answer` says."""

    def __init__(self) -> None:
        self.answer = Answer()
        self.identity: Identity | None = None
        self.dials: list[PoolKey] = []
        self.connections: list[FakeConnection] = []
        self.connects: list[Connect] = []
        self.streams: list[HboneStream] = []  # every CONNECT answered 200, the proxy's end of it
        self.inner_identities: list[tuple[Identity, ...]] = []  # double HBONE: what each inner TLS expected

    async def dial(self, key: PoolKey) -> FakeConnection:
        self.dials.append(key)
        if self.answer.dial_error is not None:
            raise self.answer.dial_error
        conn = FakeConnection(self, len(self.dials))
        self.connections.append(conn)
        return conn

    async def inner(
        self, outer: HboneStream, credentials: TlsCredentials, expected: tuple[Identity, ...]
    ) -> FakeConnection:
        self.inner_identities.append(expected)
        return FakeConnection(self, 0)


def connect_request_stream(identity: Identity | None) -> tuple[HboneStream, FakeSession]:
    """A server-side CONNECT stream as the inbound listener receives it, on a fake connection."""
    session = FakeSession(identity)
    return HboneStream(session, 1, high_water=1 << 16), session


# --- the proxy ------------------------------------------------------------------------------------


@dataclass
class PlaybookProxy:
    """One proxy's context as `build_proxy` makes it, over the fakes, with its outbound upstreams."""

    ctx: ProxyContext
    state: ProxyState
    sockets: FakeSockets
    peer: FakePeer
    upstreams: Upstreams
    clients: list[App] = field(default_factory=list)

    async def accept(self) -> tuple[App, asyncio.Transport, Inbox]:
        """A connection as a listener accepts it: the client app's end, and the proxy's transport with
        its `Inbox` (reading, as accepted)."""
        app_end, proxy_end = socket.socketpair()
        app_end.setblocking(False)
        proxy_end.setblocking(False)
        transport, inbox = await asyncio.get_running_loop().create_connection(Inbox, sock=proxy_end)
        client = App(app_end)
        self.clients.append(client)
        return client, transport, inbox

    async def settled(self) -> None:
        """Until every connection the proxy carries has ended, and its record with it."""
        pending = self.ctx.tasks.pending()
        if pending:
            await asyncio.wait(pending)
        while self.ctx.connections:  # a record completes in its relay's done callback
            await asyncio.sleep(0.001)

    async def close(self) -> None:
        for t in self.ctx.tasks.pending():
            t.cancel()
        for app in (*self.clients, *self.sockets.apps):
            await app.closed()
        await self.upstreams.close()
        await self.ctx.secrets.close()
        self.ctx.tracker.close()
        self.ctx.local.close()

    def closed_flags(self) -> dict[str, int]:
        """`istio_tcp_connections_closed_total` by `response_flags`, as scraped from `/metrics`."""
        return flag_counts(self.ctx.metrics)


def flag_counts(metrics: Metrics) -> dict[str, int]:
    body, _ = metrics.render(None)
    counts: dict[str, int] = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            if sample.name == "istio_tcp_connections_closed_total":
                flags = sample.labels["response_flags"]
                counts[flags] = counts.get(flags, 0) + int(sample.value)
    return counts


def mesh_state(mesh: str) -> ProxyState:
    state = ProxyState()
    state.apply_local_config(parse_local_config(mesh))
    return state


def proxy(
    state: ProxyState, info: WorkloadInfo, config: Config | None = None, *, spoof_source: bool = False
) -> PlaybookProxy:
    """The proxy of workload `info` over `state` (call inside `run`). `spoof_source`: what binding
    transparent listeners allows in a pod (the app sees the client's own address)."""
    config = config or Config()
    inputs = ProxyInputs(config, state, SecretManager(FakeCA()), Metrics(process_metrics=False))
    sockets = FakeSockets()
    ctx = proxy_context(inputs, LocalWorkload(config, state, info), sockets, spoof_source=spoof_source)
    peer = FakePeer()
    upstreams = Upstreams(ctx, tunnels=peer, clock=asyncio.get_running_loop().time)
    return PlaybookProxy(ctx, state, sockets, peer, upstreams)
