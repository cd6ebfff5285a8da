"""Test harness: `ztunnel proxy` processes on 127.x.y.z, started as a deployment starts them (the
supervisor and its data-plane workers, through the shipped entry point) and observed as a user
observes them (readiness, `/config_dump`, `/metrics`, the log); an echo app; a SOCKS5 client."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families


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


def proxy_env(ns: str, name: str, sa: str, ip: str, local_config: str, **extra: str) -> dict[str, str]:
    env = {
        "PROXY_MODE": "dedicated",
        "PROXY_WORKLOAD_INFO": f"{ns}/{name}/{sa}",
        "XDS_ADDRESS": "",
        "FAKE_CA": "true",
        "LOCAL_XDS": local_config,
        "PROXY_BIND_ADDRESS": ip,
        "UNSTABLE_ENABLE_SOCKS5": "true",
        "SOCKS5_ADDRESS": f"{ip}:15080",
        "ADMIN_ADDRESS": f"{ip}:15000",
        "STATS_ADDRESS": f"{ip}:15020",
        "READINESS_ADDRESS": f"{ip}:15021",
        "CONNECTION_TERMINATION_DEADLINE": "1s",
        "ZTUNNEL_WORKER_THREADS": "2",  # as deployed: the supervisor and two data-plane workers
    }
    env.update(extra)
    return env


def _address(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    return host.strip("[]"), int(port)


class ProxyExited(AssertionError):
    """A proxy process ended when it should have been serving (or never became ready)."""


def http(method: str, url: str, body: bytes | None = None, timeout: float = 10) -> tuple[int, bytes]:
    """One plain HTTP request; (status, body), an error status included."""
    data = body if body is not None else (b"" if method == "POST" else None)
    req = urllib.request.Request(url, method=method, data=data)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


Samples = list[tuple[str, dict[str, str], float]]


@dataclass
class Proxy:
    """One `ztunnel proxy` process, in its own process group (the supervisor and the workers), with its environment, its log file (stdout and stderr) and operator endpoints.
    Blocking methods; the `a`-prefixed ones run them in a thread for async tests."""

    env: dict[str, str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    starts: int = 0
    _log_offset: int = field(default=0, repr=False)

    @property
    def name(self) -> str:
        return self.env.get("PROXY_WORKLOAD_INFO", "proxy").rpartition("/")[2] or "proxy"

    @property
    def ip(self) -> str:
        return self.env.get("PROXY_BIND_ADDRESS", "127.0.0.1")

    def _where(self, var: str, port: int) -> tuple[str, int]:
        return _address(self.env[var]) if self.env.get(var) else (self.ip, port)

    @property
    def socks5(self) -> tuple[str, int]:
        return self._where("SOCKS5_ADDRESS", 15080)

    @property
    def admin(self) -> tuple[str, int]:
        return self._where("ADMIN_ADDRESS", 15000)

    @property
    def stats(self) -> tuple[str, int]:
        return self._where("STATS_ADDRESS", 15020)

    @property
    def readiness(self) -> tuple[str, int]:
        return self._where("READINESS_ADDRESS", 15021)

    # --- life cycle ---------------------------------------------------------------------------

    def spawn(self) -> None:
        """Start the process through the shipped entry point (not waiting for readiness)."""
        assert self.process is None or self.process.poll() is not None, "already running"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "ztunnel", "proxy"],
                env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
            )  # fmt: skip
        self.starts += 1

    def wait_ready(self, timeout: float = 30) -> None:
        """Until `/healthz/ready` answers 200; ProxyExited if the process ends first."""
        deadline = time.monotonic() + timeout
        last: object = "no answer"
        while True:
            assert self.process is not None
            if self.process.poll() is not None:
                raise ProxyExited(f"{self.name} exited {self.process.returncode}:\n{self.log()[-4000:]}")
            try:
                last = self.get("readiness", "/healthz/ready", timeout=2)
                if last == (200, b"ready\n"):
                    return
            except OSError as e:
                last = e
            if time.monotonic() > deadline:
                raise ProxyExited(f"{self.name} not ready after {timeout:g}s ({last}):\n{self.log()[-4000:]}")
            time.sleep(0.05)

    def start(self) -> Proxy:
        self.spawn()
        self.wait_ready()
        return self

    async def astart(self) -> Proxy:
        return await asyncio.to_thread(self.start)

    def wait_exit(self, timeout: float = 20) -> int:
        """The supervisor's exit status."""
        assert self.process is not None
        return self.process.wait(timeout)

    def terminate(self, sig: int = signal.SIGTERM, timeout: float = 20) -> int:
        """Signal the supervisor (SIGTERM: drain) and wait for its exit status."""
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.wait_exit(timeout)

    async def aterminate(self, sig: int = signal.SIGTERM, timeout: float = 20) -> int:
        return await asyncio.to_thread(self.terminate, sig, timeout)

    def quit(self, timeout: float = 20) -> int:
        """POST /quitquitquit, as an operator asks for a drain; the exit status."""
        status, body = self.get("admin", "/quitquitquit", method="POST")
        assert status == 200, (status, body)
        return self.wait_exit(timeout)

    def restart(self) -> None:
        self.terminate()
        self.kill()
        self.start()

    def kill(self) -> None:
        """SIGKILL what is left of the process group; wait until none of it remains."""
        if self.process is None:
            return
        pgid = self.process.pid
        deadline = time.monotonic() + 10
        while self.process.poll() is None or group_members(pgid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            if time.monotonic() > deadline:
                raise AssertionError(f"processes {group_members(pgid)} of {self.name} outlive SIGKILL")
            time.sleep(0.02)

    def stop(self, timeout: float = 10) -> None:
        """SIGTERM (a drain), then SIGKILL to whatever of the group is left."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout)
        self.kill()

    def pids(self) -> list[int]:
        """The live processes of the proxy's group (the supervisor first)."""
        return group_members(self.process.pid) if self.process is not None else []

    # --- what a user sees ---------------------------------------------------------------------

    def get(self, port: str, path: str, *, method: str = "GET", timeout: float = 10) -> tuple[int, bytes]:
        """`port`: admin, stats or readiness."""
        host, number = getattr(self, port)
        return http(method, f"http://{host}:{number}{path}", timeout=timeout)

    def config_dump(self) -> dict[str, Any]:
        status, body = self.get("admin", "/config_dump")
        assert status == 200, (status, body)
        dump: dict[str, Any] = json.loads(body)
        return dump

    def metrics_text(self) -> str:
        status, body = self.get("stats", "/metrics")
        assert status == 200, (status, body)
        return body.decode()

    def samples(self) -> Samples:
        """Every sample of `/metrics`, parsed, as (name as exposed, labels, value)."""
        return [
            (s.name, s.labels, s.value)
            for family in text_string_to_metric_families(self.metrics_text())
            for s in family.samples
        ]

    def metric(self, name: str, *, since: Samples | None = None, **labels: str) -> float:
        """Sum of the samples of `name` (`..._total` for a counter) whose labels include `labels`;
        `since`: minus that sum in an earlier `samples()`."""

        def total(samples: Samples) -> float:
            return sum(
                v for n, have, v in samples if n == name and all(have.get(k) == w for k, w in labels.items())
            )

        return total(self.samples()) - (total(since) if since is not None else 0.0)

    def listeners(self) -> dict[str, tuple[str, int]]:
        """The data-plane listeners (name -> address) of the last worker's "proxy ready" log line."""
        lines = [line for line in self.log().splitlines() if ": proxy ready: " in line]
        assert lines, f"no proxy ready line in {self.name}'s log"
        text = lines[-1].rsplit(": proxy ready: ", 1)[1].rstrip('"')
        out = {}
        for item in filter(None, text.split(", ")):
            name, _, address = item.partition(" ")
            out[name] = _address(address)
        return out

    def log(self) -> str:
        """Everything the proxy wrote (every start of it), as a user reading its output sees it."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def mark(self) -> None:
        """Make `log_since_mark` start from here."""
        self._log_offset = len(self.log())

    def log_since_mark(self) -> str:
        return self.log()[self._log_offset :]


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group `pgid`."""
    found: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(entry))
    return found


