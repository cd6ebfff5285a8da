"""The `dns` figure (`python -m benches --dns`): authoritative queries per second through the DNS proxy
of a real `ztunnel proxy`, side by side in one run with Debian's `dnsmasq` serving the same names
from a hosts file, load from Debian's `dnsperf`; the same proxy's DNS server without its cache of
ready answers (what the cache saves); and the added latency of the forwarded path (one query at a
time, through the proxy to dnsmasq, against straight to dnsmasq).

Every server is pinned to the same one core and dnsperf to the other when there are two, so
"on one core" holds for both. The forwarded path needs root: the proxy's `/etc/resolv.conf`, which
names the upstream, is bind-mounted in a private mount namespace and dnsmasq listens on port 53.

`python -m benches.dns serve ...` is the cacheless server's process (internal).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NAMES = 200
SERVER_CPU = 1
LOAD_CPU = 0


class DnsBenchError(Exception):
    pass


def _mesh_yaml(ip: str) -> str:
    lines = [
        "workloads:",
        f'  - {{uid: bench//Pod/ns1/client, name: client, namespace: ns1, serviceAccount: client, workloadIps: ["{ip}"]}}',
        "services:",
    ]
    for i in range(NAMES):
        lines.append(
            f"  - {{name: svc-{i}, namespace: ns1, hostname: svc-{i}.ns1.svc.cluster.local, "
            f'vips: ["/10.96.{i // 250}.{i % 250 + 1}"], ports: {{80: 80}}}}'
        )
    return "\n".join(lines) + "\n"


def _hosts() -> str:
    mesh = [f"10.96.{i // 250}.{i % 250 + 1} svc-{i}.ns1.svc.cluster.local" for i in range(NAMES)]
    forwarded = [f"192.0.2.{i % 250 + 1} host-{i}.upstream.test" for i in range(NAMES)]
    return "\n".join(mesh + forwarded) + "\n"


def _pin(cpu: int) -> Any:
    cpus = os.sched_getaffinity(0)
    if len(cpus) < 2:
        return None
    chosen = sorted(cpus)[cpu % len(cpus)]
    return lambda: os.sched_setaffinity(0, {chosen})


@dataclass
class Server:
    name: str
    addr: tuple[str, int]
    proc: subprocess.Popen[bytes]
    log: Path


def _wait_udp(server: Server, name: str, timeout: float = 30.0) -> None:
    import dns.message

    query = dns.message.make_query(name, "A").to_wire()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise DnsBenchError(f"{server.name} exited {server.proc.returncode}: see {server.log}")
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(0.2)
            try:
                s.sendto(query, server.addr)
                s.recv(512)
                return
            except OSError:
                time.sleep(0.1)
    raise DnsBenchError(f"{server.name} did not answer on {server.addr}: see {server.log}")


def dnsperf(addr: tuple[str, int], queries: Path, seconds: float, outstanding: int) -> dict[str, float]:
    """dnsperf's queries per second and average latency against `addr`."""
    cmd = ["dnsperf", "-s", addr[0], "-p", str(addr[1]), "-d", str(queries), "-l", f"{seconds:g}"]
    cmd += ["-q", str(outstanding), "-c", "1", "-t", "2"]
    done = subprocess.run(
        cmd, capture_output=True, text=True, preexec_fn=_pin(LOAD_CPU), timeout=seconds + 30
    )
    out = done.stdout
    qps = re.search(r"Queries per second:\s+([\d.]+)", out)
    lat = re.search(r"Average Latency \(s\):\s+([\d.]+)", out)
    lost = re.search(r"Queries lost:\s+(\d+)", out)
    if done.returncode != 0 or qps is None or lat is None:
        raise DnsBenchError(f"dnsperf failed: {out[-800:]} {done.stderr[-400:]}")
    return {
        "qps": float(qps.group(1)),
        "latency_s": float(lat.group(1)),
        "lost": float(lost.group(1) if lost else 0),
    }


