"""The load-test harness, as a user runs it: `python -m benches --quick` completes every mode, writes
every figure to its JSON, and the bytes sent through each mode come back intact; as root the same on
the production path (`--topology capture`: namespaces, iptables REDIRECT, C tools, iperf3); and a
short `--soak` holds its mix through both proxies with every byte checked and no leak in sight."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benches.matrix import FIGURES
from benches.soak import drift, parse_duration
from tests.netns import require_root, require_tools

# Figures that describe proxy processes: `direct` has none, so they are null there.
PROXY_ONLY = {
    "cpu_s_per_gb",
    "rss_idle_mb",
    "rss_per_conn_kib",
    "rss_loaded_mb",
    "conn_cpu_us",
    "pss_per_worker_mb",
    "paced_vcpu",
    "paced_pss_mb",
}


def _bench(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "benches", *args], capture_output=True, text=True, timeout=timeout
    )


def _check_matrix(data: dict[str, Any]) -> list[str]:
    modes = [m["name"] for m in data["modes"]]
    expected = ["direct", "tcp", "hbone"] + (["stunnel"] if shutil.which("stunnel4") else [])
    assert modes == expected
    if "stunnel" not in modes:
        assert any("stunnel" in note for note in data["notes"])
    assert data["errors"] == []

    summary = data["summary"]
    counts = data["settings"]["worker_counts"]
    workers = {f"throughput_w{n}" for n in counts}
    if len(set(counts)) > 1:
        workers.add("pss_per_worker_mb")  # from the smallest and the largest count
    for mode in modes:
        for f in FIGURES:
            value = summary["value"][mode][f.key]
            measured = (
                (f.modes is None or mode in f.modes)
                and (
                    not (f.key.startswith("throughput_w") or f.key == "pss_per_worker_mb") or f.key in workers
                )
                and (not f.needs_tools or data["topology"] == "capture")
            )
            if not measured or (mode == "direct" and f.key in PROXY_ONLY):
                assert value is None, (mode, f.key, value)
                continue
            assert value is not None, (mode, f.key)
            # Memory growth over a few hundred held connections can be nothing at all: they may
            # fit in memory the allocator already holds. Every other figure is a positive amount.
            assert value >= 0 if f.key == "rss_per_conn_kib" else value > 0, (mode, f.key, value)
            if mode != "direct" and f.key not in PROXY_ONLY:
                assert summary["vs_direct"][mode][f.key] is not None, (mode, f.key)

    for mode in modes:
        [check] = data["integrity"][mode]  # one round
        assert check["ok"], mode
        assert check["sent_sha256"] == check["received_sha256"]
        assert len(check["sent_sha256"]) == data["settings"]["integrity_streams"]
        [held] = data["memory"][mode]
        assert held["held"] == data["settings"]["hold"]
    if "stunnel" in modes:
        # The anchor resumes its TLS sessions: most connections through it were resumed.
        counts = data["stunnel_handshakes"]
        assert counts["full"] >= 1 and counts["resumed"] > counts["full"], counts
        assert counts["connections"] == counts["full"] + counts["resumed"]
    targets = {t["target"]: t for t in data["targets"]}
    per_conn = next(t for name, t in targets.items() if "per idle connection" in name)
    assert per_conn["met"] is None and "10,000" in per_conn["note"], per_conn
    return modes


def test_quick_run_completes_every_mode_with_intact_bytes(tmp_path: Path) -> None:
    out = tmp_path / "results"
    run = _bench("--quick", "--out", str(out), timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "ratio to direct" in run.stdout  # the per-round table is printed

    data = json.loads((out / "latest.json").read_text())
    assert data["topology"] == "loopback"
    _check_matrix(data)


@pytest.mark.root
def test_capture_topology_runs_the_matrix_through_iptables_redirect(tmp_path: Path) -> None:
    require_root("iptables", "nsenter", "ip")
    require_tools("iperf3", "gcc", hint="apt-get install iperf3 gcc libc6-dev")
    out = tmp_path / "results"
    env_cache = tmp_path / "cache"
    args = ["--topology", "capture", "--quick", "--hold", "100", "--worker-counts", "1,2"]
    run = subprocess.run(
        [sys.executable, "-m", "benches", *args, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "XDG_CACHE_HOME": str(env_cache)},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    data = json.loads((out / "latest.json").read_text())
    assert data["topology"] == "capture"
    assert data["settings"]["worker_counts"] == [1, 2]
    _check_matrix(data)
    # The C tools were built into the cache dir the harness was given.
    assert any(p.name.startswith("tools-") for p in (env_cache / "ztunnel-bench").iterdir())
    # The applications dial the server's address; only the capture can have put the ztunnels on the
    # path, and a path that bypassed them would cost them next to no CPU per byte or connection.
    hbone = data["summary"]["value"]["hbone"]
    assert hbone["cpu_s_per_gb"] > 0.2, hbone
    assert hbone["conn_cpu_us"] > 20, hbone
    [cpu] = data["conn_cpu"]["hbone"]
    assert set(cpu["time_wait"]) == {"ztunnel-client", "ztunnel-server"}
    # The paced load reached its rate through every mode, and the proxies on the path carried it.
    s = data["settings"]
    for mode in data["summary"]["value"]:
        [paced] = data["paced"][mode]
        assert paced["reached"] and paced["errors"] == 0, (mode, paced)
        assert paced["count"] == pytest.approx(s["paced_rate"] * s["paced_seconds"], rel=0.01), (mode, paced)
        assert 0 < paced["p50_us"] <= paced["p90_us"] <= paced["p99_us"] <= paced["max_us"], (mode, paced)
        assert paced["connections"] == 4 and paced["size"] == 1024
    proxies = data["paced"]["hbone"][0]["proxies"]
    assert set(proxies) == {"ztunnel-client", "ztunnel-server"}
    for name, p in proxies.items():
        # 1,000 requests of 1 KB each way cost a Python proxy well over 1 % of a core.
        assert p["vcpu"] > 0.01 and p["pss_mb_samples"] and p["pss_mb_peak"] > 10, (name, p)
    assert data["summary"]["value"]["hbone"]["paced_vcpu"] == max(p["vcpu"] for p in proxies.values())
    assert cpu["connections"] > 3 and cpu["cpu_s"] > 0
    # Nothing of the run is left behind: the namespaces it names are gone.
    assert data["namespaces"]
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not set(data["namespaces"]) & {line.split()[0] for line in left.splitlines() if line}


def test_soak_holds_the_mix_with_every_byte_checked_and_no_leak(tmp_path: Path) -> None:
    tools = shutil.which("iperf3") and shutil.which("gcc")
    topology = "capture" if os.geteuid() == 0 and tools else "loopback"
    out = tmp_path / "results"
    run = _bench(
        "--topology",
        topology,
        "--soak",
        "60s",
        "--soak-interval",
        "10s",
        "--soak-concurrent",
        "2000",
        "--soak-idle",
        "200",
        "--out",
        str(out),
        timeout=240,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    data = json.loads((out / "latest-soak.json").read_text())
    assert data["topology"] == topology
    assert data["errors"] == []
    conc = data["concurrent"]
    assert conc["ok"] and conc["held"] == 2000
    assert conc["bytes_verified"] == 2 * 64 * 2000
    final = data["final"]
    assert final["errors"] == 0 and final["mismatched"] == 0
    assert final["stream_bytes"] > 0 and final["churn_connections"] > 100 and final["idle_probes"] > 20
    assert final["idle_held"] == 200
    assert len(data["samples"]) >= 6
    # Loose: a minute cannot judge ±5 %, but a leak per connection or a stuck fd per churn would
    # show far beyond these.
    d = data["drift"]
    assert abs(d["rss_pct"]) < 25, d
    assert d["fds"] < 50, d


def test_soak_durations_and_drift() -> None:
    assert parse_duration("90") == 90 and parse_duration("90s") == 90
    assert parse_duration("30m") == 1800 and parse_duration("1.5h") == 5400
    for bad in ("", "0", "-5s", "5d", "m"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_duration(bad)
    samples = [
        {"t_s": t, "rss_total_kib": rss, "fds_total": fds}
        for t, rss, fds in ((0, 500, 90), (10, 1000, 100), (20, 1100, 101), (30, 1050, 104))
    ]
    d = drift(samples, warmup=10)
    assert d["baseline_t_s"] == 10
    assert d["rss_pct"] == pytest.approx(5.0) and d["rss_max_pct"] == pytest.approx(10.0)
    assert d["fds"] == 4
    assert drift(samples[:2], warmup=10)["rss_pct"] is None


def test_profile_counts_system_calls_per_operation(tmp_path: Path) -> None:
    """`benches.profile --profiler strace` reads strace's own table: a process that makes 200
    writes of its own shows at least one write per operation of 200, and every call is counted."""
    from benches.profile import _operations, summarize_strace

    (strace,) = require_tools("strace", hint="apt-get install strace")
    table = tmp_path / "table.txt"
    program = "import os\nfor _ in range(200):\n    os.write(2, b'')\n"
    subprocess.run([strace, "-c", "-f", "-o", str(table), sys.executable, "-c", program], check=True)
    operations = _operations({"count": 200, "seconds": 1.0, "per_s": 200.0})
    assert operations == 200
    text = summarize_strace(table, 50, operations)
    rows = {line.split()[1]: line for line in text.splitlines()[1:]}
    assert "write" in rows and float(rows["write"].split("(")[1].split()[0]) >= 1.0, text
    total = int(text.split()[0])
    assert total == sum(int(line.split()[0]) for line in text.splitlines()[1:]), text
    assert "per operation" not in summarize_strace(table, 5, 0)
