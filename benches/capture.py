"""The capture topology (`python -m benches --topology capture`, root only): the production path.

Each mode gets its own pair of network namespaces joined by a veth pair, a client and a server, so
that capture in one never touches another. Applications are the C tools and iperf3
(`benches/tools.c`, built by `benches/ctools.py`) and dial the server's address as they would
without a mesh; in captured namespaces the node agent's own rules (`cni/redirect.py`, installed
exactly as the agent installs them in a pod) redirect them into a ztunnel:

| mode | client namespace | server namespace |
|---|---|---|
| `direct` | 10.10.1.1, no rules | 10.10.1.2: echo, iperf3 |
| `tcp` | 10.10.2.1, captured: a ztunnel whose config knows only itself (plain TCP passthrough) | 10.10.2.2: echo, iperf3 (no mesh) |
| `hbone` | 10.10.3.1, captured: the client workload's ztunnel | 10.10.3.2, captured: the server workload's ztunnel, echo, iperf3 |
| (`hbone` handshakes) | 10.10.4.1, captured: a ztunnel with `POOL_MAX_STREAMS_PER_CONNECTION=1`, its veth to the hbone server namespace (10.10.4.2) | the same as `hbone` |
| `stunnel` | 10.10.5.1: stunnel4 client | 10.10.5.2: stunnel4 server, echo, iperf3 |

The ztunnels are dedicated-mode `python -m ztunnel proxy` processes started inside the namespace,
with the wildcard listeners (15001, 15006, 15008) and `PACKET_MARK=1337`, the mark the rules exempt,
as a proxy in a pod has. Addresses repeat from one run to the next: they exist only inside the
run's namespaces, whose names have a random suffix. One load generator runs in each client
namespace.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benches import ctools
from benches.netns import Netns, NetnsError, link
from benches.topology import (
    ECHO_PORT,
    MESH_CONFIG,
    STUNNEL,
    STUNNEL_MAX_HOLD,
    STUNNEL_NOTE,
    TCP_CONFIG,
    LoadGenerator,
    Mode,
    SetupError,
    not_up,
    restart,
    stunnel_certs,
    stunnel_conf,
    with_workers,
    ztunnel_env,
)
from ztunnel.harness import Process, ProxyProcess, http

IPERF_PORT = 5201
STUNNEL_PORTS = {ECHO_PORT: 19001, IPERF_PORT: 15201}  # the stunnel server's TLS ports
NET = "10.10"


def _ip(pair: int, host: int) -> str:
    return f"{NET}.{pair}.{host}"


class CaptureTopology:
    """Starts and stops the namespaces and everything in them; `modes` lists what is up."""

    name = "capture"

    def __init__(self, workdir: Path, *, workers: int | None = None, with_stunnel: bool = True) -> None:
        self.workdir = workdir
        self.workers = workers
        self.with_stunnel = with_stunnel
        self.where = "network namespaces joined by veth pairs, iptables capture"
        self.namespaces: list[Netns] = []
        self.ztunnels: dict[str, tuple[Process, Netns]] = {}
        self.others: list[Process] = []  # servers and stunnels
        # What each of those listens on, reached from inside its namespace, before the run starts.
        self._listening: list[tuple[Process, Netns, tuple[str, int]]] = []
        self.gens: list[LoadGenerator] = []
        self.modes: list[Mode] = []
        self.notes: list[str] = []

    # -- start ---------------------------------------------------------------------------------

    def _ns(self, prefix: str) -> Netns:
        ns = Netns(prefix)
        self.namespaces.append(ns)
        return ns

    def _pair(self, mode: str, pair: int) -> tuple[Netns, Netns]:
        client, server = self._ns(f"zb-{mode}-c"), self._ns(f"zb-{mode}-s")
        link(client, _ip(pair, 1), server, _ip(pair, 2))
        return client, server

    def _spawn(self, name: str, ns: Netns, argv: list[str]) -> Process:
        log_path = self.workdir / f"{name}.log"
        proc = Process(argv[1:], dict(os.environ), log_path, netns=ns.name, name=name, command=argv[:1])
        proc.spawn()
        return proc

    def _servers(self, mode: str, ns: Netns, tools: Path) -> None:
        """The apps of a server namespace: the C echo and an iperf3 server, on every address."""
        echo = self._spawn(f"echo-{mode}", ns, [str(tools), "echo", "0.0.0.0", str(ECHO_PORT)])
        self._listening.append((echo, ns, ("127.0.0.1", ECHO_PORT)))
        # iperf3 is not probed with a connect (a control connection without a test upsets it):
        # its log says when it listens.
        self.others += [
            echo,
            self._spawn(f"iperf3-{mode}", ns, ["iperf3", "-s", "--forceflush", "-p", str(IPERF_PORT)]),
        ]

    def _ztunnel(self, name: str, ns: Netns, config: Path, extra: dict[str, str]) -> Process:
        env = ztunnel_env(name, config, self.workers)
        env.update(PACKET_MARK="1337", ADMIN_ADDRESS="127.0.0.1:15000", **extra)
        proc = ProxyProcess(env, self.workdir / f"ztunnel-{name}.log", netns=ns.name, name=f"ztunnel-{name}")
        proc.spawn()
        self.ztunnels[name] = (proc, ns)
        return proc

    def _gen(self, mode: str, ns: Netns) -> LoadGenerator:
        gen = LoadGenerator(self.workdir / f"loadgen-{mode}.log", prefix=ns.argv([]))
        self.gens.append(gen)
        return gen

    def start(self) -> list[Mode]:
        from cni import redirect

        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            tools = ctools.build()
        except ctools.BuildError as e:
            raise SetupError(str(e)) from None
        try:
            return self._start(tools, redirect.install)
        except (NetnsError, redirect.RedirectError) as e:
            raise SetupError(f"capture topology: {e}") from None

    def _start(self, tools: Path, capture: Callable[[str], None]) -> list[Mode]:
        d_cli, d_srv = self._pair("direct", 1)
        t_cli, t_srv = self._pair("tcp", 2)
        h_cli, h_srv = self._pair("hbone", 3)
        f_cli = self._ns("zb-fresh-c")
        link(f_cli, _ip(4, 1), h_srv, _ip(4, 2))
        f_cli.exec("ip", "route", "add", "default", "via", _ip(4, 2))
        for ns in (t_cli, h_cli, h_srv, f_cli):
            capture(ns.path)

        mesh = self.workdir / "mesh.yaml"
        mesh.write_text(MESH_CONFIG.format(server=_ip(3, 2), client=_ip(3, 1), fresh=_ip(4, 1)))
        tcp_cfg = self.workdir / "tcp.yaml"
        tcp_cfg.write_text(TCP_CONFIG.format(ip=_ip(2, 1)))
        for mode, ns in (("direct", d_srv), ("tcp", t_srv), ("hbone", h_srv)):
            self._servers(mode, ns, tools)
        server = self._ztunnel("server", h_srv, mesh, {})
        client = self._ztunnel("client", h_cli, mesh, {})
        self._ztunnel("fresh", f_cli, mesh, {"POOL_MAX_STREAMS_PER_CONNECTION": "1"})
        tcp = self._ztunnel("tcp", t_cli, tcp_cfg, {})
        stunnels: list[Process] = []
        if self.with_stunnel and STUNNEL:
            stunnels = self._start_stunnel(tools)
        elif self.with_stunnel:
            self.notes.append("stunnel: skipped, stunnel4 is not installed (apt-get install stunnel4)")
        for proc, ns in self.ztunnels.values():
            self._wait_ready(proc, ns)
        for proc, ns, addr in self._listening:
            self._wait_port(proc, ns, addr)
        for proc in self.others:
            if proc.name.startswith("iperf3"):
                self._wait_log(proc, b"Server listening")

        def entry(pair: int, host: int = 2) -> dict[str, Any]:
            ip = _ip(pair, host)
            return {
                "kind": "direct",
                "echo": [ip, ECHO_PORT],
                "discard": [ip, IPERF_PORT],
                "iperf3": [ip, IPERF_PORT],
                "tools": str(tools),
            }

        self.modes = [
            Mode("direct", entry(1), gen=self._gen("direct", d_cli)),
            Mode("tcp", entry(2), [tcp], gen=self._gen("tcp", t_cli)),
            Mode(
                "hbone",
                entry(3),
                [client, server],
                fresh_entry=entry(3),
                gen=self._gen("hbone", h_cli),
                fresh_gen=self._gen("fresh", f_cli),
            ),
        ]
        if stunnels:
            s_cli = next(n for n in self.namespaces if n.name.startswith("zb-stunnel-c"))
            self.modes.append(
                Mode(
                    "stunnel",
                    # The stunnel client's end, in the client namespace. No half-close in the
                    # integrity check: stunnel answers the client's EOF (a TLS close_notify) by
                    # closing both ways and drops what the echo was still sending back (seen as
                    # 87,040 of 1 MiB missing, its log saying "closed").
                    {**entry(5, 1), "half_close": False},
                    stunnels,
                    gen=self._gen("stunnel", s_cli),
                    note=STUNNEL_NOTE,
                    max_hold=STUNNEL_MAX_HOLD,
                )
            )
        return self.modes

    def _start_stunnel(self, tools: Path) -> list[Process]:
        s_cli, s_srv = self._pair("stunnel", 5)
        self._servers("stunnel", s_srv, tools)
        stunnel_certs(self.workdir)
        client, server = _ip(5, 1), _ip(5, 2)
        out = []
        for side, ns, forwards, probe in (
            (
                "server",
                s_srv,
                [(f"{server}:{tls}", f"127.0.0.1:{app}") for app, tls in STUNNEL_PORTS.items()],
                (server, STUNNEL_PORTS[ECHO_PORT]),
            ),
            (
                "client",
                s_cli,
                [(f"{client}:{app}", f"{server}:{tls}") for app, tls in STUNNEL_PORTS.items()],
                (client, ECHO_PORT),
            ),
        ):
            conf = stunnel_conf(self.workdir, side, forwards)
            proc = self._spawn(f"stunnel-{side}", ns, [str(STUNNEL), str(conf)])
            self.others.append(proc)
            self._listening.append((proc, ns, probe))
            out.append(proc)
        return out

    def _wait_ready(self, proc: Process, ns: Netns, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not proc.running():
                raise not_up(proc, "exited")
            with contextlib.suppress(OSError), ns.inside():
                if http("GET", "http://127.0.0.1:15021/healthz/ready", timeout=0.5)[0] == 200:
                    return
            time.sleep(0.05)
        raise not_up(proc, f"not ready after {timeout}s")

    def _wait_port(self, proc: Process, ns: Netns, addr: tuple[str, int], timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not proc.running():
                raise not_up(proc, "exited")
            with ns.inside():
                sock = socket.socket()  # created inside: it lives in that namespace
            with sock, contextlib.suppress(OSError):
                sock.settimeout(0.5)
                sock.connect(addr)
                return
            time.sleep(0.05)
        raise not_up(proc, f"not listening on {addr} after {timeout}s")

    def _wait_log(self, proc: Process, text: bytes, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not proc.running():
                raise not_up(proc, "exited")
            if text in proc.log_path.read_bytes():
                return
            time.sleep(0.05)
        raise not_up(proc, f"did not log {text!r} after {timeout}s")

    def set_workers(self, mode: Mode, workers: int | None) -> None:
        """Restarts the mode's ztunnels with `ZTUNNEL_WORKER_THREADS=workers` (None: unset)."""
        by_proc = {id(p): ns for p, ns in self.ztunnels.values()}
        for proc in mode.processes:
            restart(proc, with_workers(proc.env, workers))
        for proc in mode.processes:
            self._wait_ready(proc, by_proc[id(proc)])

    # -- stop ----------------------------------------------------------------------------------

    def stop(self) -> None:
        for gen in self.gens:
            gen.close()
        procs = [p for p, _ in self.ztunnels.values()] + self.others
        for proc in procs:
            proc.send(signal.SIGTERM)
        for proc in procs:
            proc.stop()
        for ns in self.namespaces:
            ns.delete()