class DnsBench:
    def __init__(self, workdir: Path, seconds: float) -> None:
        self.workdir = workdir
        self.seconds = seconds
        self.net = f"127.{os.getpid() % 200 + 20}.{int(time.time()) % 250}"
        self.servers: list[Server] = []
        self.root = os.geteuid() == 0 and shutil.which("unshare") is not None
        self.notes: list[str] = []

    def _spawn(
        self, name: str, cmd: list[str], addr: tuple[str, int], env: dict[str, str] | None = None
    ) -> Server:
        log = self.workdir / f"{name}.log"
        proc = subprocess.Popen(
            cmd, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT, preexec_fn=_pin(SERVER_CPU)
        )
        server = Server(name, addr, proc, log)
        self.servers.append(server)
        return server

    def start(self) -> dict[str, Server]:
        for tool in ("dnsmasq", "dnsperf"):
            if shutil.which(tool) is None:
                raise DnsBenchError(f"{tool} is not installed (Debian packages dnsmasq-base, dnsperf)")
        hosts = self.workdir / "hosts"
        hosts.write_text(_hosts())
        mesh = self.workdir / "mesh.yaml"
        proxy_ip, plain_ip, upstream_ip = f"{self.net}.2", f"{self.net}.3", f"{self.net}.53"
        mesh.write_text(_mesh_yaml(proxy_ip))
        up_port = 53 if self.root else 15353
        dnsmasq = self._spawn(
            "dnsmasq",
            ["dnsmasq", "--keep-in-foreground", "--no-resolv", "--no-hosts", f"--addn-hosts={hosts}",
             "--bind-interfaces", f"--listen-address={upstream_ip}", f"--port={up_port}",
             "--local=/cluster.local/", "--local=/upstream.test/", "--cache-size=10000",
             f"--pid-file={self.workdir / 'dnsmasq.pid'}", "--log-facility=-"]
            + (["--user=root"] if self.root else []),
            (upstream_ip, up_port),
        )  # fmt: skip
        resolv = self.workdir / "resolv.conf"
        resolv.write_text(f"nameserver {upstream_ip}\n")
        env = {
            **{
                k: v
                for k, v in os.environ.items()
                if not k.startswith(("XDS_", "CA_", "PROXY_", "LOCAL_XDS"))
            },
            "PROXY_MODE": "dedicated",
            "PROXY_WORKLOAD_INFO": "ns1/client/client",
            "XDS_ADDRESS": "",
            "FAKE_CA": "true",
            "LOCAL_XDS_PATH": str(mesh),
            "PROXY_BIND_ADDRESS": proxy_ip,
            "ADMIN_ADDRESS": f"{proxy_ip}:15000",
            "STATS_ADDRESS": f"{proxy_ip}:15020",
            "READINESS_ADDRESS": f"{proxy_ip}:15021",
            "LOG_LEVEL": "warn",
        }
        proxy_cmd = [sys.executable, "-m", "ztunnel", "proxy"]
        if self.root:
            script = 'mount --bind "$0" /etc/resolv.conf && exec "$@"'
            proxy_cmd = [
                "unshare",
                "-m",
                "--propagation",
                "private",
                "sh",
                "-c",
                script,
                str(resolv),
                *proxy_cmd,
            ]
        else:
            self.notes.append(
                "not root: the forwarded path is not measured (needs a private mount namespace)"
            )
        proxy = self._spawn("ztunnel", proxy_cmd, (proxy_ip, 15053), env)
        plain = self._spawn(
            "nocache",
            [
                sys.executable,
                "-m",
                "benches.dns",
                "serve",
                "--mesh",
                str(mesh),
                "--addr",
                f"{plain_ip}:15053",
            ],
            (plain_ip, 15053),
        )
        probe = "svc-0.ns1.svc.cluster.local."
        for server in (dnsmasq, proxy, plain):
            _wait_udp(server, probe)
        return {"dnsmasq": dnsmasq, "ztunnel": proxy, "nocache": plain}

    def run(self) -> dict[str, Any]:
        servers = self.start()
        mesh_queries = self.workdir / "mesh-queries"
        mesh_queries.write_text("".join(f"svc-{i}.ns1.svc.cluster.local A\n" for i in range(NAMES)))
        fwd_queries = self.workdir / "forwarded-queries"
        fwd_queries.write_text("".join(f"host-{i}.upstream.test A\n" for i in range(NAMES)))
        results: dict[str, Any] = {"seconds": self.seconds, "names": NAMES, "notes": self.notes}
        # Authoritative: each server in turn, twice, order alternated; the better run counts.
        qps: dict[str, list[float]] = {name: [] for name in servers}
        for order in (list(servers), list(reversed(servers))):
            for name in order:
                qps[name].append(dnsperf(servers[name].addr, mesh_queries, self.seconds, 100)["qps"])
        results["qps"] = {name: max(values) for name, values in qps.items()}
        if self.root:
            direct = dnsperf(servers["dnsmasq"].addr, fwd_queries, self.seconds, 1)
            through = dnsperf(servers["ztunnel"].addr, fwd_queries, self.seconds, 1)
            results["forwarded"] = {
                "direct_latency_s": direct["latency_s"],
                "proxy_latency_s": through["latency_s"],
                "added_latency_s": through["latency_s"] - direct["latency_s"],
            }
        return results

    def stop(self) -> None:
        for server in self.servers:
            if server.proc.poll() is None:
                server.proc.terminate()
        for server in self.servers:
            try:
                server.proc.wait(10)
            except subprocess.TimeoutExpired:
                server.proc.kill()


