"""How a run is judged and shown: the issue's targets read the run's JSON and say n/a, with the
reason, where the run cannot judge them; the paced figures say when the asked rate was not
reached; a proxy's vCPU comes from the samples inside the load's own window."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import pytest

from benches import paced, procfs
from benches.matrix import FIGURE_KEYS, Matrix
from benches.report import table, targets_report
from tests.waiting import eventually


def _data(
    *,
    hbone: dict[str, float | None] | None = None,
    vs_stunnel: dict[str, float | None] | None = None,
    held: int = 10_000,
    reached: dict[str, bool | None] | None = None,
    workers: int | None = None,
) -> dict[str, Any]:
    blank = dict.fromkeys(FIGURE_KEYS)
    values = {m: dict(blank) for m in ("direct", "tcp", "hbone", "stunnel")}
    values["hbone"].update(hbone or {})
    values["tcp"].update(rss_idle_mb=30.0, rss_loaded_mb=35.0)
    return {
        "summary": {
            "value": values,
            "vs_direct": {m: dict(blank) for m in values},
            "vs_stunnel": {"hbone": {**blank, **(vs_stunnel or {})}},
            "paced_reached": reached or {"direct": True, "tcp": True, "hbone": True, "stunnel": True},
        },
        "memory": {"hbone": [{"held": held}]},
        "workers": workers,
    }


def test_targets_judge_the_ratios_to_stunnel_and_the_memory() -> None:
    data = _data(
        hbone={"rss_idle_mb": 38.0, "rss_loaded_mb": 52.0, "rss_per_conn_kib": 15.0},
        vs_stunnel={"paced_vcpu": 0.9, "rr_per_s": 0.8, "throughput_1": 1.3, "conn_per_s": 2.9},
    )
    text, rows = targets_report(data)
    got = {r["target"]: (r["value"], r["met"]) for r in rows}
    assert len(rows) == 7 and "targets:" in text
    assert got["paced 1,000 req/s: vCPU of the busier hbone proxy ≤ 1.0x the busier stunnel's"] == (0.9, True)
    assert got["hbone 1-byte round trips ≥ 1.0x stunnel"] == (0.8, False)
    assert got["hbone throughput, 1 stream ≥ 1.25x stunnel"] == (1.3, True)
    assert got["hbone new connections (warm pool) ≥ 3x stunnel"] == (2.9, False)
    idle = next(r for r in rows if r["target"].startswith("idle PSS"))
    assert (idle["value"], idle["met"]) == (38.0, True)  # the larger of tcp (30) and hbone (38)
    growth = next(r for r in rows if "within 10 MB" in r["target"])
    assert (growth["value"], growth["met"]) == (14.0, False)  # hbone: 52 - 38, over tcp's 5
    per_conn = next(r for r in rows if "per idle connection" in r["target"])
    assert (per_conn["value"], per_conn["met"], per_conn["note"]) == (15.0, True, "")
    assert "NOT met  hbone 1-byte round trips" in text


def test_targets_say_why_a_run_cannot_judge_them() -> None:
    data = _data(
        hbone={"rss_idle_mb": 38.0, "rss_per_conn_kib": 9.0},
        vs_stunnel={"paced_vcpu": 0.5},
        held=300,
        reached={"hbone": False, "stunnel": True},
        workers=4,
    )
    text, rows = targets_report(data)
    by = {r["target"]: r for r in rows}
    per_conn = next(r for r in rows if "per idle connection" in r["target"])
    # Measured, but at 300 held: not the target's condition, so no verdict either way.
    assert per_conn["value"] == 9.0 and per_conn["met"] is None
    assert per_conn["note"] == "measured at 300 held, the target is for 10,000 (--hold)"
    paced_row = by["paced 1,000 req/s: vCPU of the busier hbone proxy ≤ 1.0x the busier stunnel's"]
    assert paced_row["met"] is None and paced_row["note"] == "the asked rate was not reached by hbone"
    idle = next(r for r in rows if r["target"].startswith("idle PSS"))
    assert idle["met"] is None and "4 workers" in idle["note"]
    rr = by["hbone 1-byte round trips ≥ 1.0x stunnel"]
    assert rr["value"] is None and rr["met"] is None and rr["note"] == "not measured in this run"
    assert "n/a      hbone RSS per idle connection ≤ 16 KiB at 10,000 held: 9.00 (measured at 300" in text


def test_the_table_marks_paced_figures_whose_rate_was_not_reached() -> None:
    data = _data(hbone={"paced_per_s": 912.0, "paced_vcpu": 0.3}, reached={"hbone": False, "tcp": True})
    data["summary"]["value"]["direct"]["paced_per_s"] = 1000.0
    text = table(data["summary"], ["direct", "tcp", "hbone"])
    [rate] = [line for line in text.splitlines() if line.startswith("paced: achieved rate")]
    assert rate.split()[-1] == "*912" and "1,000" in rate
    assert text.splitlines()[-1].startswith("* paced: the asked rate was not reached") and "hbone" in text


def test_window_rates_read_only_the_samples_inside_the_window() -> None:
    samples = [
        paced.Sample(t, {"a": cpu, "b": cpu / 2}, {"a": cpu, "b": cpu / 2})
        for t, cpu in ((0.0, 0.0), (1.0, 5.0), (2.0, 5.5), (3.0, 6.0), (4.0, 20.0))
    ]
    # The set-up before the window (5 s of CPU in the first second) and the tear-down after it
    # (14 s) stay out: 1 s of CPU over the 2 s from the sample at 1.0 to the one at 3.0.
    assert paced.window_rates(samples, 0.5, 3.5) == {"a": 0.5, "b": 0.25}
    assert paced.window_rates(samples, 1.5, 2.5) == {}  # one sample inside: no rate


def cpu_ticks(pid: int) -> int:
    """User and system clock ticks the kernel counted for `pid` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def test_the_sampler_sees_a_busy_process_use_a_core() -> None:
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        eventually(lambda: cpu_ticks(busy.pid) > 0, "the busy process spinning")
        sampler = paced.Sampler({"busy": [busy.pid], "self": [os.getpid()]})
        sampler.start()
        t0 = time.monotonic()
        time.sleep(1.2)  # the window sampled: the measurement, not a wait
        samples = sampler.stop()
        rates = paced.window_rates(samples, t0, time.monotonic())
    finally:
        busy.kill()
        busy.wait()
    # A busy loop gets at most one core (much less when the machine is shared, never nothing);
    # a sleeping test, less than that. The scheduler's count agrees with the kernel's ticks.
    assert 0.05 < rates["busy"] <= 1.05, rates
    assert rates["self"] < rates["busy"], rates
    pss = [s.pss_kib for s in samples if s.pss_kib is not None]
    assert pss and all(p["busy"] > 1000 for p in pss), pss
    assert paced.window_rates(samples, t0, time.monotonic(), ticks=True)["busy"] == pytest.approx(
        rates["busy"], abs=0.1
    )


