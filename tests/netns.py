"""Network namespaces made by the tests (root only): hosts joined by veth pairs, commands run inside."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Sequence
from typing import NoReturn

import pytest


def cannot_run(reason: str) -> NoReturn:
    """Skip the test; under CI=true (any case), fail instead: CI must run every test."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true but this test cannot run: {reason}")
    pytest.skip(reason)


def require_root(*tools: str) -> None:
    """Skip when not root (or a tool is missing); under CI=true, fail instead of skipping."""
    problems = []
    if os.geteuid() != 0:
        problems.append("needs root")
    problems += [f"needs {t}" for t in tools if shutil.which(t) is None]
    if problems:
        cannot_run(", ".join(problems))


def require_tools(*tools: str, hint: str = "") -> list[str]:
    """The tools' paths (names looked up on PATH, or absolute paths); when one is missing, skip, or
    under CI=true fail. `hint` says where to get them (a package name)."""
    paths = [shutil.which(t) for t in tools]
    missing = [t for t, p in zip(tools, paths, strict=True) if p is None]
    if missing:
        cannot_run(f"not installed: {', '.join(missing)}" + (f" ({hint})" if hint else ""))
    return [p for p in paths if p is not None]


def run(*args: str, check: bool = True, input: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(args, check=check, capture_output=True, input=input, timeout=30)


class Netns:
    def __init__(self, prefix: str) -> None:
        self.name = f"{prefix}-{uuid.uuid4().hex[:6]}"
        run("ip", "netns", "add", self.name)
        self.exec("ip", "link", "set", "lo", "up")

    def exec(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[bytes]:
        return run("ip", "netns", "exec", self.name, *args, check=check)

    def popen(self, args: Sequence[str], env: dict[str, str], log_path: str) -> subprocess.Popen[bytes]:
        with open(log_path, "wb") as log:
            return subprocess.Popen(
                ["ip", "netns", "exec", self.name, *args], env=env, stdout=log, stderr=subprocess.STDOUT
            )

    def delete(self) -> None:
        run("ip", "netns", "del", self.name, check=False)


def link(a: Netns, a_ip: str, b: Netns, b_ip: str, prefix_len: int = 24) -> None:
    """A veth pair between two namespaces, with an address on each end."""
    tag = uuid.uuid4().hex[:6]
    va, vb = f"va{tag}", f"vb{tag}"
    run("ip", "link", "add", va, "type", "veth", "peer", "name", vb)
    run("ip", "link", "set", va, "netns", a.name)
    run("ip", "link", "set", vb, "netns", b.name)
    for ns, dev, ip in ((a, va, a_ip), (b, vb, b_ip)):
        ns.exec("ip", "addr", "add", f"{ip}/{prefix_len}", "dev", dev)
        ns.exec("ip", "link", "set", dev, "up")
