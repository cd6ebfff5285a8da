"""What the tests' proxies carry traffic for and between, none of it a ztunnel process (those are
`tests/harness.py`'s): loopback addresses, mesh YAML (`workload_yaml`, `ONLY_FRONTEND`), echo apps
(`start_echo` on this test's event loop, `echo_server` in a thread), SOCKS5 clients (`socks5_connect`,
`echo_roundtrip` async; `socks5`, `socks5_reply`, `exchange` blocking), `openssl s_client`, `http`, `free_port`."""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import random
import socket
import socketserver
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ztunnel.harness import http as http  # one plain HTTP request, as the harness makes them


def loopback_net() -> str:
    """A random /24 of the loopback range per run, so that concurrent runs do not collide."""
    return f"127.{random.randint(16, 250)}.{random.randint(0, 250)}"


def workload_yaml(
    name: str,
    ip: str,
    *,
    ns: str = "demo",
    protocol: str = "HBONE",
    uid: str = "t//v1/Pod",
    extra: str = "",
) -> str:
    """One entry of a local config's `workloads:` (its service account named after it); `extra`:
    further keys, each line indented by four spaces."""
    return f"""
  - uid: {uid}/{ns}/{name}
    name: {name}
    namespace: {ns}
    serviceAccount: {name}
    trustDomain: cluster.local
    workloadIps: ["{ip}"]
    protocol: {protocol}{extra}"""


# A namespace-wide ALLOW of the frontend's identity only.
ONLY_FRONTEND = """
policies:
  - name: only-frontend
    namespace: demo
    scope: Namespace
    action: Allow
    dryRun: false
    rules:
      - - - principals: [!Exact "cluster.local/ns/demo/sa/frontend"]
"""


@dataclass
class Echo:
    server: asyncio.AbstractServer
    host: str
    port: int


async def start_echo(host: str, port: int) -> Echo:
    """An app that echoes everything and half-closes when its client does."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(1 << 20):
                writer.write(data)
                await writer.drain()
            writer.write_eof()
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    return Echo(await asyncio.start_server(handle, host, port), host, port)


async def socks5_connect(
    proxy: tuple[str, int], host: str, port: int
) -> tuple[int, asyncio.StreamReader, asyncio.StreamWriter]:
    """SOCKS5 CONNECT; returns (reply code, reader, writer). Reply 0 means connected."""
    reader, writer = await asyncio.open_connection(*proxy)
    writer.write(b"\x05\x01\x00")
    assert await reader.readexactly(2) == b"\x05\x00"
    try:
        ip = ipaddress.ip_address(host)
        atyp = b"\x01" if ip.version == 4 else b"\x04"
        addr = ip.packed
    except ValueError:
        atyp, addr = b"\x03", bytes([len(host)]) + host.encode()
    writer.write(b"\x05\x01\x00" + atyp + addr + port.to_bytes(2, "big"))
    head = await reader.readexactly(4)
    await reader.readexactly((4 if head[3] == 1 else 16) + 2)
    return head[1], reader, writer


@dataclass
class Exchange:
    code: int  # SOCKS5 reply code (0 = connected)
    received: int  # bytes echoed back
    digest: bytes  # sha256 of what came back


async def echo_roundtrip(proxy: tuple[str, int], host: str, port: int, payload: bytes) -> Exchange:
    """Send `payload` through the proxy to an echo app, half-close, read the echo to its end."""
    code, reader, writer = await socks5_connect(proxy, host, port)
    try:
        if code != 0:
            return Exchange(code, 0, b"")

        async def send() -> None:
            view = memoryview(payload)
            for i in range(0, len(view), 1 << 20):
                writer.write(view[i : i + (1 << 20)])
                await writer.drain()
            writer.write_eof()

        sender = asyncio.create_task(send())
        h = hashlib.sha256()
        n = 0
        try:
            while chunk := await reader.read(1 << 20):
                h.update(chunk)
                n += len(chunk)
        except ConnectionError:
            pass
        await sender
        return Exchange(code, n, h.digest())
    finally:
        writer.close()


def sha(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


async def _s_client_report(target: str, cert: str, key: str, ca: str) -> tuple[list[str], str]:
    proc = await asyncio.create_subprocess_exec(
        "openssl", "s_client", "-connect", target, "-alpn", "h2", "-showcerts",
        "-cert", cert, "-key", key, "-CAfile", ca, "-verify_return_error",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    # Keep stdin open until the handshake summary is out: s_client quits at EOF on stdin.
    assert proc.stdout is not None and proc.stdin is not None and proc.stderr is not None
    lines: list[str] = []
    async with asyncio.timeout(30):
        while not any(line.startswith("Verify return code") for line in lines):
            line = (await proc.stdout.readline()).decode()
            if not line:
                break
            lines.append(line)
    proc.stdin.close()
    errors = (await proc.stderr.read()).decode(errors="replace")
    await proc.wait()
    return lines, errors


@dataclass
class TlsView:
    """What `openssl s_client` reports of an HBONE listener's TLS."""

    text: str
    leaf_sans: list[str]