def report(results: dict[str, Any]) -> str:
    q = results["qps"]
    base = q["dnsmasq"] or 1.0
    rows = [
        ("dnsmasq, hosts file", q["dnsmasq"]),
        ("ztunnel proxy DNS (ready-answer cache)", q["ztunnel"]),
        ("ztunnel DNS server, no cache", q["nocache"]),
    ]
    lines = [
        f"dns: authoritative A queries, dnsperf (100 outstanding), {results['seconds']:g}s per run, "
        f"servers on one core",
        f"{'server':<42}{'queries/s':>12}{'x dnsmasq':>11}",
    ]
    lines += [f"{name:<42}{value:>12.0f}{value / base:>11.2f}" for name, value in rows]
    goal = q["ztunnel"] / base
    lines.append(f"goal >= 0.5x dnsmasq: {'met' if goal >= 0.5 else 'NOT met'} ({goal:.2f}x)")
    fwd = results.get("forwarded")
    if fwd:
        lines.append(
            f"forwarded path, one query at a time: direct {fwd['direct_latency_s'] * 1e3:.3f} ms, "
            f"through the proxy {fwd['proxy_latency_s'] * 1e3:.3f} ms, "
            f"added {fwd['added_latency_s'] * 1e3:.3f} ms"
        )
    lines += [f"note: {n}" for n in results["notes"]]
    return "\n".join(lines)


def run_figure(seconds: float, out: Path) -> int:
    """Run the figure, print it, write `out/dns-latest.json`; 0 when it ran."""
    workdir = Path(tempfile.mkdtemp(prefix="ztunnel-dns-bench-"))
    bench = DnsBench(workdir, seconds)
    try:
        results = bench.run()
    except DnsBenchError as e:
        print(f"benches: dns: {e}", file=sys.stderr)
        print(f"logs: {workdir}", file=sys.stderr)
        return 1
    finally:
        bench.stop()
    print(report(results))
    out.mkdir(parents=True, exist_ok=True)
    path = out / "dns-latest.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"JSON: {path}")
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


# -- the cacheless server's process ------------------------------------------------------------


async def _serve(mesh: Path, addr: tuple[str, int]) -> None:
    from mesh.localconfig import parse_local_config
    from ztunnel.dns.forwarder import Forwarder, UpstreamConfig
    from ztunnel.dns.resolver import ResolverSettings
    from ztunnel.dns.server import DnsServer
    from ztunnel.metrics.families import Metrics
    from ztunnel.sockets import SocketFactory
    from ztunnel.state.store import ProxyState

    state = ProxyState()
    state.apply_local_config(parse_local_config(mesh.read_text()))
    client = state.find_local_workload("client", "ns1", "client", None)

    class Local:
        def find_local_workload(self) -> Any:
            return client

        async def local_workload(self, timeout: float = 5.0) -> Any:
            return client

    sockets = SocketFactory()
    server = DnsServer(
        addr,
        state,
        Local(),
        sockets,
        Metrics(process_metrics=False).dns(),
        Forwarder(UpstreamConfig(), sockets),
        ResolverSettings(search_domains=()),
        cache=False,
    )
    await server.start()
    await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benches.dns")
    sub = p.add_subparsers(dest="command")
    serve = sub.add_parser("serve", help="the cacheless DNS server (used by the figure)")
    serve.add_argument("--mesh", type=Path, required=True)
    serve.add_argument("--addr", required=True)
    run = sub.add_parser("run", help="the dns figure")
    run.add_argument("--seconds", type=float, default=3.0)
    run.add_argument("--out", type=Path, default=Path("results"))
    args = p.parse_args(argv)
    if args.command == "serve":
        import uvloop

        host, _, port = args.addr.rpartition(":")
        with contextlib.suppress(KeyboardInterrupt):
            uvloop.run(_serve(args.mesh, (host, int(port))))
        return 0
    if args.command == "run":
        return run_figure(args.seconds, args.out)
    p.print_help()
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
