"""The container image is built from the same package list as the wheel (no engine needed to check)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from tests.apps import loopback_net
from tests.harness import Fleet, proxy_env

ROOT = Path(__file__).resolve().parent.parent


def test_containerfile_copies_every_package_the_wheel_includes() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    copied = set(re.findall(r"^COPY (\w+) /src/\1$", (ROOT / "Containerfile").read_text(), re.MULTILINE))
    # The node image carries everything but the load-test harness.
    assert packages - {"benches"} == copied


def test_console_scripts_point_at_existing_functions() -> None:
    import importlib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert {"ztunnel", "ztunnel-bench", "ztunnel-cni"} <= set(scripts)
    for target in scripts.values():
        module, _, func = target.partition(":")
        assert callable(getattr(importlib.import_module(module), func)), target


async def test_a_dedicated_proxy_on_a_local_file_loads_neither_grpc_nor_protobuf(fleet: Fleet) -> None:
    # ~15 MB of idle RSS (benches: "idle RSS"): gRPC and protobuf load only for xDS, a CA or in-pod mode.
    # Their native extensions (gRPC's cygrpc, protobuf's upb) show in each process's memory map once
    # imported: none in the supervisor or a worker of a `ztunnel proxy`.
    ip = f"{loopback_net()}.2"
    [proxy] = await fleet.start(proxy_env(ip, "ns/a/sa", "workloads: []"))
    pids = proxy.pids()
    assert len(pids) >= 3, pids  # the supervisor, two workers
    loaded = set()
    for pid in pids:
        with open(f"/proc/{pid}/maps") as f:
            loaded |= {line.split()[-1] for line in f if "/grpc/" in line or "/google/_upb/" in line}
    assert loaded == set()


def test_the_project_cites_nothing_outside_its_repository() -> None:
    """A clone is all a reader has: no comment or document sends them to a file beside the repository."""
    import subprocess

    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    outside = re.compile(r"\b(?:SPEC|CONTRACT)(?:\.md)? ?§|\.\./shared\b|\b(?:SPEC|CONTRACT)\.md\b")
    found = []
    for name in tracked.split():
        path = ROOT / name
        if path.suffix not in {".py", ".md", ".sh", ".c", ".yaml", ".toml"} and path.name not in {
            "Makefile",
            "Containerfile",
        }:
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if outside.search(line) and "containernetworking/cni" not in line:
                found.append(f"{name}:{n}: {line.strip()}")
    assert not found, "\n".join(found)
