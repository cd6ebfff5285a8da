"""The processes under test and how the load generator reaches the sink through each mode.

Everything runs on one random /24 of the loopback range (so concurrent runs and tests do not
collide), each party on its own address:

| address | what |
|---|---|
| .3 | the server workload: the sink (echo and discard ports) and, in `hbone`, its ztunnel |
| .2 | `hbone`: the client workload's ztunnel (SOCKS5 on :15080), pooling as configured by default |
| .4 | `hbone`: a second client ztunnel with `POOL_MAX_STREAMS_PER_CONNECTION=1`, so every connection needs its own TLS handshake (the handshake figure) |
| .5 | `tcp`: a ztunnel whose local config knows only itself: the sink's address is unknown to it, so SOCKS5 to it is plain TCP passthrough |
| .6/.7 | `stunnel`: stunnel4 client (plain TCP in) and server (mTLS in, plain TCP to the sink) |

The ztunnels are real `ztunnel proxy` processes with `FAKE_CA=true` and a `LOCAL_XDS_PATH` file,
started, waited for and stopped by process group through `ztunnel.harness` as `ztunnel demo`'s and
the tests' are. stunnel gets certificates of the same kind, issued by
the same fake CA (ECDSA P-256 leaves with a SPIFFE URI SAN), TLS 1.3 only, mutual and verified, and
resuming TLS sessions (session tickets) as a tuned stunnel does; `stunnel_handshakes` counts, from
the stunnel server's log, how many of its connections were resumed.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ztunnel.harness import Process, ProcessExited, ProxyProcess, http

ECHO_PORT = 9001
DISCARD_PORT = 9002
STUNNEL = shutil.which("stunnel4") or shutil.which("stunnel")

SERVER, CLIENT, FRESH_CLIENT, TCP_PROXY, STUNNEL_CLIENT, STUNNEL_SERVER = 3, 2, 4, 5, 6, 7

MESH_CONFIG = """\
workloads:
  - uid: bench//v1/Pod/bench/server
    name: server
    namespace: bench
    serviceAccount: server
    trustDomain: cluster.local
    workloadIps: ["{server}"]
    protocol: HBONE
    canonicalName: sink
    workloadName: server
  - uid: bench//v1/Pod/bench/client
    name: client
    namespace: bench
    serviceAccount: client
    trustDomain: cluster.local
    workloadIps: ["{client}"]
    protocol: HBONE
    workloadName: client
  - uid: bench//v1/Pod/bench/fresh
    name: fresh
    namespace: bench
    serviceAccount: fresh
    trustDomain: cluster.local
    workloadIps: ["{fresh}"]
    protocol: HBONE
    workloadName: fresh
policies:
  - name: bench-clients
    namespace: bench
    scope: Namespace
    action: Allow
    dryRun: false
    rules:
      - - - principals: [!Exact "cluster.local/ns/bench/sa/client", !Exact "cluster.local/ns/bench/sa/fresh"]
"""

TCP_CONFIG = """\
workloads:
  - uid: bench//v1/Pod/bench/tcp
    name: tcp
    namespace: bench
    serviceAccount: tcp
    trustDomain: cluster.local
    workloadIps: ["{ip}"]
    protocol: TCP
    workloadName: tcp
