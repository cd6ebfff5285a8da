"""`python -m benches scale --workloads N [--workers W]`: the state at cluster scale.

The development control plane (`ztunnel control-plane`) serves N workloads, N/10 services and N/100
policies (`benches/scalemesh.py`) to one dedicated proxy (`ztunnel proxy`, with its workers) over
xDS. Reported, as a table and JSON:

* the control plane's time to serve (from its start to its first listening line) and its memory;
* the proxy's time to ready (`/healthz/ready`), then until the probe service is routable through
  every worker (SOCKS5 connections to its VIP reach the sink: `2 x workers` in a row), then until
  `/config_dump` holds every workload;
* PSS of every process of the proxy (`smaps_rollup`: shared pages counted once) and their sum;
* a push changing `--push-percent` % of the workloads (the probe's target port among them): the time
  from the control plane's "configuration reloaded" line until every worker routes by it, and the
  latency of new connections through the proxy (SOCKS5 handshake to the sink's first byte: p50/p99)
  before and during the push.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benches import procfs
from benches.entry import Entry, open_socket, sock_recv_exactly
from benches.scalemesh import PROBE_PORT, PROBE_VIP, PROXY_WORKLOAD, ScaleMesh

PROBE_TIMEOUT = 1.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benches scale",
        description="the proxy's state at cluster scale (see benches/scale.py)",
    )
    p.add_argument(
        "--workloads", type=int, required=True, help="workloads served (services N/10, policies N/100)"
    )
    p.add_argument(
        "--workers", type=int, default=2, help="the proxy's workers (ZTUNNEL_WORKER_THREADS; default 2)"
    )
    p.add_argument(
        "--push-percent", type=float, default=1.0, help="workloads a push changes, in %% (default 1)"
    )
    p.add_argument(
        "--rate", type=float, default=100.0, help="new connections per second of the probe (default 100)"
    )
    p.add_argument("--timeout", type=float, default=240.0, help="seconds allowed for each wait (default 240)")
    p.add_argument("--out", type=Path, default=Path("results"), help="results folder (default: results/)")
    p.add_argument(
        "--keep-logs", action="store_true", help="keep the processes' logs (their folder is printed)"
    )
    return p


# --- the sink and the probe ----------------------------------------------------------------------


async def start_sink(ip: str) -> tuple[list[asyncio.Server], tuple[int, int]]:
    """Two listeners at the probe workload's address; each answers with one byte naming itself."""

    def handler(mark: bytes) -> Any:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(mark)
            try:
                await writer.drain()
            finally:
                writer.close()

        return handle

    servers = [await asyncio.start_server(handler(m), ip, 0, backlog=4096) for m in (b"1", b"2")]
    ports = tuple(s.sockets[0].getsockname()[1] for s in servers)
    return servers, (ports[0], ports[1])


@dataclass
class Sample:
    started: float
    latency: float | None  # None: failed
    mark: bytes


