"""Which build of HBONE's hot path runs: mypyc's extension modules, or the same modules' Python source.

`setup.py` compiles the modules of `HOT_PATH` when it can (see docs/compiled.md) and writes
`_compiled.json` beside them: the SHA-256 of each source it compiled. At the package's import,
`guard()` makes the whole set run from its Python source (a finder placed first on `sys.meta_path`)
when an extension module would not run what the source says:

* a compiled source was edited since the build (an editable install after a `git pull` or an edit:
  a message on stderr says so, and `make` rebuilds);
* `ZTUNNEL_BUILD=pure` in the environment (the pure build tested, or compared, from a compiled tree).

All or nothing: the compiled modules call one another natively, so one module from source beside
its compiled neighbours would still run their stale code. Standard library only; never compiled.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
from pathlib import Path
from types import ModuleType

# In dependency order. setup.py reads this list (keep it a literal).
HOT_PATH = (
    "hbone.h2core.codes",
    "hbone.h2core.events",
    "hbone.h2core.fields",
    "hbone.h2core.frames",
    "hbone.h2core.streams",
    "hbone.h2core.connection",
    "hbone.hpack",
    "hbone.stream",
    "hbone.relay",
    "hbone.h2conn",
    "hbone.tlsio",
    "hbone.engine",
)
MANIFEST = Path(__file__).with_name("_compiled.json")
_ROOT = Path(__file__).parent.parent


def source_of(module: str) -> Path:
    return _ROOT.joinpath(*module.split(".")).with_suffix(".py")


def extension_of(module: str) -> Path | None:
    base = source_of(module).with_suffix("")
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = base.parent / (base.name + suffix)
        if candidate.exists():
            return candidate
    return None


def _digest(path: Path) -> str:
    import hashlib  # here: a pure install never needs it

    return hashlib.sha256(path.read_bytes()).hexdigest()


def stale_reason() -> str | None:
    """Why the extension modules present must not run, or None when they match their sources."""
    if os.environ.get("ZTUNNEL_BUILD", "").strip().lower() == "pure":
        return "ZTUNNEL_BUILD=pure"
    import json

    try:
        recorded = json.loads(MANIFEST.read_text())["modules"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{MANIFEST.name} is missing or unreadable (not built by setup.py?)"
    edited = []
    for module in HOT_PATH:
        try:
            if recorded.get(module) != _digest(source_of(module)) or extension_of(module) is None:
                edited.append(module)
        except OSError:
            edited.append(module)
    if edited:
        return "edited since the compiled build: " + ", ".join(edited)
    return None


class _SourceFinder:
    """Finds the hot path's modules as Python source, ahead of the extension modules beside them."""

    def find_spec(
        self, fullname: str, path: object = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in HOT_PATH:
            return None
        import importlib.util

        return importlib.util.spec_from_file_location(fullname, source_of(fullname))


_blocked: str | None = None


def guard() -> None:
    """Run the hot path from source when its extension modules are stale (once per process)."""
    global _blocked
    if _blocked is not None or not any(extension_of(m) for m in HOT_PATH):
        return
    reason = stale_reason()
    if reason is None:
        return
    _blocked = reason
    sys.meta_path.insert(0, _SourceFinder())
    if not reason.startswith("ZTUNNEL_BUILD"):
        print(
            f"hbone: running the pure Python hot path, not its compiled modules: {reason} "
            "(`make` or `pip install -e .` rebuilds them)",
            file=sys.stderr,
        )


def describe() -> dict[str, str | int]:
    """The build that runs, from the files of the hot path's modules: those loaded, else those that
    would load (nothing is imported here)."""
    compiled = 0
    for module in HOT_PATH:
        loaded = sys.modules.get(module)
        if loaded is not None:
            origin = getattr(loaded, "__file__", None) or ""
            compiled += origin.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))
        elif _blocked is None and extension_of(module) is not None:
            compiled += 1
    info: dict[str, str | int] = {"modules": len(HOT_PATH), "compiled": compiled}
    if compiled == len(HOT_PATH):
        info["build"] = "compiled"
        info["compiler"] = "mypyc"
    elif compiled == 0:
        info["build"] = "pure-python"
    else:
        info["build"] = "mixed"
    if _blocked is not None:
        info["reason"] = _blocked
    return info


def summary() -> str:
    """One line: `compiled (mypyc, N modules)`, or `pure-python` (with why, when compiled ones exist)."""
    info = describe()
    if info["build"] == "compiled":
        return f"compiled ({info['compiler']}, {info['compiled']} modules)"
    if info["build"] == "mixed":
        return f"mixed ({info['compiled']} of {info['modules']} modules compiled)"
    return "pure-python" + (f" ({info['reason']})" if "reason" in info else "")
