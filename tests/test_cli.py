"""The command line as a user meets it: real processes, their output and exit codes."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.harness import Fleet

ZTUNNEL = [sys.executable, "-m", "ztunnel"]


def run(
    args: list[str], env: dict[str, str] | None = None, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    full_env = {
        k: v for k, v in os.environ.items() if not k.startswith(("PROXY_", "XDS_", "LOCAL_XDS", "FAKE_CA"))
    }
    full_env.update(env or {})
    return subprocess.run([*ZTUNNEL, *args], env=full_env, capture_output=True, text=True, timeout=timeout)


def dedicated(ip: str, **extra: str) -> dict[str, str]:
    env = {
        "PROXY_MODE": "dedicated",
        "PROXY_WORKLOAD_INFO": "demo/client/client-sa",
        "XDS_ADDRESS": "",
        "FAKE_CA": "true",
        "PROXY_BIND_ADDRESS": ip,
        "ADMIN_ADDRESS": f"{ip}:15000",
        "STATS_ADDRESS": f"{ip}:15020",
        "READINESS_ADDRESS": f"{ip}:15021",
    }
    env.update(extra)
    return env


def test_version() -> None:
    r = run(["version"])
    assert r.returncode == 0
    assert r.stdout.startswith("version.BuildInfo{")


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"PROXY_MODE": "sidecar"}, "invalid env var PROXY_MODE=sidecar"),
        (
            {"PROXY_MODE": "dedicated", "PROXY_WORKLOAD_INFO": "only-two/parts"},
            "invalid env var PROXY_WORKLOAD_INFO",
        ),
        ({"SECRET_TTL": "tomorrow"}, "invalid env var SECRET_TTL=tomorrow"),
        ({"UNSTABLE_ENABLE_SOCKS5": "maybe"}, "invalid env var UNSTABLE_ENABLE_SOCKS5=maybe"),
    ],
)
def test_invalid_environment_is_one_line_naming_the_variable(env: dict[str, str], expected: str) -> None:
    r = run(["proxy"], env)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert expected in lines[0]
    assert "Traceback" not in r.stderr


def test_broken_local_config_names_the_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("workloads:\n  - uid: x\n    namespace: demo\n    workloadIps: ['not-an-ip']\n")
    r = run(["proxy"], dedicated("127.0.0.1", LOCAL_XDS_PATH=str(bad)))
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "workloads[0].workloadIps[0]" in lines[0]
    assert "not-an-ip" in lines[0]


def test_unknown_subcommand_fails() -> None:
    r = run(["frobnicate"])
    assert r.returncode != 0
    assert "invalid choice" in r.stderr


def test_quitquitquit_drains_and_exits_zero(tmp_path: Path, fleet: Fleet) -> None:
    ip = f"127.{random.randint(16, 250)}.{random.randint(0, 250)}.5"
    config = tmp_path / "c.yaml"
    config.write_text(
        f"workloads:\n  - uid: u\n    name: client\n    namespace: demo\n    serviceAccount: client-sa\n"
        f"    workloadIps: ['{ip}']\n    protocol: HBONE\n"
    )
    proxy = fleet.proxy(dedicated(ip, LOCAL_XDS_PATH=str(config)))
    proxy.start(timeout=20)
    req = urllib.request.Request(f"http://{ip}:15000/quitquitquit", method="POST", data=b"")
    with urllib.request.urlopen(req, timeout=5) as r:
        assert (r.status, r.read()) == (200, b"shutdown now\n")
    assert proxy.wait_exit(15) == 0


def test_demo_runs_and_everything_behaves() -> None:
    r = subprocess.run([*ZTUNNEL, "demo"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "frontend" in r.stdout and "allowed" in r.stdout
    assert "denied (SOCKS5 reply 2)" in r.stdout
    assert "240.240.0.10" in r.stdout  # the DNS proxy answered the mesh-only name
    assert "everything behaved" in r.stdout
    # The rows a user reads, columns as printed (whitespace-separated).
    rows = {" ".join(line.split()) for line in r.stdout.splitlines()}
    assert (
        "frontend spiffe://cluster.local/ns/demo/sa/frontend 127.0.0.3:8080 allow allowed 1280/1280" in rows
    ), r.stdout
    assert (
        "intruder spiffe://cluster.local/ns/demo/sa/intruder 127.0.0.3:8080 deny denied (SOCKS5 reply 2) 0/0"
        in rows
    ), r.stdout
    assert "frontend opens a long-lived connection echoing" in rows, r.stdout
    assert "the open connection closed by the server's proxy" in rows, r.stdout
    assert "frontend tries again denied (SOCKS5 reply 2)" in rows, r.stdout
    assert "result: everything behaved" in rows, r.stdout