@dataclass
class Prober:
    """New connections through the proxy's SOCKS5 listener to the probe VIP."""

    entry: Entry
    samples: list[Sample] = field(default_factory=list)

    async def once(self) -> Sample:
        started = time.monotonic()
        sock: socket.socket | None = None
        try:
            sock = await asyncio.wait_for(open_socket(self.entry, (PROBE_VIP, PROBE_PORT)), PROBE_TIMEOUT)
            mark = await asyncio.wait_for(sock_recv_exactly(sock, 1), PROBE_TIMEOUT)
            sample = Sample(started, time.monotonic() - started, mark)
        except (OSError, ConnectionError, TimeoutError):
            sample = Sample(started, None, b"")
        finally:
            if sock is not None:
                sock.close()
        self.samples.append(sample)
        return sample

    async def until(self, mark: bytes, in_a_row: int, timeout: float) -> float:
        """Probe one at a time until `in_a_row` connections in a row answer `mark`; the monotonic
        time the first of them started."""
        deadline = time.monotonic() + timeout
        run: list[Sample] = []
        while time.monotonic() < deadline:
            s = await self.once()
            run = [*run, s] if s.mark == mark else []
            if len(run) >= in_a_row:
                return run[0].started
            if s.latency is None or s.mark != mark:
                await asyncio.sleep(0.01)
        raise TimeoutError(f"the probe did not answer {mark!r} {in_a_row} times in a row within {timeout:g}s")

    async def paced(self, rate: float, stop: asyncio.Event) -> None:
        """Connections at `rate` per second, each on its own, until `stop`."""
        tasks: set[asyncio.Task[Sample]] = set()
        interval = 1.0 / rate
        next_at = time.monotonic()
        while not stop.is_set():
            t = asyncio.ensure_future(self.once())
            tasks.add(t)
            t.add_done_callback(tasks.discard)
            next_at += interval
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        if tasks:
            await asyncio.wait(tasks)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def latency_figures(samples: list[Sample], start: float, end: float) -> dict[str, Any]:
    chosen = [s for s in samples if start <= s.started <= end]
    ok = [s.latency for s in chosen if s.latency is not None]
    p50, p99 = percentile(ok, 0.50), percentile(ok, 0.99)
    return {
        "connections": len(chosen),
        "failed": len(chosen) - len(ok),
        "p50_ms": None if p50 is None else round(p50 * 1000, 2),
        "p99_ms": None if p99 is None else round(p99 * 1000, 2),
        "max_ms": round(max(ok) * 1000, 2) if ok else None,
    }


# --- HTTP to the admin and readiness servers ------------------------------------------------------


async def http_get(host: str, port: int, path: str, timeout: float) -> tuple[int, bytes]:
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        raw = await asyncio.wait_for(reader.read(-1), timeout)
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/") else 0
    return status, body


# --- the processes ----------------------------------------------------------------------------


