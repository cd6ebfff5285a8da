"""The load-test harness, as a user runs it: `python -m benches --quick` completes every mode, writes
every figure to its JSON, and the bytes sent through each mode come back intact."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from benches.matrix import FIGURE_KEYS

# Figures that describe proxy processes: `direct` has none, so they are null there.
PROXY_ONLY = {"cpu_s_per_gb", "rss_idle_mb", "rss_per_conn_kib", "rss_loaded_mb"}


def test_quick_run_completes_every_mode_with_intact_bytes(tmp_path: Path) -> None:
    out = tmp_path / "results"
    run = subprocess.run(
        [sys.executable, "-m", "benches", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "ratio to direct" in run.stdout  # the per-round table is printed

    data = json.loads((out / "latest.json").read_text())
    modes = [m["name"] for m in data["modes"]]
    expected = ["direct", "tcp", "hbone"] + (["stunnel"] if shutil.which("stunnel4") else [])
    assert modes == expected
    if "stunnel" not in modes:
        assert any("stunnel" in note for note in data["notes"])
    assert data["errors"] == []

    summary = data["summary"]
    for mode in modes:
        for key in FIGURE_KEYS:
            value = summary["value"][mode][key]
            if mode == "direct" and key in PROXY_ONLY:
                assert value is None
            else:
                assert value is not None and value > 0, (mode, key, value)
            if mode != "direct" and key not in PROXY_ONLY:
                assert summary["vs_direct"][mode][key] is not None, (mode, key)

    for mode in modes:
        [check] = data["integrity"][mode]  # one round
        assert check["ok"], mode
        assert check["sent_sha256"] == check["received_sha256"]
        assert len(check["sent_sha256"]) == data["settings"]["integrity_streams"]
        [held] = data["memory"][mode]
        assert held["held"] == data["settings"]["hold"]
