"""The `dns` figure runs: `python -m benches --dns` measures ztunnel's DNS proxy, dnsmasq and the
cacheless server with dnsperf, prints the table and writes its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.netns import require_tools


@pytest.mark.interop
def test_dns_figure(tmp_path: Path) -> None:
    require_tools("dnsmasq", "dnsperf", hint="Debian packages dnsmasq-base, dnsperf")
    done = subprocess.run(
        [sys.executable, "-m", "benches", "--dns", "--seconds", "0.5", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "x dnsmasq" in done.stdout and "goal >= 0.5x dnsmasq" in done.stdout
    data = json.loads((tmp_path / "dns-latest.json").read_text())
    assert set(data["qps"]) == {"dnsmasq", "ztunnel", "nocache"}
    assert all(v > 0 for v in data["qps"].values())
