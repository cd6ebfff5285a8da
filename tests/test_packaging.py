"""The container image is built from the same package list as the wheel (no engine needed to check)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_containerfile_copies_every_package_the_wheel_includes() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    copied = set(re.findall(r"^COPY (\w+) \1$", (ROOT / "Containerfile").read_text(), re.MULTILINE))
    assert packages == copied


def test_console_scripts_point_at_existing_functions() -> None:
    import importlib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert {"ztunnel", "ztunnel-bench", "ztunnel-cni"} <= set(scripts)
    for target in scripts.values():
        module, _, func = target.partition(":")
        assert callable(getattr(importlib.import_module(module), func)), target
