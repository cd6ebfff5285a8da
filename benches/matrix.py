"""The benchmark matrix: which figures, measured how, in what order, and how rounds combine.

Each round measures every figure for every mode, figure by figure, with the order of the modes
rotated from one round to the next, so a noisy moment (another job on the machine) lands on
different modes in different rounds. Every figure is also kept as a ratio to `direct` from the
same round; the summary is the median over rounds of the values and of those ratios. The memory
figures are the exception: they are measured once, in the first round. The worker figures restart
the `hbone` pair of ztunnels with each worker count, last in each round, and put them back after.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from benches import paced, procfs
from benches.topology import LoadGenerator, Mode


@dataclass(frozen=True)
class Figure:
    key: str
    label: str
    unit: str
    higher_is_better: bool
    meaning: str
    modes: tuple[str, ...] | None = None  # the modes it is measured for (None: every mode)
    needs_tools: bool = False  # measured only where the C tools run (the capture topology)


FIGURES: tuple[Figure, ...] = (
    Figure(
        "throughput_1",
        "throughput, 1 stream",
        "MB/s",
        True,
        "bytes delivered to the sink per second, one connection",
    ),
    Figure("throughput_8", "throughput, 8 streams", "MB/s", True, "the same with 8 connections at once"),
    Figure(
        "rr_per_s",
        "1-byte round trips",
        "/s",
        True,
        "1-byte request, 1-byte response, one connection, one at a time",
    ),
    Figure("rr_p50_us", "round trip p50", "µs", False, "median latency of those round trips"),
    Figure("rr_p99_us", "round trip p99", "µs", False, "99th percentile latency of those round trips"),
    Figure("conn_per_s", "new connections", "/s", True, "connect, 1 byte, echo, close; 8 clients; pool warm"),
    Figure(
        "handshake_per_s",
        "new TLS handshakes",
        "/s",
        True,
        "the same where every connection needs its own TLS handshake",
    ),
    Figure(
        "conn_cpu_us",
        "proxy CPU per new connection",
        "µs",
        False,
        "CPU of the mode's proxy processes (all of them) per connection: one client, sequential "
        "connect, 1 byte, echo, close, pool warm",
    ),
    Figure(
        "cpu_s_per_gb",
        "proxy CPU per GB",
        "s/GB",
        False,
        "CPU seconds of the mode's proxy processes per 10^9 bytes moved (throughput runs)",
    ),
    Figure(
        "rss_idle_mb",
        "idle memory (PSS), largest proxy",
        "MB",
        False,
        "memory of the mode's largest proxy, idle, before the load: PSS summed over its processes "
        "(a ztunnel's parent and workers share pages, counted once) (10^6 bytes)",
    ),
    Figure(
        "rss_per_conn_kib",
        "RSS per idle connection",
        "KiB",
        False,
        "growth of the proxies' RSS (summed) per idle proxied connection, before the load",
    ),
    Figure(
        "rss_loaded_mb",
        "idle memory (PSS) after the load",
        "MB",
        False,
        "the largest proxy's PSS summed over its processes, idle again at the end of the round (10^6 bytes)",
    ),
)
WORKER_COUNTS = (1, 2, 4)
FIGURES += tuple(
    Figure(
        f"throughput_w{n}",
        f"throughput, 8 streams, {n} worker{'s' if n > 1 else ''}",
        "MB/s",
        True,
        f"throughput_8 with both hbone ztunnels at ZTUNNEL_WORKER_THREADS={n} (direct: measured beside it)",
        ("direct", "hbone"),
    )
    for n in WORKER_COUNTS
)
FIGURES += (
    Figure(
        "pss_per_worker_mb",
        "idle memory (PSS) per extra worker",
        "MB",
        False,
        "growth of an hbone ztunnel's idle PSS (summed over its processes) per data-plane worker, "
        "between the smallest and largest worker counts of the worker figures (10^6 bytes)",
        ("hbone",),
    ),
)
# The paced figures lead the table: the load people run, and what a proxy costs at it.
FIGURES = (
    Figure(
        "paced_per_s",
        "paced: achieved rate",
        "/s",
        True,
        "requests answered per second of the paced load (asked: 1,000/s of 1 KB each way over 4 "
        "persistent connections, open loop); below 99 % of the asked rate the table says so",
        needs_tools=True,
    ),
    Figure(
        "paced_vcpu",
        "paced: vCPU, busier proxy",
        "vCPU",
        False,
        "CPU seconds per wall second of the mode's busier proxy (all its processes) during the "
        "paced load; every proxy's in the JSON",
        needs_tools=True,
    ),
    Figure(
        "paced_pss_mb",
        "paced: PSS, largest proxy",
        "MB",
        False,
        "peak of the PSS samples (one a second, summed over its processes) of the mode's largest "
        "proxy during the paced load (10^6 bytes)",
        needs_tools=True,
    ),
    *(
        Figure(
            f"paced_p{p}_us",
            f"paced: latency p{p}",
            "µs",
            False,
            f"{p}th percentile of the paced requests' latency, from each one's intended send time "
            "to the last byte of its echo",
            needs_tools=True,
        )
        for p in (50, 90, 99)
    ),
    *FIGURES,
)
FIGURE_KEYS = tuple(f.key for f in FIGURES)
CERT_HELPER = (
    "ztunnel.identity.certwork"  # a ztunnel's certificate helper: python -m ztunnel.identity.certwork
)


@dataclass(frozen=True)
class Settings:
    rounds: int = 3
    seconds: float = 3.0  # per rate measurement
    connrate_concurrency: int = 8
    hold: int = 1000  # idle connections for the memory figure
    integrity_streams: int = 4
    integrity_size: int = 2 * 1024 * 1024
    max_count: int = 200_000  # per rate measurement, whatever the time
    worker_counts: tuple[int, ...] = WORKER_COUNTS  # empty: no worker figures
    # The paced load (capture topology): Istio's published one. A tenth of a vCPU moves by a few
    # per cent between runs of a few seconds on a shared machine: 10 s a round (4 s with --quick).
    paced_rate: float = 1000.0
    paced_seconds: float = 10.0
    paced_connections: int = 4
    paced_size: int = 1024

    @classmethod
    def quick(cls) -> Settings:
        # The stunnel anchor makes 1,000 full handshakes slowly: a smoke test holds fewer.
        return cls(rounds=1, seconds=0.5, hold=300, integrity_size=1024 * 1024, paced_seconds=4.0)


class BenchError(Exception):
    """A measurement failed: the load generator's error, with the mode and figure."""


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _ratio(value: float | None, base: float | None) -> float | None:
    if value is None or base is None or base == 0:
        return None
    return value / base


