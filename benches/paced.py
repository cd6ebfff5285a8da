"""The paced figure (capture topology): the load Istio publishes a ztunnel's cost at, 1,000
requests/s of 1 KB each way over 4 persistent connections (`tools paced`, open loop: latency from
each request's intended send time), and what each proxy of the mode costs meanwhile.

While the tool runs, a thread of the harness samples every proxy of the mode: its CPU (the
scheduler's nanosecond count over all threads of all its processes: a ztunnel's parent, its
workers, and its certificate helper while one runs) every 0.2 s, its PSS (summed over those processes) every second. A proxy's
vCPU is its CPU seconds per wall second between the first and the last sample inside the tool's
own window (which `tools paced` reports on the same monotonic clock), so the connections' set-up,
the warm-up requests and the tear-down stay out of it. The figure is the busier proxy's; every
proxy's is in the JSON (`paced`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from benches import procfs

CPU_INTERVAL = 0.2  # seconds between CPU samples
PSS_EVERY = 5  # a PSS sample every this many CPU samples (reading smaps walks the page tables)
REACHED = 0.99  # the rate counts as reached at this share of the asked one, with no failed request


@dataclass
class Sample:
    t: float  # time.monotonic()
    cpu: dict[str, float]  # per proxy: CPU seconds of its live threads (scheduler's count)
    ticks: dict[str, float]  # per proxy: CPU seconds from /proc/<pid>/stat (10 ms ticks)
    pss_kib: dict[str, int] | None = None


@dataclass
class Sampler:
    """Samples the proxies' CPU and PSS on a thread of its own until `stop()`."""

    proxies: dict[str, list[int]]  # name -> pids (resolved once, before the run)
    samples: list[Sample] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="paced-sampler", daemon=True)

    def sample(self, with_pss: bool) -> Sample:
        t = time.monotonic()
        s = Sample(
            t,
            {n: procfs.total_thread_cpu(pids) for n, pids in self.proxies.items()},
            {n: procfs.total_cpu(pids) for n, pids in self.proxies.items()},
        )
        if with_pss:
            s.pss_kib = {n: procfs.total_pss_kib(pids) for n, pids in self.proxies.items()}
        return s

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            self.samples.append(self.sample(i % PSS_EVERY == 0))
            i += 1
            self._stop.wait(CPU_INTERVAL)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> list[Sample]:
        self._stop.set()
        self._thread.join()
        return self.samples


def window_rates(samples: list[Sample], start: float, end: float, ticks: bool = False) -> dict[str, float]:
    """Each proxy's CPU seconds per wall second between the first and the last sample inside
    [start, end]; empty when fewer than two samples fall inside."""
    inside = [s for s in samples if start <= s.t <= end]
    if len(inside) < 2 or inside[-1].t <= inside[0].t:
        return {}
    a, b = inside[0], inside[-1]
    first, last = (a.ticks, b.ticks) if ticks else (a.cpu, b.cpu)
    return {n: (last[n] - first[n]) / (b.t - a.t) for n in first}


def window_pss(samples: list[Sample], start: float, end: float) -> dict[str, list[float]]:
    """Each proxy's PSS samples (MB, 10^6 bytes) inside [start, end]."""
    out: dict[str, list[float]] = {}
    for s in samples:
        if s.pss_kib is not None and start <= s.t <= end:
            for n, kib in s.pss_kib.items():
                out.setdefault(n, []).append(kib * 1024 / 1e6)
    return out


def reached(res: dict[str, Any]) -> bool:
    return res["errors"] == 0 and res["per_s"] >= REACHED * res["asked_per_s"]


def measure(
    proxies: dict[str, list[int]],
    run: Callable[[], dict[str, Any]],
) -> tuple[dict[str, float | None], dict[str, Any]]:
    """Runs `run()` (the `paced` command) with the proxies sampled; its figures and its record."""
    sampler = Sampler(proxies)
    sampler.start()
    try:
        res = run()
    finally:
        samples = sampler.stop()
    start, end = res["start_mono"], res["end_mono"]
    vcpu = window_rates(samples, start, end)
    vcpu_ticks = window_rates(samples, start, end, ticks=True)
    pss = window_pss(samples, start, end)
    per_proxy: dict[str, dict[str, Any]] = {
        n: {
            "vcpu": vcpu.get(n),
            "vcpu_ticks": vcpu_ticks.get(n),
            "pss_mb_peak": max(pss[n]) if pss.get(n) else None,
            "pss_mb_samples": pss.get(n, []),
        }
        for n in proxies
    }
    busier = max(vcpu, key=lambda n: vcpu[n]) if vcpu else None
    peaks: list[float] = [p["pss_mb_peak"] for p in per_proxy.values() if p["pss_mb_peak"] is not None]
    figures: dict[str, float | None] = {
        "paced_per_s": res["per_s"],
        "paced_p50_us": res["p50_us"],
        "paced_p90_us": res["p90_us"],
        "paced_p99_us": res["p99_us"],
        "paced_vcpu": vcpu[busier] if busier else None,
        "paced_pss_mb": max(peaks) if peaks else None,
    }
    record = {
        **{k: res[k] for k in ("asked_per_s", "per_s", "count", "planned", "errors", "unsent")},
        **{k: res[k] for k in ("first_error", "seconds", "connections", "size")},
        **{k: res[k] for k in ("p50_us", "p90_us", "p99_us", "max_us", "mean_us")},
        "reached": reached(res),
        "busier": busier,
        "proxies": per_proxy,
        "samples": len(samples),
    }
    return figures, record
