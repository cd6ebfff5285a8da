"""Our HBONE client against code we did not write: nghttpx as the HTTP/2 CONNECT proxy (mTLS with
`--verify-client`, TLS 1.3, ALPN h2) in front of tinyproxy, which opens the TCP connection to an
echo server. Bytes must round-trip through CONNECT, flow control and half-close of a foreign peer.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from hbone.client import HboneConnection
from hbone.errors import H2HandshakeError, HttpStatusError, IdentityMismatch, TlsHandshakeError
from hbone.identity import Identity
from hbone.settings import H2Settings
from hbone.tls import TlsCredentials, WorkloadCertificate
from tests.certs import CA, issue, make_ca, spiffe
from tests.netns import require_tools

pytestmark = [pytest.mark.interop, pytest.mark.timeout(60)]

PROXY_ID = spiffe(namespace="istio-system", sa="nghttpx")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-2000:] if log.exists() else ""


def _wait_listening(
    name: str, port: int, proc: subprocess.Popen[bytes], log: Path, timeout: float = 10.0
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}: {_tail(log)}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{name} is not listening on {port}: {_tail(log)}")


def _spawn(
    name: str, argv: Callable[[int], list[str]], log: Path, attempts: int = 3
) -> tuple[subprocess.Popen[bytes], int]:
    """Start a server on a free port; if the port was taken meanwhile (it exits), try another."""
    for attempt in range(attempts):
        port = _free_port()
        with log.open("wb") as out:
            proc = subprocess.Popen(
                argv(port),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        try:
            _wait_listening(name, port, proc, log)
            return proc, port
        except RuntimeError:
            _stop(proc)
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)  # its own session: nghttpx forks a worker
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


@dataclass
class NghttpxFront:
    ca: CA
    proxy_cert: WorkloadCertificate
    port: int
    echo_listeners: list[socket.socket]  # bound and listening; tinyproxy allows CONNECT to them


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NghttpxFront]:
    require_tools("nghttpx", "tinyproxy", hint="Debian packages nghttp2-proxy, tinyproxy")
    d = tmp_path_factory.mktemp("interop")
    ca = make_ca()
    cert = issue(ca, PROXY_ID)
    (d / "key.pem").write_bytes(cert.key_pem)
    (d / "cert.pem").write_bytes(b"".join(cert.chain_pem))
    (d / "ca.pem").write_bytes(ca.root_pem)
    os.chmod(d / "key.pem", 0o600)

    echo_listeners = []
    for _ in range(3):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        s.setblocking(False)
        echo_listeners.append(s)
    echo_ports = [s.getsockname()[1] for s in echo_listeners]

    def tinyproxy(port: int) -> list[str]:
        (d / "tinyproxy.conf").write_text(
            f"Port {port}\nListen 127.0.0.1\nTimeout 30\nAllow 127.0.0.1\nMaxClients 50\nLogLevel Info\n"
            + "".join(f"ConnectPort {p}\n" for p in echo_ports)
        )
        return ["tinyproxy", "-d", "-c", str(d / "tinyproxy.conf")]

    procs: list[subprocess.Popen[bytes]] = []
    try:
        tiny, tiny_port = _spawn("tinyproxy", tinyproxy, d / "tinyproxy.log")
        procs.append(tiny)

        def nghttpx(port: int) -> list[str]:
            return [
                "nghttpx",
                "--conf=/dev/null",
                "--http2-proxy",
                f"--frontend=127.0.0.1,{port}",
                f"--backend=127.0.0.1,{tiny_port}",
                "--workers=1",
                "--no-ocsp",
                "--tls-min-proto-version=TLSv1.3",
                "--verify-client",
                f"--verify-client-cacert={d / 'ca.pem'}",
                "--accesslog-file=/dev/null",
                str(d / "key.pem"),
                str(d / "cert.pem"),
            ]

        ng, ng_port = _spawn("nghttpx", nghttpx, d / "nghttpx.log")
        procs.append(ng)
        yield NghttpxFront(ca, cert, ng_port, echo_listeners)
    finally:
        for p in reversed(procs):
            _stop(p)
        for s in echo_listeners:
            s.close()


async def _echo_server(sock: socket.socket) -> asyncio.AbstractServer:
    """Echoes the number of bytes announced in an 8-byte prefix, then closes.

    nghttpx does not turn a client's END_STREAM on a CONNECT tunnel into a half-close towards an
    HTTP/1 backend, so the end of the exchange comes from the server side.
    """

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            remaining = int.from_bytes(await reader.readexactly(8), "big")
            while remaining:
                data = await reader.read(min(remaining, 256 * 1024))
                if not data:
                    break
                remaining -= len(data)
                writer.write(data)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(handle, sock=sock)


async def _open(proxy: NghttpxFront, cert: WorkloadCertificate, expected: list[Identity]) -> HboneConnection:
    sock = socket.socket()
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", proxy.port))
    return await HboneConnection.open(
        sock, TlsCredentials.build(cert), expected, H2Settings(), handshake_timeout=5.0
    )


class Sink(asyncio.Protocol):
    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        self.hash = hashlib.sha256()
        self.data = bytearray()
        self.count = 0
        self.eof = loop.create_future()
        self.lost: asyncio.Future[Exception | None] = loop.create_future()

    def data_received(self, data: bytes) -> None:
        self.count += len(data)
        self.hash.update(data)
        if len(self.data) < 4096:
            self.data += data

    def eof_received(self) -> bool:
        if not self.eof.done():
            self.eof.set_result(None)
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.lost.done():
            self.lost.set_result(exc)


async def test_connect_through_nghttpx_and_tinyproxy_round_trips(proxy: NghttpxFront) -> None:
    listener = proxy.echo_listeners[0]
    port = listener.getsockname()[1]
    echo = await _echo_server(listener)
    try:
        client = issue(proxy.ca, spiffe(namespace="default", sa="client"))
        conn = await _open(proxy, client, [Identity.parse(PROXY_ID)])
        assert str(conn.peer_identity) == PROXY_ID
        ssl_object = conn.get_extra_info("ssl_object")
        assert ssl_object.version() == "TLSv1.3"  # type: ignore[attr-defined]
        assert ssl_object.selected_alpn_protocol() == "h2"  # type: ignore[attr-defined]

        stream = await conn.connect(f"127.0.0.1:{port}", [("baggage", "k8s.namespace.name=default")])
        assert stream.status == 200
        sink = Sink()
        stream.set_protocol(sink)
        # 2 MiB: nghttpx's 64 KiB windows make our sender wait for its WINDOW_UPDATEs
        payload = b"hello through nghttpx" + os.urandom(2 * 1024 * 1024)
        stream.write(len(payload).to_bytes(8, "big"))
        stream.write(payload)
        await asyncio.wait_for(sink.eof, 20)  # the echo server closed: END_STREAM from nghttpx
        assert sink.count == len(payload)
        assert bytes(sink.data[:21]) == b"hello through nghttpx"
        assert sink.hash.hexdigest() == hashlib.sha256(payload).hexdigest()
        stream.write_eof()
        assert await asyncio.wait_for(sink.lost, 10) is None

        # a second stream on the same connection
        stream2 = await conn.connect(f"127.0.0.1:{port}")
        sink2 = Sink()
        stream2.set_protocol(sink2)
        stream2.write((5).to_bytes(8, "big") + b"again")
        await asyncio.wait_for(sink2.eof, 10)
        assert bytes(sink2.data) == b"again"
        stream2.close()
        conn.close()
        await asyncio.wait_for(conn.wait_closed(), 10)
    finally:
        echo.close()


async def test_early_data_with_the_connect_reaches_the_target_through_nghttpx(proxy: NghttpxFront) -> None:
    """What an app sent before the tunnel was up goes with the CONNECT (before nghttpx's 200): a
    foreign CONNECT proxy must hold it and deliver it once the tunnel is up, in order."""
    listener = proxy.echo_listeners[2]
    echo = await _echo_server(listener)
    try:
        client = issue(proxy.ca, spiffe(namespace="default", sa="client"))
        conn = await _open(proxy, client, [Identity.parse(PROXY_ID)])
        early = b"sent before the 200" + os.urandom(100_000)  # more than nghttpx's first window
        framed = len(early).to_bytes(8, "big") + early
        stream = await conn.connect(f"127.0.0.1:{listener.getsockname()[1]}", early_data=framed)
        assert stream.status == 200
        sink = Sink()
        stream.set_protocol(sink)
        await asyncio.wait_for(sink.eof, 20)
        assert sink.count == len(early)
        assert sink.hash.hexdigest() == hashlib.sha256(early).hexdigest()
        stream.close()
        conn.close()
    finally:
        echo.close()


async def test_connect_refused_by_tinyproxy_is_an_http_status(proxy: NghttpxFront) -> None:
    client = issue(proxy.ca, spiffe(namespace="default", sa="client"))
    conn = await _open(proxy, client, [Identity.parse(PROXY_ID)])
    try:
        # port 9 is not a ConnectPort: tinyproxy answers 403, nghttpx passes it on
        with pytest.raises(HttpStatusError) as err:
            await conn.connect("127.0.0.1:9")
        assert str(err.value) == f"http status: {err.value.status}"
        assert err.value.status == 403
        assert conn.is_usable()
    finally:
        conn.abort()


async def test_proxy_identity_is_checked(proxy: NghttpxFront) -> None:
    client = issue(proxy.ca, spiffe(namespace="default", sa="client"))
    with pytest.raises(IdentityMismatch):
        await _open(proxy, client, [Identity.parse(spiffe(namespace="istio-system", sa="someone-else"))])


async def test_nghttpx_requires_a_trusted_client_certificate(proxy: NghttpxFront) -> None:
    rogue = make_ca("rogue")
    client = issue(rogue, spiffe(namespace="default", sa="client"), roots=[proxy.ca.root_pem])
    with pytest.raises((TlsHandshakeError, H2HandshakeError)):
        conn = await _open(proxy, client, [Identity.parse(PROXY_ID)])
        await conn.connect(f"127.0.0.1:{proxy.echo_listeners[1].getsockname()[1]}")
