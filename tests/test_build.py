"""The two builds of HBONE's hot path: which one runs is what `ztunnel version` says, a stale compiled
module never runs, and the install-time choice fails or falls back as documented (docs/compiled.md)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hbone import build

ROOT = Path(__file__).resolve().parent.parent
COMPILED_HERE = (ROOT / "hbone" / "_compiled.json").exists() and build.extension_of("hbone.relay") is not None
FILES = "import importlib, sys; [print(importlib.import_module(m).__file__) for m in sys.argv[1:]]"


def run(args: list[str], *, cwd: Path = ROOT, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k != "ZTUNNEL_BUILD"} | env
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=full, capture_output=True, text=True, timeout=60, check=True
    )


def build_line(**env: str) -> str:
    lines = run(["-m", "ztunnel", "version"], **env).stdout.splitlines()
    [line] = [x for x in lines if x.startswith("build: ")]
    return line.removeprefix("build: ")


def loaded_files(**env: str) -> list[str]:
    return run(["-c", FILES, *build.HOT_PATH], **env).stdout.split()


def test_version_names_the_build_its_modules_were_loaded_from() -> None:
    files = loaded_files()
    if all(f.endswith(".so") for f in files):
        assert build_line() == f"compiled (mypyc, {len(build.HOT_PATH)} modules)"
    else:
        assert all(f.endswith(".py") for f in files), files
        assert build_line() == "pure-python"
    if COMPILED_HERE and os.environ.get("ZTUNNEL_BUILD") != "pure":
        # `make test` builds the compiled one: the suite runs on it.
        assert build_line().startswith("compiled"), files


def test_the_build_under_test_is_the_one_asked_for() -> None:
    expected = "pure-python" if os.environ.get("ZTUNNEL_BUILD") == "pure" or not COMPILED_HERE else "compiled"
    assert build.summary().startswith(expected)


def test_pure_at_run_time_loads_every_module_from_source() -> None:
    files = loaded_files(ZTUNNEL_BUILD="pure")
    assert [Path(f).suffix for f in files] == [".py"] * len(build.HOT_PATH)
    assert build_line(ZTUNNEL_BUILD="pure").startswith("pure-python")


@pytest.mark.skipif(not COMPILED_HERE, reason="no compiled build in this tree (ZTUNNEL_BUILD=pure install)")
def test_an_edited_source_runs_as_source_not_as_its_stale_extension(tmp_path: Path) -> None:
    # A copy of the compiled tree (extension modules, shared library, manifest); one source edited.
    shutil.copytree(ROOT / "hbone", tmp_path / "hbone", ignore=shutil.ignore_patterns("__pycache__"))
    for lib in ROOT.glob("hbone__mypyc.*"):
        shutil.copy(lib, tmp_path)
    relay = tmp_path / "hbone" / "relay.py"
    relay.write_text(relay.read_text() + "\nEDITED = True\n")
    env = {"PYTHONPATH": str(tmp_path)}
    check = "import hbone.relay, hbone.h2conn, hbone.build as b; print(hbone.relay.EDITED, b.summary())"
    r = run(["-c", check], cwd=tmp_path, **env)
    assert r.stdout.split()[0] == "True"
    assert "pure-python (edited since the compiled build: hbone.relay)" in r.stdout
    assert "edited since the compiled build: hbone.relay" in r.stderr
    # All or nothing: the unedited neighbours load from source too.
    files = run(["-c", FILES, *build.HOT_PATH], cwd=tmp_path, **env).stdout.split()
    assert files == [str(build.source_of(m)).replace(str(ROOT), str(tmp_path)) for m in build.HOT_PATH]
    # The manifest is what it compares: unedited, the copy runs compiled.
    relay.write_text((ROOT / "hbone" / "relay.py").read_text())
    assert run(["-c", check.replace("hbone.relay.EDITED, ", "")], cwd=tmp_path, **env).stdout.startswith(
        "compiled"
    )


def test_the_manifest_names_the_compiled_modules() -> None:
    if not COMPILED_HERE:
        pytest.skip("no compiled build in this tree")
    manifest = json.loads((ROOT / "hbone" / "_compiled.json").read_text())
    assert manifest["compiler"] == "mypyc"
    assert sorted(manifest["modules"]) == sorted(build.HOT_PATH)


def setup_py(**env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k != "ZTUNNEL_BUILD"} | env
    return subprocess.run(
        [sys.executable, "setup.py", "--name"], cwd=ROOT, env=full, capture_output=True, text=True, timeout=60
    )


def test_install_time_choice_without_a_compiler() -> None:
    # `--name` runs the choice (and no compiler): what pip's build would decide on this machine.
    no_cc = "/nonexistent/cc"
    strict = setup_py(ZTUNNEL_BUILD="compiled", CC=no_cc)
    assert strict.returncode != 0
    assert "ZTUNNEL_BUILD=compiled but this machine lacks a C compiler" in strict.stderr
    assert "ZTUNNEL_BUILD=pure" in strict.stderr
    fallback = setup_py(CC=no_cc)  # auto: pure, with a message
    assert fallback.returncode == 0, fallback.stderr
    assert fallback.stdout.strip() == "ztunnel-py"
    assert "pure Python: no compiled hot path, this machine lacks a C compiler" in fallback.stderr
    pure = setup_py(ZTUNNEL_BUILD="pure", CC=no_cc)
    assert pure.returncode == 0 and "pure Python (ZTUNNEL_BUILD=pure)" in pure.stderr
    bad = setup_py(ZTUNNEL_BUILD="fast")
    assert bad.returncode != 0 and "ZTUNNEL_BUILD='fast': expected one of auto, compiled, pure" in bad.stderr


def test_the_pure_wheel_holds_no_extension_module(tmp_path: Path) -> None:
    # What `ZTUNNEL_BUILD=pure pip install .` installs (no build isolation: the venv has setuptools).
    env = {k: v for k, v in os.environ.items() if k != "ZTUNNEL_BUILD"} | {"ZTUNNEL_BUILD": "pure"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            ".",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    [wheel] = tmp_path.glob("*.whl")
    assert wheel.name.endswith("-py3-none-any.whl")
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    assert "hbone/build.py" in names and "hbone/relay.py" in names
    assert not [n for n in names if n.endswith(".so") or n.endswith("_compiled.json")]