class _Proxy:
    """What `Matrix` reads of a proxy's processes: their pids, the gone ones left out."""

    def __init__(self, *popens: subprocess.Popen[bytes]) -> None:
        self.popens = popens

    def pids(self) -> list[int]:
        return [p.pid for p in self.popens if p.poll() is None]


def _helper(linger: float) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "ztunnel.identity.certwork", "--linger", str(linger)], stdin=subprocess.PIPE
    )


def test_idle_memory_waits_for_a_certificate_helper_to_leave() -> None:
    """The idle figure is taken once no `python -m ztunnel.identity.certwork` runs under a proxy (it leaves
    after its linger); one that does not leave fails the run instead of passing for idle."""
    matrix = Matrix.__new__(Matrix)  # only its error list is used here
    matrix.errors = []
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    short, long = _helper(0.5), _helper(60)
    try:
        # The long one (the short one may have lingered out already on a busy machine), once it is
        # past its exec (its command line empty until then).
        eventually(
            lambda: procfs.running_module([sleeper.pid, long.pid], "ztunnel.identity.certwork"), "the helper"
        )
        assert not procfs.running_module([sleeper.pid], "ztunnel.identity.certwork")
        t0 = time.monotonic()
        matrix._without_cert_work(types.SimpleNamespace(name="hbone", processes=[_Proxy(sleeper, short)]))
        # Gone, or in its exit (its command line already empty: /proc shows no module any more).
        left = short.poll() is not None or Path(f"/proc/{short.pid}/cmdline").read_bytes() == b""
        assert left and time.monotonic() - t0 < 10, "returned before the helper left"
        assert matrix.errors == []
        matrix._without_cert_work(types.SimpleNamespace(name="tcp", processes=[_Proxy(long)]), timeout=0.5)
        assert matrix.errors == ["tcp: its certificate helper still runs 0.5 s into idle"]
    finally:
        for p in (sleeper, short, long):
            p.kill()
            p.wait()
