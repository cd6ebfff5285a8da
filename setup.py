"""The build: HBONE's hot path compiled by mypyc from the same Python source, or pure Python.

Everything else of the project's packaging is in pyproject.toml; this file only adds the compiled
extension modules. `ZTUNNEL_BUILD` at install time chooses:

* `auto` (the default): compiled when a C compiler and the Python headers are found, else pure
  Python with a message (shown by `pip install -v`; `ztunnel version` tells afterwards);
* `compiled`: compiled, or the install fails naming what is missing (the Makefile and the image);
* `pure`: pure Python, no compiler needed.

A compiled build also writes `hbone/_compiled.json`, the SHA-256 of each compiled module's source:
`hbone.build` compares it at import and runs the pure Python source of the whole set when any of
them was edited since (an editable install never runs a stale extension module).
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import shutil
import sys
import sysconfig
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext


def hot_path() -> list[str]:
    """The compiled modules' source files, from hbone/build.py's HOT_PATH (the one list)."""
    tree = ast.parse(Path("hbone/build.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "HOT_PATH" for t in node.targets):
            return [m.replace(".", "/") + ".py" for m in ast.literal_eval(node.value)]
    raise SystemExit("ztunnel build: no HOT_PATH in hbone/build.py")


HOT_PATH = hot_path()
MANIFEST = "hbone/_compiled.json"
CHOICES = ("auto", "compiled", "pure")


def say(message: str) -> None:
    print(f"ztunnel build: {message}", file=sys.stderr)


def missing_toolchain() -> list[str]:
    """What a mypyc build lacks here: the C compiler Python was built with, and Python.h."""
    missing = []
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(os.environ.get("CC", cc).split()[0]) is None:
        missing.append(f"a C compiler ({cc}; Debian: gcc libc6-dev)")
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").exists():
        missing.append(f"the Python headers ({include}/Python.h; Debian's python3: python3-dev)")
    return missing


def choose() -> str:
    choice = os.environ.get("ZTUNNEL_BUILD", "auto").strip().lower() or "auto"
    if choice not in CHOICES:
        raise SystemExit(f"ztunnel build: ZTUNNEL_BUILD={choice!r}: expected one of {', '.join(CHOICES)}")
    if choice == "pure":
        say("pure Python (ZTUNNEL_BUILD=pure)")
        return "pure"
    missing = missing_toolchain()
    if not missing:
        return "compiled"
    if choice == "compiled":
        raise SystemExit(
            "ztunnel build: ZTUNNEL_BUILD=compiled but this machine lacks "
            + " and ".join(missing)
            + "; install them, or build pure Python with ZTUNNEL_BUILD=pure"
        )
    say("pure Python: no compiled hot path, this machine lacks " + " and ".join(missing))
    return "pure"


def digest(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


class BuildWithManifest(build_ext):
    """build_ext that also writes the compiled set's source digests beside the extension modules."""

    def run(self) -> None:
        super().run()
        # get_ext_fullpath follows --inplace (editable installs) and the build directory alike.
        target = Path(self.get_ext_fullpath("hbone.relay")).parent.parent / MANIFEST
        import mypy.version

        manifest = {
            "compiler": "mypyc",
            "mypy": mypy.version.__version__,
            "modules": {p[:-3].replace("/", "."): digest(p) for p in HOT_PATH},
        }
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


def extensions() -> list:
    if choose() == "pure":
        if Path(MANIFEST).exists():
            say(
                "this tree keeps the compiled modules of an earlier build; they load unless "
                "ZTUNNEL_BUILD=pure is set at run time (`make clean` removes them)"
            )
        return []
    from mypyc.build import mypycify

    say(f"compiling {len(HOT_PATH)} modules with mypyc")
    return mypycify(HOT_PATH, opt_level="3", group_name="hbone")


ext_modules = extensions()
setup(ext_modules=ext_modules, cmdclass={"build_ext": BuildWithManifest} if ext_modules else {})