"""


class SetupError(Exception):
    """A process under test did not come up; the message names it and its log."""


def pick_net() -> str:
    return f"127.{random.randint(16, 250)}.{random.randint(0, 250)}"


def restart(proc: Process, env: dict[str, str]) -> None:
    """`proc` stopped, then started again with `env` (another worker count)."""
    proc.stop()
    proc.env = env
    proc.spawn()


def not_up(proc: Process, what: str) -> SetupError:
    if proc.running():
        return SetupError(f"{proc.name} {what}: see {proc.log_path}")
    return SetupError(f"{proc.name} exited with {proc.returncode}: see {proc.log_path}")


@dataclass
class Mode:
    """A way from the load generator to the sink, and the processes that carry it."""

    name: str
    entry: dict[str, Any]
    processes: list[Process] = field(default_factory=list)
    # Where new connections need a fresh TLS handshake each; None: `entry` already does (or the
    # mode has no TLS), so the handshake figure is the connection figure.
    fresh_entry: dict[str, Any] | None = None
    note: str = ""
    # The mode's own load generators (capture topology: one inside each client namespace); None:
    # the harness's shared one.
    gen: LoadGenerator | None = None
    fresh_gen: LoadGenerator | None = None
    # The most idle connections the memory figure holds through it (None: `--hold`).
    max_hold: int | None = None


# stunnel runs a thread per connection in each of its two processes: 10,000 held would take
# 20,000 threads (and the machine's pid space, 32,768 by default); its figure per connection is
# the same at fewer.
STUNNEL_MAX_HOLD = 2000


def _can_connect(addr: tuple[str, int]) -> bool:
    try:
        with socket.create_connection(addr, timeout=0.5):
            return True
    except OSError:
        return False


def ztunnel_env(name: str, config: Path, workers: int | None) -> dict[str, str]:
    """The environment of a bench ztunnel: dedicated mode, the fake CA, the local config file, and
    nothing inherited that would change its behaviour (control plane, pool, worker settings), except
    `ZTUNNEL_BUILD` (`pure` benches the Python build of a compiled install)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k == "ZTUNNEL_BUILD"
        or not k.startswith(("XDS_", "CA_", "PROXY_", "LOCAL_XDS", "POOL_", "HTTP2_", "ZTUNNEL_"))
    }
    env.update(
        PROXY_MODE="dedicated",
        PROXY_WORKLOAD_INFO=f"bench/{name}/{name}",
        XDS_ADDRESS="",
        FAKE_CA="true",
        LOCAL_XDS_PATH=str(config),
        LOG_LEVEL=os.environ.get("BENCH_LOG_LEVEL", "info"),
        CONNECTION_TERMINATION_DEADLINE="2s",
    )
    return with_workers(env, workers)


def with_workers(env: dict[str, str] | None, workers: int | None) -> dict[str, str]:
    """`env` with `ZTUNNEL_WORKER_THREADS=workers`, or without it when None (one process)."""
    out = {k: v for k, v in (env or {}).items() if k != "ZTUNNEL_WORKER_THREADS"}
    if workers:
        out["ZTUNNEL_WORKER_THREADS"] = str(workers)
    return out


def stunnel_certs(workdir: Path) -> Path:
    """Client and server certificates for stunnel from a fresh fake CA, in `workdir/stunnel-certs`."""
    from hbone.identity import Identity
    from ztunnel.identity.certificates import FakeCA

    ca = FakeCA()
    certs = workdir / "stunnel-certs"
    certs.mkdir(exist_ok=True)
    os.chmod(certs, 0o700)
    (certs / "root.pem").write_bytes(ca.root_pem)
    for side in ("client", "server"):
        cert = ca.issue(Identity("cluster.local", "bench", f"stunnel-{side}"))
        (certs / f"{side}.pem").write_bytes(b"".join(cert.chain_pem))
        key = certs / f"{side}.key"
        key.write_bytes(cert.key_pem)
        os.chmod(key, 0o600)
    return certs


STUNNEL_NOTE = (
    "TLS 1.3 sessions resumed (sessionResume = yes; `stunnel_handshakes` in the JSON counts them); "
    f"the memory figure holds at most {STUNNEL_MAX_HOLD:,} connections (a thread each)"
)


def stunnel_conf(workdir: Path, side: str, forwards: list[tuple[str, str]]) -> Path:
    """stunnel's config for one `side` ("client": plain in, TLS out; "server": TLS in, plain out),
    one section per (accept, connect) pair; certificates from `stunnel_certs`.

    It logs to stderr (the process's log file) at its default level, and not to syslog: in the
    foreground stunnel logs to syslog too, and where no syslog daemon listens (a container, this
    harness's machines) glibc's syslog falls back to writing every line to /dev/console, a serial
    port on a VM, which cost ~15 ms of CPU per connection. Sessions are resumed: the server issues
    TLS 1.3 session tickets and the client offers the last one it got for the section (stunnel's
    default, spelled out), as a stunnel tuned for many short connections runs."""
    certs = workdir / "stunnel-certs"
    extra = "client = yes\n" if side == "client" else "requireCert = yes\n"
    conf = ["foreground = yes\nsyslog = no\npid =\n"]
    for i, (accept, connect) in enumerate(forwards):
        conf.append(
            f"[{side}-{i}]\naccept = {accept}\nconnect = {connect}\n"
            f"cert = {certs / f'{side}.pem'}\nkey = {certs / f'{side}.key'}\nCAfile = {certs / 'root.pem'}\n"
            f"verifyChain = yes\nsslVersionMin = TLSv1.3\nsessionResume = yes\n{extra}"
        )
    path = workdir / f"stunnel-{side}.conf"
    path.write_text("".join(conf))
    return path


