"""What a test needs to run as root or with tools installed (skipped without, failed under CI=true),
and the network namespaces it makes (`benches.netns`: hosts joined by veth pairs, commands run
inside)."""

from __future__ import annotations

import os
import shutil
from typing import NoReturn

import pytest

from benches.netns import Netns, NetnsError, link

__all__ = ["Netns", "NetnsError", "cannot_run", "link", "require_root", "require_tools"]


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
