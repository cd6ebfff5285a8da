"""Data-plane worker processes: `ZTUNNEL_WORKER_THREADS=N` (CONTRACT §3, SPEC §13.1).

Opt-in: without `ZTUNNEL_WORKER_THREADS` in the environment `ztunnel proxy` stays one process with
one event loop (ARCHITECTURE.md). With it, CPython's one-core-per-process limit is worked around
the way the reference uses worker threads:

* the parent (`Supervisor`) is an `App` with the data plane off: it applies the local config (and
  runs xDS when configured), and serves admin (:15000), metrics (:15020) and readiness (:15021). It
  never accepts a proxied connection, so those stay responsive whatever the load;
* each of the N workers (`python -m ztunnel.workers`) is an `App` without the operator endpoints
  whose proxy listeners (15001, 15006, 15008, SOCKS5) are bound with `SO_REUSEPORT`: the kernel
  spreads new connections over the workers' sockets by a hash of the 4-tuple. A worker's
  connections live and die with it; the others keep serving, and a worker that exits or is killed
  is restarted (after 0.5 s, doubling up to 10 s while it keeps failing within 10 s of starting);
* readiness: the parent's `/healthz/ready` waits, besides its own tasks, for every worker to
  report its listeners up once; later restarts do not flip it (the others keep serving).

Metrics are summed, not sampled: every worker sends the parent its `istio_tcp_*` counters over a
Unix socket pair (one JSON line per second when they changed, and once more after its drain), and
the parent's `/metrics` serves, for each label set, the sum over the workers' latest reports plus
the final counts of workers that are gone. A worker killed with SIGKILL loses at most its last
second of counts. `process_*` families describe the parent process only. `/config_dump` lists the
workers (`workers`: index, pid, state, restarts, connections opened).

Limits of this first version: the certificate of the workload is fetched by each worker; with
`XDS_ADDRESS` each worker runs its own xDS stream (with `LOCAL_XDS_PATH` and `FAKE_CA` nothing of
the control plane runs in a worker after start-up).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import uvloop
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from ztunnel.app import App, StartupError, raise_fd_limit
from ztunnel.config import Config, ConfigError
from ztunnel.logs import setup_logging
from ztunnel.metrics import Metrics, render_openmetrics

log = logging.getLogger("ztunnel.workers")

WORKER_INDEX_ENV = "ZTUNNEL_WORKER_INDEX"
WORKER_FD_ENV = "ZTUNNEL_WORKER_FD"
SNAPSHOT_INTERVAL = 1.0
TRAFFIC_PREFIX = "istio_tcp_"
RESTART_DELAY = 0.5
RESTART_DELAY_MAX = 10.0
# A worker that ran at least this long before dying is restarted after the shortest delay again.
STABLE_AFTER = 10.0

LabelPairs = tuple[tuple[str, str], ...]
SampleKey = tuple[str, LabelPairs]  # (family name, labels in emission order)


# -- metrics: what a worker reports, and the parent's sum ---------------------------------------


def traffic_snapshot(metrics: Metrics) -> dict[str, Any]:
    """The traffic counters of one process: `{family: {"help": …, "samples": [[labels, value]]}}`.

    Labels travel as pairs, so the order SPEC §10.3 fixes survives the trip.
    """
    out: dict[str, Any] = {}
    for family in metrics.registry.collect():
        if family.type != "counter" or not family.name.startswith(TRAFFIC_PREFIX):
            continue
        samples = [[list(s.labels.items()), s.value] for s in family.samples if s.name.endswith("_total")]
        if samples:
            out[family.name] = {"help": family.documentation, "samples": samples}
    return out


class TrafficSums(Collector):
    """The parent's view of the workers' counters: latest report per live worker + retired totals."""

    def __init__(self) -> None:
        self.help: dict[str, str] = {}
        self.live: dict[int, dict[SampleKey, float]] = {}
        self.retired: dict[SampleKey, float] = {}

    @staticmethod
    def _parse(snapshot: dict[str, Any]) -> tuple[dict[SampleKey, float], dict[str, str]]:
        values: dict[SampleKey, float] = {}
        helps: dict[str, str] = {}
        for name, family in snapshot.items():
            helps[name] = str(family.get("help", ""))
            for labels, value in family["samples"]:
                values[(name, tuple((str(k), str(v)) for k, v in labels))] = float(value)
        return values, helps

    def report(self, worker: int, snapshot: dict[str, Any]) -> None:
        values, helps = self._parse(snapshot)
        self.help.update(helps)
        self.live[worker] = values

    def retire(self, worker: int) -> None:
        """A worker is gone: its last report becomes part of the totals for good."""
        for key, value in self.live.pop(worker, {}).items():
            self.retired[key] = self.retired.get(key, 0.0) + value

    def totals(self) -> dict[SampleKey, float]:
        out = dict(self.retired)
        for values in self.live.values():
            for key, value in values.items():
                out[key] = out.get(key, 0.0) + value
        return out

    def opened(self, worker: int) -> int:
        return int(
            sum(
                v
                for (name, _), v in self.live.get(worker, {}).items()
                if name == "istio_tcp_connections_opened"
            )
        )

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        families: dict[str, CounterMetricFamily] = {}
        for (name, labels), value in sorted(self.totals().items()):
            family = families.get(name)
            if family is None:
                family = families[name] = CounterMetricFamily(
                    name, self.help.get(name, ""), labels=[k for k, _ in labels]
                )
            family.add_metric([v for _, v in labels], value)
        yield from families.values()


class SummedMetrics(Metrics):
    """The parent's metrics: its own registry (build info, process, xDS), then the workers' sums."""

    def __init__(self, sums: TrafficSums, istio_version: str) -> None:
        super().__init__(istio_version=istio_version)
        self.sums = sums
        self._sum_registry = CollectorRegistry(auto_describe=False)
        self._sum_registry.register(sums)

    def render(self, accept_header: str | None) -> tuple[bytes, str]:
        own, content_type = super().render(accept_header)
        end = b"# EOF\n"
        if own.endswith(end):
            own = own[: -len(end)]
        return own + render_openmetrics(self._sum_registry), content_type


# -- the parent ---------------------------------------------------------------------------------


@dataclass
class WorkerSlot:
    index: int
    pid: int | None = None
    state: str = "starting"  # starting | ready | restarting | stopped
    restarts: int = 0
    ever_ready: bool = False
    started_at: float = 0.0
    delay: float = RESTART_DELAY
    process: asyncio.subprocess.Process | None = None
    task: asyncio.Task[None] | None = None


class Supervisor:
    """The parent process: operator endpoints and state here, proxied connections in the workers."""

    def __init__(self, config: Config, environ: dict[str, str]) -> None:
        self.config = config
        self.environ = environ
        self.count = max(1, config.worker_threads)
        self.sums = TrafficSums()
        self.app = App(config)
        self.app.data_plane = False
        self.app.metrics = SummedMetrics(self.sums, config.istio_version)
        self._app_dump = self.app.config_dump
        # The admin server takes these bound methods at start-up; ours add the workers.
        self.app.config_dump = self.config_dump  # type: ignore[method-assign]
        self.app.shutdown = self.shutdown  # type: ignore[method-assign]
        self.slots = [WorkerSlot(i) for i in range(self.count)]
        self._stop = asyncio.Event()
        self._stopping = False
        self._all_ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def config_dump(self) -> dict[str, Any]:
        dump = dict(self._app_dump())
        dump["workers"] = [
            {
                "index": s.index,
                "pid": s.pid,
                "state": s.state,
                "restarts": s.restarts,
                "connectionsOpened": self.sums.opened(s.index),
            }
            for s in self.slots
        ]
        return dump

    def shutdown(self) -> None:
        self._stop.set()

    async def _wait_stop(self) -> None:
        await self._stop.wait()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.shutdown)
        workers_ready = self.app.readiness.register("workers")
        stop = asyncio.ensure_future(self._wait_stop())
        try:
            await self.app.start()
            for slot in self.slots:
                await self._spawn(slot)
            await asyncio.wait([self._all_ready, stop], return_when=asyncio.FIRST_COMPLETED)
            if self._all_ready.done():
                self._all_ready.result()  # a worker that died before it was up fails start-up
                workers_ready.release()
                log.info("%d data-plane workers ready: pids %s", self.count, [s.pid for s in self.slots])
            await stop
        finally:
            stop.cancel()
            log.info(
                "shutting down: draining workers for up to %ss", self.config.connection_termination_deadline
            )
            await self._stop_workers()
            await self.app.drain()
        return 0

    async def _spawn(self, slot: WorkerSlot) -> None:
        parent_end, child_end = socket.socketpair()
        env = dict(self.environ)
        env[WORKER_INDEX_ENV] = str(slot.index)
        env[WORKER_FD_ENV] = str(child_end.fileno())
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "ztunnel.workers", env=env, pass_fds=(child_end.fileno(),)
            )
        finally:
            child_end.close()
        reader, writer = await asyncio.open_unix_connection(sock=parent_end)
        slot.process = process
        slot.pid = process.pid
        slot.state = "starting"
        slot.started_at = time.monotonic()
        slot.task = asyncio.get_running_loop().create_task(self._watch(slot, process, reader, writer))

    async def _watch(
        self,
        slot: WorkerSlot,
        process: asyncio.subprocess.Process,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        try:
            while line := await reader.readline():
                try:
                    message = json.loads(line)
                except ValueError:
                    continue
                kind = message.get("type")
                if kind == "ready":
                    slot.state = "ready"
                    slot.ever_ready = True
                    if all(s.ever_ready for s in self.slots) and not self._all_ready.done():
                        self._all_ready.set_result(None)
                elif kind == "metrics":
                    self.sums.report(slot.index, message.get("families", {}))
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass  # a line too long, or the socket broke: the process is going anyway
        finally:
            writer.close()
        code = await process.wait()
        self.sums.retire(slot.index)
        if self._stopping:
            slot.state = "stopped"
            return
        if not slot.ever_ready and not self._all_ready.done():
            self._all_ready.set_exception(
                StartupError(
                    f"data-plane worker {slot.index} exited with {code} before its listeners were up"
                )
            )
            return
        slot.state = "restarting"
        ran = time.monotonic() - slot.started_at
        slot.delay = RESTART_DELAY if ran >= STABLE_AFTER else min(slot.delay * 2, RESTART_DELAY_MAX)
        log.warning(
            "data-plane worker %d (pid %s) exited with %s; restarting in %.1fs",
            slot.index,
            slot.pid,
            code,
            slot.delay,
        )
        await asyncio.sleep(slot.delay)
        if self._stopping:
            slot.state = "stopped"
            return
        slot.restarts += 1
        try:
            await self._spawn(slot)
        except OSError as e:
            log.error("data-plane worker %d: restart failed: %s", slot.index, e)
            slot.state = "stopped"

    async def _stop_workers(self) -> None:
        self._stopping = True
        for slot in self.slots:
            if slot.process is not None and slot.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    slot.process.send_signal(signal.SIGTERM)
        deadline = self.config.connection_termination_deadline + 5.0
        tasks = [s.task for s in self.slots if s.task is not None]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=deadline)
            for slot in self.slots:
                if slot.process is not None and slot.process.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        slot.process.kill()
            if pending:
                await asyncio.wait(pending, timeout=5.0)


def run_supervisor(config: Config, environ: dict[str, str]) -> int:
    async def main() -> int:
        return await Supervisor(config, environ).run()

    return uvloop.run(main())


# -- a worker -------------------------------------------------------------------------------------


async def _report(writer: asyncio.StreamWriter, message: dict[str, Any]) -> None:
    writer.write(json.dumps(message, separators=(",", ":")).encode() + b"\n")
    await writer.drain()


async def _worker(config: Config, index: int, fd: int) -> int:
    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_unix_connection(sock=socket.socket(fileno=fd))
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    app = App(config)
    # Only the traffic counters are reported to the parent: no /proc reads for process_* here.
    app.metrics = Metrics(config.istio_version, process_metrics=False)
    app.operator_endpoints = False
    app.reuseport = True
    try:
        await app.start()
    except StartupError as e:
        print(f"ztunnel worker {index}: {e}", file=sys.stderr, flush=True)
        return 1

    async def parent_gone() -> None:
        # The parent writes nothing: EOF means it is gone, and a worker never outlives it.
        await reader.read()
        stop.set()

    async def report_loop() -> None:
        while not app.readiness.is_ready():
            await asyncio.sleep(0.05)
        await _report(writer, {"type": "ready", "pid": os.getpid()})
        last: dict[str, Any] | None = None
        while True:
            snapshot = traffic_snapshot(app.metrics)
            if snapshot != last:
                await _report(writer, {"type": "metrics", "families": snapshot})
                last = snapshot
            await asyncio.sleep(SNAPSHOT_INTERVAL)

    watchers = [loop.create_task(parent_gone()), loop.create_task(report_loop())]
    try:
        await stop.wait()
        await app.drain()
        with contextlib.suppress(OSError):
            await _report(writer, {"type": "metrics", "families": traffic_snapshot(app.metrics)})
    finally:
        for task in watchers:
            task.cancel()
        writer.close()
    return 0


def run_worker(environ: dict[str, str]) -> int:
    try:
        index = int(environ[WORKER_INDEX_ENV])
        fd = int(environ[WORKER_FD_ENV])
    except (KeyError, ValueError):
        print(
            "ztunnel.workers: started by `ztunnel proxy` with ZTUNNEL_WORKER_THREADS, not by hand",
            file=sys.stderr,
        )
        return 2
    try:
        config = Config.from_env(environ)
    except ConfigError as e:
        print(f"ztunnel worker {index}: {e}", file=sys.stderr)
        return 1
    setup_logging(config.log_format, config.log_level)
    raise_fd_limit()
    try:
        return uvloop.run(_worker(config, index, fd))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(run_worker(dict(os.environ)))