class Matrix:
    def __init__(
        self,
        modes: list[Mode],
        gen: LoadGenerator | None,
        settings: Settings,
        progress: Callable[[str], None] = print,
        set_workers: Callable[[Mode, int | None], None] | None = None,
        workers: int | None = None,
    ) -> None:
        self.modes = modes
        self.gen = gen
        # Restarts a mode's ztunnels with another worker count; `workers` is the run's own.
        self.set_workers = set_workers
        self.workers = workers
        self.settings = settings
        self.progress = progress
        self.rounds: list[dict[str, dict[str, float | None]]] = []
        self.integrity: dict[str, list[dict[str, Any]]] = {m.name: [] for m in modes}
        self.memory: dict[str, list[dict[str, Any]]] = {m.name: [] for m in modes}
        self.conn_cpu: dict[str, list[dict[str, Any]]] = {m.name: [] for m in modes}
        self.paced: dict[str, list[dict[str, Any]]] = {m.name: [] for m in modes}
        self.errors: list[str] = []

    def _call(self, mode: Mode, figure: str, cmd: str, *, fresh: bool = False, **args: Any) -> dict[str, Any]:
        gen = (mode.fresh_gen if fresh else None) or mode.gen or self.gen
        assert gen is not None, f"{mode.name} has no load generator"
        result = gen.call(cmd, **args)
        if "error" in result:
            raise BenchError(f"{mode.name}: {figure}: {result['error']}")
        return result

    def _order(self, r: int) -> list[Mode]:
        k = r % len(self.modes)
        return self.modes[k:] + self.modes[:k]

    def run(self) -> None:
        for r in range(self.settings.rounds):
            t0 = time.monotonic()
            values: dict[str, dict[str, float | None]] = {
                m.name: dict.fromkeys(FIGURE_KEYS) for m in self.modes
            }
            order = self._order(r)
            # Memory is measured once, first, on processes that have carried nothing but a few
            # warm-up connections: after the throughput tests their heaps keep freed memory
            # resident, which held connections would then reuse and the growth would not show.
            first = (self._memory,) if r == 0 else ()
            for step in (
                *first,
                self._integrity,
                self._paced,
                self._throughput,
                self._rr,
                self._connrate,
                self._handshakes,
                self._conn_cpu,
                self._loaded,
            ):
                for mode in order:
                    step(mode, values[mode.name])
            self._workers(order, values)
            self.rounds.append(values)
            self.progress(self.round_report(r, time.monotonic() - t0))

    # -- the measurements ----------------------------------------------------------------------

    def _pids(self, mode: Mode) -> list[int]:
        return [p for proc in mode.processes for p in proc.pids()]

    def _integrity(self, mode: Mode, out: dict[str, float | None]) -> None:
        s = self.settings
        res = self._call(
            mode,
            "integrity",
            "integrity",
            entry=mode.entry,
            streams=s.integrity_streams,
            size=s.integrity_size,
        )
        self.integrity[mode.name].append(res)
        if not res["ok"]:
            self.errors.append(f"{mode.name}: bytes through the echo came back different (sha256 mismatch)")

    def _paced(self, mode: Mode, out: dict[str, float | None]) -> None:
        if not mode.entry.get("tools"):
            return  # the loopback topology: no C tools to pace the load
        s = self.settings
        figures, record = paced.measure(
            {p.name: p.pids() for p in mode.processes},
            lambda: self._call(
                mode,
                "paced",
                "paced",
                entry=mode.entry,
                rate=s.paced_rate,
                seconds=s.paced_seconds,
                connections=s.paced_connections,
                size=s.paced_size,
            ),
        )
        out.update(figures)
        self.paced[mode.name].append(record)
        if record["errors"]:
            self.errors.append(
                f"{mode.name}: paced: {record['errors']} failed requests ({record['first_error']})"
            )

    def paced_reached(self) -> dict[str, bool | None]:
        """Per mode: whether every round's paced load reached the asked rate (None: not measured)."""
        return {m: all(r["reached"] for r in rs) if rs else None for m, rs in self.paced.items()}

    def _throughput(self, mode: Mode, out: dict[str, float | None]) -> None:
        s = self.settings
        pids = self._pids(mode)
        cpu = 0.0
        moved = 0
        for streams, key in ((1, "throughput_1"), (8, "throughput_8")):
            before = procfs.total_cpu(pids)
            res = self._call(mode, key, "throughput", entry=mode.entry, streams=streams, seconds=s.seconds)
            cpu += procfs.total_cpu(pids) - before
            moved += res["bytes"]
            out[key] = res["bytes_per_s"] / 1e6
            if not res["intact"]:
                self.errors.append(
                    f"{mode.name}: {key}: the sink counted {res['received']}, sent {res['sent']}"
                )
        out["cpu_s_per_gb"] = cpu / moved * 1e9 if pids and moved else None

    def _rr(self, mode: Mode, out: dict[str, float | None]) -> None:
        s = self.settings
        res = self._call(mode, "rr", "rr", entry=mode.entry, seconds=s.seconds, max_count=s.max_count)
        out["rr_per_s"] = res["per_s"]
        out["rr_p50_us"] = res["p50_us"]
        out["rr_p99_us"] = res["p99_us"]

    def _connrate(self, mode: Mode, out: dict[str, float | None]) -> None:
        s = self.settings
        res = self._call(
            mode,
            "conn_per_s",
            "connrate",
            entry=mode.entry,
            seconds=s.seconds,
            concurrency=s.connrate_concurrency,
            max_count=s.max_count,
        )
        if res["errors"]:
            self.errors.append(
                f"{mode.name}: conn_per_s: {res['errors']} failed connections ({res['first_error']})"
            )
        out["conn_per_s"] = res["per_s"]

    def _handshakes(self, mode: Mode, out: dict[str, float | None]) -> None:
        if mode.fresh_entry is None:
            out["handshake_per_s"] = out["conn_per_s"]  # nothing pooled: every connection is new
            return
        s = self.settings
        res = self._call(
            mode,
            "handshake_per_s",
            "connrate",
            fresh=True,
            entry=mode.fresh_entry,
            seconds=s.seconds,
            concurrency=s.connrate_concurrency,
            max_count=s.max_count,
        )
        if res["errors"]:
            self.errors.append(f"{mode.name}: handshake_per_s: {res['errors']} failed ({res['first_error']})")
        out["handshake_per_s"] = res["per_s"]

    def _conn_cpu(self, mode: Mode, out: dict[str, float | None]) -> None:
        pids = self._pids(mode)
        if not pids:
            return
        s = self.settings
        before = procfs.total_cpu(pids)
        res = self._call(
            mode,
            "conn_cpu_us",
            "connrate",
            entry=mode.entry,
            seconds=s.seconds,
            concurrency=1,
            max_count=s.max_count,
        )
        # The 3 warm-up connections are counted too: their CPU is inside the interval.
        cpu = procfs.total_cpu(pids) - before
        # The cost must not grow with the TIME_WAIT sockets around (the kernel's port search):
        # how many there were, in each proxy's namespace, is kept beside each measurement.
        self.conn_cpu[mode.name].append(
            {
                "connections": res["count"] + 3,
                "cpu_s": cpu,
                "time_wait": {p.name: procfs.time_wait(p.pid) for p in mode.processes},
            }
        )
        if res["errors"]:
            self.errors.append(f"{mode.name}: conn_cpu_us: {res['errors']} failed ({res['first_error']})")
        out["conn_cpu_us"] = cpu / (res["count"] + 3) * 1e6 if res["count"] else None

    def _workers(self, order: list[Mode], values: dict[str, dict[str, float | None]]) -> None:
        """throughput_8 of `hbone` with each worker count, and of `direct` measured beside it; and
        what an extra worker adds to a ztunnel's idle PSS."""
        s = self.settings
        if self.set_workers is None or not s.worker_counts:
            return
        measured = [m for m in order if m.name in ("direct", "hbone")]
        hbone = next((m for m in measured if m.name == "hbone"), None)
        if hbone is None:
            return
        idle_pss: dict[int, int] = {}
        try:
            for n in s.worker_counts:
                self.set_workers(hbone, n)
                # Idle as in `_memory`: a few connections through first, then the largest proxy.
                self._call(hbone, "pss_per_worker_mb", "hold", entry=hbone.entry, count=3)
                self._call(hbone, "pss_per_worker_mb", "release")
                time.sleep(0.3)
                self._without_cert_work(hbone)
                idle_pss[n] = max(procfs.total_pss_kib(p.pids()) for p in hbone.processes)
                for mode in measured:
                    key = f"throughput_w{n}"
                    res = self._call(mode, key, "throughput", entry=mode.entry, streams=8, seconds=s.seconds)
                    values[mode.name][key] = res["bytes_per_s"] / 1e6
                    if not res["intact"]:
                        self.errors.append(
                            f"{mode.name}: {key}: the sink counted {res['received']}, sent {res['sent']}"
                        )
        finally:
            self.set_workers(hbone, self.workers)
        low, high = min(idle_pss, default=0), max(idle_pss, default=0)
        if high > low:
            values["hbone"]["pss_per_worker_mb"] = (
                (idle_pss[high] - idle_pss[low]) / (high - low) * 1024 / 1e6
            )

    def _memory(self, mode: Mode, out: dict[str, float | None]) -> None:
        s = self.settings
        # A few connections first: the path is set up (pooled connection, certificates, imports
        # done lazily), as it would be on a proxy in service.
        self._call(mode, "rss_per_conn_kib", "hold", entry=mode.entry, count=3)
        self._call(mode, "rss_per_conn_kib", "release")
        time.sleep(0.3)
        self._without_cert_work(mode)
        idle = {p.name: procfs.total_rss_kib(p.pids()) for p in mode.processes}
        idle_pss = [procfs.total_pss_kib(p.pids()) for p in mode.processes]
        count = min(s.hold, mode.max_hold or s.hold)
        res = self._call(mode, "rss_per_conn_kib", "hold", entry=mode.entry, count=count)
        time.sleep(0.3)
        held = {p.name: procfs.total_rss_kib(p.pids()) for p in mode.processes}
        self._call(mode, "rss_per_conn_kib", "release")
        if res["errors"]:
            self.errors.append(f"{mode.name}: hold: {res['errors']} of {count} connections failed")
        self.memory[mode.name].append({"idle_kib": idle, "held_kib": held, "held": res["held"]})
        if mode.processes:
            out["rss_idle_mb"] = max(idle_pss) * 1024 / 1e6
            out["rss_per_conn_kib"] = (sum(held.values()) - sum(idle.values())) / max(res["held"], 1)

    def _without_cert_work(self, mode: Mode, timeout: float = 10.0) -> None:
        """Wait until no proxy of `mode` runs its certificate helper (`python -m ztunnel.identity.certwork`,
        started for a certificate and gone 2 s after its last one): idle means no work in flight,
        and a proxy's start-up certificate is such work. A helper still there after `timeout`
        is an error of the run (certificate work that never ends), and is measured with the rest."""
        deadline = time.monotonic() + timeout
        while any(procfs.running_module(p.pids(), CERT_HELPER) for p in mode.processes):
            if time.monotonic() >= deadline:
                self.errors.append(f"{mode.name}: its certificate helper still runs {timeout:g} s into idle")
                return
            time.sleep(0.1)

    def _loaded(self, mode: Mode, out: dict[str, float | None]) -> None:
        if mode.processes:
            time.sleep(0.2)  # the last test's connections close
            out["rss_loaded_mb"] = max(procfs.total_pss_kib(p.pids()) for p in mode.processes) * 1024 / 1e6

    # -- results -------------------------------------------------------------------------------

    def ratios(
        self, values: dict[str, dict[str, float | None]], base: str
    ) -> dict[str, dict[str, float | None]]:
        b = values.get(base, {})
        return {m: {k: _ratio(v, b.get(k)) for k, v in fig.items()} for m, fig in values.items()}

    def summary(self) -> dict[str, Any]:
        names = [m.name for m in self.modes]
        per_round_direct = [self.ratios(v, "direct") for v in self.rounds]
        per_round_stunnel = [self.ratios(v, "stunnel") for v in self.rounds] if "stunnel" in names else []

        def med(rows: list[dict[str, dict[str, float | None]]], m: str, k: str) -> float | None:
            return _median([x for row in rows if (x := row[m][k]) is not None])

        return {
            "value": {m: {k: med(self.rounds, m, k) for k in FIGURE_KEYS} for m in names},
            "vs_direct": {m: {k: med(per_round_direct, m, k) for k in FIGURE_KEYS} for m in names},
            "vs_stunnel": {m: {k: med(per_round_stunnel, m, k) for k in FIGURE_KEYS} for m in names}
            if per_round_stunnel
            else {},
            "paced_reached": self.paced_reached(),
        }

    def round_report(self, r: int, seconds: float) -> str:
        values = self.rounds[r]
        ratios = self.ratios(values, "direct")
        lines = [f"round {r + 1}/{self.settings.rounds} ({seconds:.0f}s), ratio to direct of the same round:"]
        for f in FIGURES:
            cells = []
            for m in self.modes:
                v, x = values[m.name][f.key], ratios[m.name][f.key]
                if v is None:
                    continue
                cells.append(
                    f"{m.name} {fmt(v)}" + (f" ({x:.2f}x)" if x is not None and m.name != "direct" else "")
                )
            lines.append(f"  {f.key:<17} " + ", ".join(cells))
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "settings": asdict(self.settings),
            "figures": [asdict(f) for f in FIGURES],
            "modes": [
                {"name": m.name, "processes": [p.name for p in m.processes], "note": m.note}
                for m in self.modes
            ],
            "rounds": self.rounds,
            "rounds_vs_direct": [self.ratios(v, "direct") for v in self.rounds],
            "summary": self.summary(),
            "integrity": self.integrity,
            "memory": self.memory,
            "conn_cpu": self.conn_cpu,
            "paced": self.paced,
            "errors": self.errors,
        }


def fmt(v: float | None) -> str:
    if v is None:
        return "-"
    if v >= 100:
        return f"{v:,.0f}"
    if v >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}"