@dataclass
class Processes:
    workdir: Path
    control_plane: subprocess.Popen[bytes] | None = None
    proxy: subprocess.Popen[bytes] | None = None

    def start_control_plane(self, config: Path, listen: str) -> subprocess.Popen[bytes]:
        self.control_plane = subprocess.Popen(
            [sys.executable, "-m", "ztunnel", "control-plane", "--config", str(config), "--listen", listen,
             "--ca-dir", str(self.workdir / "ca")],
            stdout=(self.workdir / "control-plane.log").open("wb"),
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        return self.control_plane

    def start_proxy(self, env: dict[str, str]) -> subprocess.Popen[bytes]:
        self.proxy = subprocess.Popen(
            [sys.executable, "-m", "ztunnel", "proxy"],
            env=env,
            stdout=(self.workdir / "proxy.log").open("wb"),
            stderr=subprocess.STDOUT,
        )
        return self.proxy

    def stop(self) -> None:
        for p in (self.proxy, self.control_plane):
            if p is None or p.poll() is not None:
                continue
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def proxy_env(ip: str, control_plane: str, workers: int) -> dict[str, str]:
    ns, name, sa = PROXY_WORKLOAD
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XDS_", "CA_", "PROXY_", "LOCAL_XDS"))}
    env.update(
        PROXY_MODE="dedicated",
        PROXY_WORKLOAD_INFO=f"{ns}/{name}/{sa}",
        XDS_ADDRESS=f"http://{control_plane}",
        CA_ADDRESS=f"http://{control_plane}",
        PROXY_BIND_ADDRESS=ip,
        UNSTABLE_ENABLE_SOCKS5="true",
        SOCKS5_ADDRESS=f"{ip}:15080",
        ADMIN_ADDRESS=f"{ip}:15000",
        STATS_ADDRESS=f"{ip}:15020",
        READINESS_ADDRESS=f"{ip}:15021",
        ZTUNNEL_WORKER_THREADS=str(workers),
        LOG_LEVEL="info",
    )
    return env


def process_memory(root: int) -> list[dict[str, Any]]:
    """PSS and RSS of `root` and every process below it, each named by its part."""
    out = []
    for pid in procfs.tree(root):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        role = (
            "parent"
            if pid == root
            else "certificate helper"
            if b"ztunnel.identity.certwork" in argv
            else "worker"
        )
        out.append({"pid": pid, "role": role, "pss_kib": procfs.pss_kib(pid), "rss_kib": procfs.rss_kib(pid)})
    return out


def state_images_kib(pids: list[int]) -> int:
    """The state images the proxy holds (memfds named `ztunnel-state`, each counted once): shared
    memory, in a process's PSS only for the pages it has mapped in, so the proxy's memory in all is
    at most its PSS plus this."""
    seen: dict[int, int] = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:ztunnel-state"):
                    st = os.stat(f"/proc/{pid}/fd/{fd}")
                    seen[st.st_ino] = st.st_size
            except OSError:
                continue
    return sum(seen.values()) // 1024


def peak_rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


# The proxy's start-up, from its log: each line's time after the xDS stream is established.
MILESTONES = {
    "stream_established": '"Stream established"',
    "first_response_received": '"received response"',
    "initial_state_applied": '"initial xDS state applied"',
    "workers_ready": "data-plane workers ready",
}


def start_up_milestones(log_path: Path) -> dict[str, float]:
    """Seconds from the stream's start to each milestone the proxy logged (RFC 3339 times)."""
    from datetime import datetime

    seen: dict[str, float] = {}
    with log_path.open(errors="replace") as f:
        for line in f:
            for name, needle in MILESTONES.items():
                if name not in seen and needle in line:
                    stamp = line.split("\t", 1)[0].replace("Z", "+00:00")
                    try:
                        seen[name] = datetime.fromisoformat(stamp).timestamp()
                    except ValueError:
                        pass
            if len(seen) == len(MILESTONES):
                break
    start = seen.get("stream_established")
    return {k: round(v - start, 2) for k, v in seen.items()} if start is not None else {}


async def wait_log(path: Path, needle: str, timeout: float, after: int = 0) -> float:
    """The monotonic time `needle` appears in the log at `path` past byte `after` (polled every 5 ms)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with path.open("rb") as f:
                f.seek(after)
                if needle.encode() in f.read():
                    return time.monotonic()
        except OSError:
            pass
        await asyncio.sleep(0.005)
    raise TimeoutError(f"{path.name}: no {needle!r} within {timeout:g}s")


# --- the run ----------------------------------------------------------------------------------


@dataclass
class Run:
    args: argparse.Namespace
    workdir: Path
    procs: Processes
    figures: dict[str, Any] = field(default_factory=dict)

    def note(self, text: str) -> None:
        print(text, flush=True)

    async def start(self, mesh: ScaleMesh, listen: str) -> float:
        """The control plane, then the proxy once it serves; the proxy's start time."""
        config = self.workdir / "mesh.yaml"
        t = time.monotonic()
        config.write_text(mesh.render())
        self.figures["mesh_yaml_mib"] = round(config.stat().st_size / 2**20, 1)
        self.figures["mesh_render_s"] = round(time.monotonic() - t, 2)
        cp_started = time.monotonic()
        cp = self.procs.start_control_plane(config, listen)
        served = await wait_log(self.workdir / "control-plane.log", "listening on", self.args.timeout)
        self.figures["control_plane"] = {"serve_s": round(served - cp_started, 2)}
        self.note(f"control plane serving after {served - cp_started:.2f}s")
        started = time.monotonic()
        self.procs.start_proxy(proxy_env(mesh.proxy_ip, listen, self.args.workers))
        self.figures["control_plane"]["pid"] = cp.pid
        return started

    async def until_ready(self, mesh: ScaleMesh, started: float, prober: Prober) -> None:
        deadline = started + self.args.timeout
        proxy = self.procs.proxy
        assert proxy is not None
        while time.monotonic() < deadline:
            if proxy.poll() is not None:
                raise RuntimeError(
                    f"the proxy exited with {proxy.returncode}: see {self.workdir / 'proxy.log'}"
                )
            try:
                status, _ = await http_get(mesh.proxy_ip, 15021, "/healthz/ready", 1.0)
                if status == 200:
                    break
            except (OSError, TimeoutError):
                pass
            await asyncio.sleep(0.02)
        else:
            raise TimeoutError("the proxy was not ready in time")
        ready = time.monotonic() - started
        routable = await prober.until(b"1", 2 * self.args.workers, deadline - time.monotonic()) - started
        dumped, dump_s = await self.until_dumped(mesh, deadline)
        self.figures["proxy"] = {
            "ready_s": round(ready, 2),
            "routable_s": round(routable, 2),
            "in_config_dump_s": round(dumped - started, 2),
            "config_dump_request_s": round(dump_s, 2),
            "after_stream_s": start_up_milestones(self.workdir / "proxy.log"),
        }
        self.note(
            f"proxy ready {ready:.2f}s, routable {routable:.2f}s, all in /config_dump {dumped - started:.2f}s"
        )

    async def until_dumped(self, mesh: ScaleMesh, deadline: float) -> tuple[float, float]:
        """(when, how long the request took): the first /config_dump holding every workload."""
        while time.monotonic() < deadline:
            asked = time.monotonic()
            status, body = await http_get(mesh.proxy_ip, 15000, "/config_dump", self.args.timeout)
            done = time.monotonic()
            if status == 200:
                dump = await asyncio.to_thread(json.loads, body)
                held = len(dump.get("workloads", ()))
                if held >= mesh.total_workloads:
                    return done, done - asked
            await asyncio.sleep(0.1)
        raise TimeoutError("/config_dump never held every workload")

    def memory(self, when: str) -> None:
        proxy = self.procs.proxy
        assert proxy is not None
        processes = process_memory(proxy.pid)
        total = sum(p["pss_kib"] for p in processes)
        images = state_images_kib([p["pid"] for p in processes])
        self.figures.setdefault("memory", {})[when] = {
            "processes": processes,
            "pss_total_kib": total,
            "state_images_kib": images,
        }
        parts = " + ".join(f"{p['role']} {p['pss_kib'] / 1024:.1f}" for p in processes)
        self.note(f"proxy PSS {when}: {total / 1024:.1f} MiB ({parts}); state images {images / 1024:.1f} MiB")

    async def push(self, mesh: ScaleMesh, prober: Prober) -> None:
        config = self.workdir / "mesh.yaml"
        log_path = self.workdir / "control-plane.log"
        changed = frozenset(mesh.pushed(self.args.push_percent))
        text = mesh.render("v2", changed, pushed=True)
        stop = asyncio.Event()
        paced = asyncio.ensure_future(prober.paced(self.args.rate, stop))
        await asyncio.sleep(2.0)  # the latency before the push
        mark = log_path.stat().st_size
        tmp = config.with_suffix(".new")
        tmp.write_text(text)
        written = time.monotonic()
        tmp.replace(config)
        try:
            pushed = await wait_log(log_path, "configuration reloaded", self.args.timeout, after=mark)
            applied = await self.applied(prober, pushed)
            await asyncio.sleep(1.0)
        finally:
            stop.set()
            await paced
        before = latency_figures(prober.samples, pushed - 2.0 - (pushed - written), written)
        during = latency_figures(prober.samples, pushed, max(applied, pushed) + 0.2)
        self.figures["push"] = {
            "workloads_changed": len(changed) + 1,
            "control_plane_reload_s": round(pushed - written, 2),
            "apply_s": round(applied - pushed, 3),
            "before": before,
            "during": during,
        }
        self.note(
            f"push of {len(changed) + 1} workloads: control plane reload {pushed - written:.2f}s, applied "
            f"{(applied - pushed) * 1000:.0f} ms after it; new connections p99 {before['p99_ms']} ms "
            f"before, {during['p99_ms']} ms during"
        )

    async def applied(self, prober: Prober, pushed: float) -> float:
        """When every worker routes by the push: the start of the first run of `2 x workers` paced
        connections in a row answered by the second port."""
        need = 2 * self.args.workers
        deadline = time.monotonic() + self.args.timeout
        while time.monotonic() < deadline:
            after = sorted((s for s in prober.samples if s.started >= pushed), key=lambda s: s.started)
            run: list[Sample] = []
            for s in after:
                if s.latency is None:
                    continue
                run = [*run, s] if s.mark == b"2" else []
                if len(run) >= need:
                    return run[0].started
            await asyncio.sleep(0.05)
        raise TimeoutError("the push was never routed by")


async def run_scale(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    base = f"127.{random.randrange(1, 250)}.{random.randrange(1, 250)}"
    proxy_ip, sink_ip, listen = f"{base}.2", f"{base}.3", f"{base}.1:15012"
    servers, ports = await start_sink(sink_ip)
    mesh = ScaleMesh(args.workloads, proxy_ip, sink_ip, ports)
    run = Run(args, workdir, Processes(workdir))
    run.figures.update(
        workloads=mesh.workloads, services=mesh.services, policies=mesh.policies, workers=args.workers
    )
    prober = Prober(Entry("socks5", (sink_ip, ports[0]), (sink_ip, ports[0]), proxy=(proxy_ip, 15080)))
    try:
        started = await run.start(mesh, listen)
        await run.until_ready(mesh, started, prober)
        await asyncio.sleep(2.0)  # the idle trim gives back the start's garbage
        run.memory("settled")
        cp = run.procs.control_plane
        assert cp is not None
        run.figures["control_plane"].update(pss_kib=procfs.pss_kib(cp.pid), peak_rss_kib=peak_rss_kib(cp.pid))
        await run.push(mesh, prober)
        await asyncio.sleep(2.0)
        run.memory("after push")
    finally:
        run.procs.stop()
        for s in servers:
            s.close()
    return run.figures


def table(f: dict[str, Any]) -> str:
    settled = f["memory"]["settled"]
    rows = [
        ("workloads / services / policies", f"{f['workloads']:,} / {f['services']:,} / {f['policies']:,}"),
        ("workers", str(f["workers"])),
        ("control plane: serving after", f"{f['control_plane']['serve_s']:.2f} s"),
        ("control plane: PSS (peak RSS)",
         f"{f['control_plane']['pss_kib'] / 1024:.0f} MiB ({f['control_plane']['peak_rss_kib'] / 1024:.0f} MiB)"),
        ("proxy: ready", f"{f['proxy']['ready_s']:.2f} s"),
        ("proxy: routable (every worker)", f"{f['proxy']['routable_s']:.2f} s"),
        ("proxy: all in /config_dump", f"{f['proxy']['in_config_dump_s']:.2f} s"),
        ("  after the xDS stream opened", ", ".join(f"{k} {v:.2f} s" for k, v in f["proxy"]["after_stream_s"].items())),
        ("proxy: PSS in all", f"{settled['pss_total_kib'] / 1024:.1f} MiB"),
        *((f"  {p['role']} {p['pid']}", f"{p['pss_kib'] / 1024:.1f} MiB") for p in settled["processes"]),
        ("proxy: state images held (shared memory)", f"{settled['state_images_kib'] / 1024:.1f} MiB"),
        ("proxy: PSS per workload", f"{settled['pss_total_kib'] * 1024 / max(1, f['workloads']):,.0f} B"),
        ("push: workloads changed", str(f["push"]["workloads_changed"])),
        ("push: applied after the control plane's push", f"{f['push']['apply_s'] * 1000:.0f} ms"),
        ("new connections p99: before / during push",
         f"{f['push']['before']['p99_ms']} / {f['push']['during']['p99_ms']} ms"),
        ("proxy: PSS after the push", f"{f['memory']['after push']['pss_total_kib'] / 1024:.1f} MiB"),
    ]  # fmt: skip
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.workloads < 1 or args.workers < 1 or not 0 < args.push_percent <= 100 or args.rate <= 0:
        print("benches scale: --workloads, --workers, --rate must be positive, --push-percent in (0, 100]",
              file=sys.stderr)  # fmt: skip
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="ztunnel-scale-"))
    ok = False
    try:
        figures = asyncio.run(run_scale(args, workdir))
        ok = True
    except (RuntimeError, TimeoutError, OSError) as e:
        print(f"benches scale: {e}", file=sys.stderr)
        return 1
    finally:
        if args.keep_logs or not ok:
            print(f"logs: {workdir}", file=sys.stderr)
        else:
            import shutil

            shutil.rmtree(workdir, ignore_errors=True)
    print()
    print(table(figures))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"scale-{args.workloads}-{args.workers}w-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(figures, indent=2))
    print(f"\nJSON: {path}")
    return 0
