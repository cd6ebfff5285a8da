"""`python -m benches --soak DURATION`: the `hbone` mode (both ztunnels) under a steady mix, watched
for leaks.

First, a concurrency check: `--soak-concurrent` connections (10,000 by default) open at the same
time, every byte each sends compared with what comes back, while all the others are held. Then the
mix for DURATION, every byte compared too: a few long-lived streams echoing at a bounded rate, a
bounded churn of short connections (connect, 8 bytes, echo, close), and idle held connections each
probed with a byte now and then. Every `--soak-interval` (a minute by default) the harness samples
the two proxies' RSS and open fds from /proc (worker processes included). The drift is the last
sample against the first one after the warm-up (a sixth of the run, at most 5 minutes, and at least
one interval); the goals are RSS within ±5 % and no fd growth beyond the connections in flight.

Output: a line per sample, the drift, `soak-<time>.json` and `latest-soak.json` in `--out`. The
exit status is 0 only if the concurrency check and the mix lost or changed no byte and no
connection failed; the drift goals are reported, not enforced (a soak of minutes cannot judge them).
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benches import procfs
from benches.topology import LoadGenerator, Mode

RSS_GOAL_PCT = 5.0
_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """`90`, `90s`, `30m`, `1.5h` in seconds (argparse type)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text)
    if not m or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 90s, 30m, 1h)")
    return float(m.group(1)) * _UNITS[m.group(2)]


@dataclass(frozen=True)
class SoakSettings:
    duration: float
    interval: float = 60.0
    concurrent: int = 10_000
    concurrent_size: int = 64  # bytes each connection echoes, twice
    idle: int = 1000
    streams: int = 4
    stream_rate: float = 1e6  # bytes/s each
    churn_rate: float = 50.0  # short connections per second

    @property
    def warmup(self) -> float:
        return max(self.interval, min(300.0, self.duration / 6))

    @classmethod
    def from_args(
        cls, duration: float, interval: float | None, concurrent: int | None, idle: int | None
    ) -> SoakSettings:
        s = cls(duration=duration)
        if interval is not None:
            s = cls(**{**asdict(s), "interval": interval})
        if concurrent is not None:
            s = cls(**{**asdict(s), "concurrent": concurrent})
        if idle is not None:
            s = cls(**{**asdict(s), "idle": idle})
        return s


def _sample(mode: Mode, t: float, stats: dict[str, Any]) -> dict[str, Any]:
    rss = {p.name: procfs.total_rss_kib(p.pids()) for p in mode.processes}
    fds = {p.name: procfs.total_fds(p.pids()) for p in mode.processes}
    return {
        "t_s": round(t, 1),
        "rss_kib": rss,
        "rss_total_kib": sum(rss.values()),
        "fds": fds,
        "fds_total": sum(fds.values()),
        "load": stats,
    }


def drift(samples: list[dict[str, Any]], warmup: float) -> dict[str, Any]:
    """The last sample against the first one at or after `warmup` seconds (None: too few samples)."""
    after = [s for s in samples if s["t_s"] >= warmup]
    if len(after) < 2:
        return {"baseline_t_s": None, "rss_pct": None, "fds": None, "rss_max_pct": None}
    base, last = after[0], after[-1]
    pct = [(s["rss_total_kib"] - base["rss_total_kib"]) / base["rss_total_kib"] * 100 for s in after]
    return {
        "baseline_t_s": base["t_s"],
        "rss_pct": pct[-1],
        "rss_max_pct": max(pct, key=abs),
        "fds": last["fds_total"] - base["fds_total"],
    }