def stunnel_handshakes(server_log: Path) -> dict[str, int]:
    """The stunnel server's TLS connections, from its log at the default level: every connection
    whose handshake completed is forwarded ("connected remote server"); a full handshake verifies
    the client's certificate ("Certificate accepted at depth=0"), a resumed one does not (at level
    info stunnel says "previous session reused" for exactly those)."""
    try:
        text = server_log.read_text(errors="replace")
    except OSError:
        return {"connections": 0, "full": 0, "resumed": 0}
    done = text.count("connected remote server from")
    full = text.count("Certificate accepted at depth=0")
    return {"connections": done, "full": full, "resumed": max(done - full, 0)}


class Topology:
    """Starts and stops everything; `modes` lists what is up."""

    name = "loopback"

    def __init__(self, workdir: Path, *, workers: int | None = None, with_stunnel: bool = True) -> None:
        self.workdir = workdir
        self.net = pick_net()
        self.where = f"SOCKS5 on {self.net}.0/24"
        self.workers = workers
        self.with_stunnel = with_stunnel
        self.ztunnels: dict[str, ProxyProcess] = {}
        self.stunnels: list[Process] = []
        self.sink: subprocess.Popen[bytes] | None = None
        self.modes: list[Mode] = []
        self.notes: list[str] = []
        self._logs: list[IO[bytes]] = []

    def ip(self, i: int) -> str:
        return f"{self.net}.{i}"

    # -- start ---------------------------------------------------------------------------------

    def start(self) -> list[Mode]:
        self.workdir.mkdir(parents=True, exist_ok=True)
        server = self.ip(SERVER)
        echo, discard = [server, ECHO_PORT], [server, DISCARD_PORT]
        self._start_sink(server)
        mesh = self.workdir / "mesh.yaml"
        mesh.write_text(
            MESH_CONFIG.format(server=server, client=self.ip(CLIENT), fresh=self.ip(FRESH_CLIENT))
        )
        tcp_cfg = self.workdir / "tcp.yaml"
        tcp_cfg.write_text(TCP_CONFIG.format(ip=self.ip(TCP_PROXY)))
        for name, i, cfg, extra in (
            ("server", SERVER, mesh, {}),
            ("client", CLIENT, mesh, {}),
            ("fresh", FRESH_CLIENT, mesh, {"POOL_MAX_STREAMS_PER_CONNECTION": "1"}),
            ("tcp", TCP_PROXY, tcp_cfg, {}),
        ):
            self.ztunnels[name] = self._start_ztunnel(name, self.ip(i), cfg, extra)
        if self.with_stunnel and STUNNEL:
            self._start_stunnel()
        elif self.with_stunnel:
            self.notes.append("stunnel: skipped, stunnel4 is not installed (apt-get install stunnel4)")
        for ztunnel in self.ztunnels.values():
            self._wait_ztunnel(ztunnel)
        for tunnel, addr in zip(
            self.stunnels,
            ((self.ip(STUNNEL_SERVER), ECHO_PORT), (self.ip(STUNNEL_CLIENT), ECHO_PORT)),
            strict=False,
        ):
            self._wait_port(tunnel, addr)

        self.modes = [
            Mode("direct", {"kind": "direct", "echo": echo, "discard": discard}),
            Mode(
                "tcp",
                {"kind": "socks5", "proxy": [self.ip(TCP_PROXY), 15080], "echo": echo, "discard": discard},
                [self.ztunnels["tcp"]],
            ),
            Mode(
                "hbone",
                {"kind": "socks5", "proxy": [self.ip(CLIENT), 15080], "echo": echo, "discard": discard},
                [self.ztunnels["client"], self.ztunnels["server"]],
                fresh_entry={
                    "kind": "socks5",
                    "proxy": [self.ip(FRESH_CLIENT), 15080],
                    "echo": echo,
                    "discard": discard,
                },
            ),
        ]
        if self.stunnels:
            c = self.ip(STUNNEL_CLIENT)
            self.modes.append(
                Mode(
                    "stunnel",
                    # No half-close in the integrity check: stunnel may drop the echo's tail
                    # after the client's EOF (see capture.py).
                    {
                        "kind": "direct",
                        "echo": [c, ECHO_PORT],
                        "discard": [c, DISCARD_PORT],
                        "half_close": False,
                    },
                    list(self.stunnels),
                    note=STUNNEL_NOTE,
                    max_hold=STUNNEL_MAX_HOLD,
                )
            )
        return self.modes

    def _log(self, name: str) -> tuple[Path, IO[bytes]]:
        path = self.workdir / f"{name}.log"
        f = path.open("wb")
        self._logs.append(f)
        return path, f

    def _start_sink(self, host: str) -> None:
        path, log = self._log("sink")
        self.sink = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "benches.sink",
                "--host",
                host,
                "--echo-port",
                str(ECHO_PORT),
                "--discard-port",
                str(DISCARD_PORT),
            ],
            stdout=subprocess.PIPE,
            stderr=log,
        )
        assert self.sink.stdout is not None
        line = self.sink.stdout.readline()
        if line.strip() != b"ready":
            raise SetupError(f"sink did not start: see {path}")

    def _start_ztunnel(self, name: str, ip: str, config: Path, extra: dict[str, str]) -> ProxyProcess:
        env = ztunnel_env(name, config, self.workers)
        env.update(
            PROXY_BIND_ADDRESS=ip,
            UNSTABLE_ENABLE_SOCKS5="true",
            SOCKS5_ADDRESS=f"{ip}:15080",
            ADMIN_ADDRESS=f"{ip}:15000",
            STATS_ADDRESS=f"{ip}:15020",
            READINESS_ADDRESS=f"{ip}:15021",
        )
        env.update(extra)
        proc = ProxyProcess(env, self.workdir / f"ztunnel-{name}.log", name=f"ztunnel-{name}")
        proc.spawn()
        return proc

    def set_workers(self, mode: Mode, workers: int | None) -> None:
        """Restarts the mode's ztunnels with `ZTUNNEL_WORKER_THREADS=workers` (None: unset)."""
        for proc in mode.processes:
            restart(proc, with_workers(proc.env, workers))
        for proc in mode.processes:
            self._wait_ztunnel(proc)

    def _wait_ztunnel(self, proc: Process, timeout: float = 30.0) -> None:
        try:
            proc.wait_ready(timeout)
        except ProcessExited:
            raise not_up(proc, f"not ready after {timeout}s") from None

    def _wait_port(self, proc: Process, addr: tuple[str, int], timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not proc.running():
                raise not_up(proc, "exited")
            if _can_connect(addr):
                return
            time.sleep(0.05)
        raise not_up(proc, f"not listening on {addr} after {timeout}s")

    def _start_stunnel(self) -> None:
        stunnel_certs(self.workdir)
        server, client, sink = self.ip(STUNNEL_SERVER), self.ip(STUNNEL_CLIENT), self.ip(SERVER)
        for side, accept_ip, connect_ip in (("server", server, sink), ("client", client, server)):
            forwards = [(f"{accept_ip}:{p}", f"{connect_ip}:{p}") for p in (ECHO_PORT, DISCARD_PORT)]
            path = stunnel_conf(self.workdir, side, forwards)
            log_path = self.workdir / f"stunnel-{side}-stderr.log"
            proc = Process(
                [str(path)], dict(os.environ), log_path, name=f"stunnel-{side}", command=[str(STUNNEL)]
            )
            proc.spawn()
            self.stunnels.append(proc)

    # -- stop ----------------------------------------------------------------------------------

    def stop(self) -> None:
        for ztunnel in self.ztunnels.values():
            if ztunnel.running():
                try:
                    http("POST", f"http://{ztunnel.ip}:15000/quitquitquit", timeout=2.0)
                except OSError:
                    ztunnel.send(signal.SIGTERM)
        for proc in self.stunnels:
            proc.send(signal.SIGTERM)
        if self.sink is not None and self.sink.poll() is None:
            self.sink.terminate()
        for proc in (*self.ztunnels.values(), *self.stunnels):
            proc.stop()
        if self.sink is not None:
            try:
                self.sink.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.sink.kill()
                self.sink.wait(timeout=5)
        for f in self._logs:
            f.close()


class LoadGenerator:
    """The load generator process, one JSON command and answer at a time; `prefix` runs it
    elsewhere (`ip netns exec <ns>`)."""

    def __init__(self, log_path: Path, prefix: list[str] | None = None) -> None:
        self._log = log_path.open("wb")
        self.popen = subprocess.Popen(
            [*(prefix or []), sys.executable, "-m", "benches.loadgen"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
        )
        first = self._read()
        if not first.get("ready"):
            raise SetupError(f"load generator did not start: see {log_path}")

    def _read(self) -> dict[str, Any]:
        assert self.popen.stdout is not None
        line = self.popen.stdout.readline()
        if not line:
            raise SetupError(f"load generator exited with {self.popen.poll()}")
        result: dict[str, Any] = json.loads(line)
        return result

    def call(self, cmd: str, **args: Any) -> dict[str, Any]:
        assert self.popen.stdin is not None
        self.popen.stdin.write(json.dumps({"cmd": cmd, **args}).encode() + b"\n")
        self.popen.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(OSError, SetupError, ValueError):
                self.call("quit")
            try:
                self.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self._log.close()