async def openssl_s_client(target: str, cert: str, key: str, ca: str) -> TlsView:
    """Connect with `openssl s_client` (a TLS client we did not write) and read its report."""
    from cryptography import x509

    for attempt in range(3):
        lines, errors = await _s_client_report(target, cert, key, ca)
        # A run that printed nothing at all never reached the server (seen, rarely, when this test
        # process forks while gRPC's threads run): that is no answer about TLS, so ask again.
        if lines or attempt == 2:
            break
    if not lines:
        lines = [f"openssl s_client printed nothing; its stderr: {errors!r}"]
    text = "".join(lines)
    sans: list[str] = []
    if "-----BEGIN CERTIFICATE-----" in text:
        start = text.index("-----BEGIN CERTIFICATE-----")
        end = text.index("-----END CERTIFICATE-----") + len("-----END CERTIFICATE-----")
        leaf = x509.load_pem_x509_certificate(text[start:end].encode())
        ext = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        sans = [str(name.value) for name in ext]
    return TlsView(text, sans)


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        try:
            while data := self.request.recv(65536):
                self.request.sendall(data)
        except OSError:
            pass


class _EchoServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


@contextmanager
def echo_server(ip: str, port: int) -> Iterator[None]:
    server = _EchoServer((ip, port), _Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()


def socks5_reply(proxy_ip: str, dst_ip: str, dst_port: int, timeout: float = 10) -> tuple[socket.socket, int]:
    """A connection through the proxy's SOCKS5 listener to `dst_ip:dst_port`, and the CONNECT reply
    code (0: connected; 2: not allowed by the rules, e.g. a policy denied it)."""
    s = socket.create_connection((proxy_ip, 15080), timeout=timeout)
    s.sendall(b"\x05\x01\x00" + b"\x05\x01\x00\x01" + socket.inet_aton(dst_ip) + dst_port.to_bytes(2, "big"))
    reply = b""
    while len(reply) < 12:
        chunk = s.recv(12 - len(reply))
        if not chunk:
            raise ConnectionError(f"closed during the SOCKS5 handshake: {reply!r}")
        reply += chunk
    assert reply[:3] == b"\x05\x00\x05", reply  # no authentication, then the CONNECT reply
    return s, reply[3]


def socks5(proxy_ip: str, dst_ip: str, dst_port: int, timeout: float = 10) -> socket.socket:
    s, code = socks5_reply(proxy_ip, dst_ip, dst_port, timeout)
    assert code == 0, code
    return s


def exchange(s: socket.socket, payload: bytes) -> bytes:
    """Send `payload`, half-close, read to the end."""
    s.sendall(payload)
    s.shutdown(socket.SHUT_WR)
    got = b""
    while chunk := s.recv(65536):
        got += chunk
    return got


def free_port(host: str) -> int:
    """A TCP port nothing listens on at `host` now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