def process_env(env: Mapping[str, str]) -> dict[str, str]:
    """This test process's environment without proxy settings, plus `env`; plain logs at info."""
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("ZTUNNEL_", "PROXY_", "XDS_", "CA_", "LOCAL_XDS", "RUST_LOG", "LOG_"))
    }
    return {**base, "LOG_FORMAT": "plain", "RUST_LOG": "info", **env}


class Fleet:
    """The proxies a test (or module) starts; `close`, the fixture's teardown, stops each, kills
    its whole process group and checks that nothing of it is left."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.proxies: list[Proxy] = []

    def add(self, env: Mapping[str, str]) -> Proxy:
        """A proxy of this fleet, not started."""
        proxy = Proxy(process_env(env), self.log_dir / f"proxy-{len(self.proxies)}.log")
        self.proxies.append(proxy)
        return proxy

    def start_all(self, *envs: Mapping[str, str]) -> list[Proxy]:
        """Start several at once (they boot in parallel) and wait until each is ready."""
        proxies = [self.add(env) for env in envs]
        for proxy in proxies:
            proxy.spawn()
        for proxy in proxies:
            proxy.wait_ready()
        return proxies

    async def start(self, *envs: Mapping[str, str]) -> list[Proxy]:
        """`start_all` from an async test (the loop keeps running meanwhile)."""
        return await asyncio.to_thread(self.start_all, *envs)

    def close(self) -> None:
        try:
            for proxy in self.proxies:
                if proxy.process is not None and proxy.process.poll() is None:
                    proxy.process.send_signal(signal.SIGTERM)
            for proxy in self.proxies:
                proxy.stop()
        finally:
            for proxy in self.proxies:
                sys.stdout.write(f"--- {proxy.name} ({proxy.ip}) log, tail ---\n{proxy.log()[-6000:]}\n")


@dataclass
class ControlPlane:
    """`ztunnel control-plane` as a process: xDS and a CA from a YAML file it watches (a live change
    is a new file); `env` points a proxy at it (FAKE_CA off)."""

    config: Path
    address: str
    process: subprocess.Popen[bytes]
    log_path: Path

    @classmethod
    def start(cls, directory: Path, host: str, text: str) -> ControlPlane:
        directory.mkdir(parents=True, exist_ok=True)
        config, log_path = directory / "mesh.yaml", directory / "control-plane.log"
        config.write_text(text)
        with socket.socket() as s:
            s.bind((host, 0))
            address = f"{host}:{s.getsockname()[1]}"
        with open(log_path, "ab") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "ztunnel", "control-plane", "--config", str(config),
                 "--listen", address, "--ca-dir", str(directory / "ca")],
                env=process_env({}), stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
            )  # fmt: skip
        cp = cls(config, address, process, log_path)
        deadline = time.monotonic() + 30
        while "root certificate:" not in cp.log():
            if process.poll() is not None or time.monotonic() > deadline:
                cp.stop()
                raise AssertionError(f"the control plane did not start:\n{cp.log()}")
            time.sleep(0.05)
        return cp

    def wire(self, env: Mapping[str, str]) -> dict[str, str]:
        """A proxy's `env` fed by this control plane instead of a local config and the fake CA."""
        wired = {k: v for k, v in env.items() if k not in ("LOCAL_XDS", "LOCAL_XDS_PATH", "FAKE_CA")}
        wired.update(XDS_ADDRESS=f"http://{self.address}", CA_ADDRESS=f"http://{self.address}")
        return wired

    def push(self, text: str) -> None:
        """A new config, written whole (the control plane reads the file when it changes)."""
        tmp = self.config.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(self.config)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(10)
        while self.process.poll() is None or group_members(self.process.pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            time.sleep(0.02)


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