def run_soak(
    topology: str, modes: list[Mode], s: SoakSettings, out_dir: Path, progress: Callable[[str], None] = print
) -> bool:
    mode = next(m for m in modes if m.name == "hbone")
    assert mode.gen is not None
    errors: list[str] = []
    progress(
        f"soak ({topology}): hbone, {s.duration:g}s, a sample every {s.interval:g}s; first "
        f"{s.concurrent} connections at once, every byte checked"
    )
    conc = _concurrency_check(mode, mode.gen, s, errors, progress)
    samples, final = _mix(mode, mode.gen, s, errors, progress)
    d = drift(samples, s.warmup)
    rss_ok = None if d["rss_pct"] is None else abs(d["rss_pct"]) <= RSS_GOAL_PCT
    # fds: the churn's connections in flight come and go; more than that is growth.
    fds_ok = None if d["fds"] is None else d["fds"] <= 4 * max(1, int(s.churn_rate * 0.1)) + 8
    progress(
        f"drift after {d['baseline_t_s']}s of warm-up: RSS {_pct(d['rss_pct'])} "
        f"(largest {_pct(d['rss_max_pct'])}; goal ±{RSS_GOAL_PCT:g} %: {_met(rss_ok)}), "
        f"fds {d['fds']:+} ({_met(fds_ok)})"
        if d["fds"] is not None
        else "drift: too few samples after the warm-up"
    )
    data = {
        "topology": topology,
        "settings": {**asdict(s), "warmup": s.warmup},
        "concurrent": conc,
        "samples": samples,
        "final": final,
        "drift": {**d, "rss_goal_pct": RSS_GOAL_PCT, "rss_met": rss_ok, "fds_met": fds_ok},
        "errors": errors,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    text = json.dumps(data, indent=2)
    path = out_dir / f"soak-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(text)
    (out_dir / "latest-soak.json").write_text(text)
    progress(f"JSON: {path}")
    for e in errors:
        progress(f"error: {e}")
    return not errors


def _concurrency_check(
    mode: Mode, gen: LoadGenerator, s: SoakSettings, errors: list[str], progress: Callable[[str], None]
) -> dict[str, Any]:
    """`s.concurrent` connections open at once, every byte compared; what holding them cost."""
    before = _sample(mode, 0.0, {})
    conc = gen.call("concurrent", entry=mode.entry, count=s.concurrent, size=s.concurrent_size, keep=True)
    time.sleep(0.3)  # the last echoes' buffers are freed
    held = _sample(mode, 0.0, {})
    gen.call("release")
    # The proxies close their ends as the closes arrive: the mix starts once they have.
    settle = time.monotonic() + 15
    while _sample(mode, 0.0, {})["fds_total"] > before["fds_total"] + 50 and time.monotonic() < settle:
        time.sleep(0.2)
    if conc.get("held"):
        grown = held["rss_total_kib"] - before["rss_total_kib"]
        conc["rss_before_kib"], conc["rss_held_kib"] = before["rss_kib"], held["rss_kib"]
        conc["fds_held"] = held["fds"]
        conc["rss_per_conn_kib"] = grown / conc["held"]
    if "error" in conc:
        errors.append(f"concurrent: {conc['error']}")
    elif not conc["ok"]:
        errors.append(
            f"concurrent: {conc['held']} of {conc['count']} held, {conc['errors']} errors "
            f"({conc['first_error']}), {conc['mismatched']} echoes changed"
        )
    else:
        progress(
            f"  {conc['held']} connections held at once, {conc['bytes_verified']:,} bytes verified, "
            f"opened in {conc['open_seconds']:.1f}s; the proxies' RSS grew {conc['rss_per_conn_kib']:.1f} KiB "
            "per held connection"
        )
    return conc


def _mix(
    mode: Mode, gen: LoadGenerator, s: SoakSettings, errors: list[str], progress: Callable[[str], None]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The soak's mix for `s.duration`, sampled every `s.interval`; the samples and the final counters."""
    started = gen.call(
        "soak_start",
        entry=mode.entry,
        streams=s.streams,
        stream_rate=s.stream_rate,
        churn_rate=s.churn_rate,
        idle=s.idle,
    )
    samples: list[dict[str, Any]] = []
    final: dict[str, Any] = {}
    if "error" in started:
        errors.append(f"soak: {started['error']}")
    else:
        samples = _sample_until_done(mode, gen, s, progress)
        final = gen.call("soak_stop")
        if final.get("errors") or final.get("mismatched"):
            errors.append(
                f"soak: {final.get('errors')} failed operations ({final.get('first_error')}), "
                f"{final.get('mismatched')} echoes changed"
            )
    return samples, final


def _sample_until_done(
    mode: Mode, gen: LoadGenerator, s: SoakSettings, progress: Callable[[str], None]
) -> list[dict[str, Any]]:
    samples: list[dict[str, Any]] = []
    t0 = time.monotonic()
    next_at = t0
    while True:
        now = time.monotonic()
        if now < next_at:
            time.sleep(next_at - now)
        t = time.monotonic() - t0
        stats = gen.call("soak_stats")
        sample = _sample(mode, t, stats)
        samples.append(sample)
        progress(
            f"  t={t:6.0f}s  RSS "
            + ", ".join(f"{n} {v / 1024:.1f} MiB" for n, v in sample["rss_kib"].items())
            + f"  fds {sample['fds_total']}  streamed {stats.get('stream_bytes', 0) / 1e6:.0f} MB, "
            f"{stats.get('churn_connections', 0)} short, {stats.get('idle_held', 0)} idle, "
            f"{stats.get('errors', 0)} errors"
        )
        if t >= s.duration - 0.5:
            break
        next_at = min(next_at + s.interval, t0 + s.duration)
    return samples


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:+.1f} %"


def _met(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "NOT met")
