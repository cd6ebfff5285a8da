"""A smell detector, not a cap: a module over 1,000 lines or a function over 150 (generated code aside)
holds more than one concern. Modules are sized by what they hold; this only catches the outliers.

A module is counted in lines as written; a function (or method) from its `def` to its last line,
decorators aside, nested functions counted in their own right and in the function holding them.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("ztunnel", "hbone", "xds", "mesh", "policy", "benches", "controlplane", "cni", "tests")
GENERATED = ("xds/gen/",)
MAX_MODULE_LINES = 1000
MAX_FUNCTION_LINES = 150

# Known exceptions, each naming why (none today). Nothing else may pass.
KNOWN_LONG_MODULES: dict[str, str] = {}
KNOWN_LONG_FUNCTIONS: dict[str, str] = {}


def _sources() -> list[tuple[str, str]]:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if not rel.startswith(GENERATED):
                found.append((rel, path.read_text(encoding="utf-8")))
    return found


def long_modules(sources: list[tuple[str, str]]) -> dict[str, int]:
    lengths = {rel: len(text.splitlines()) for rel, text in sources}
    return {rel: n for rel, n in lengths.items() if n > MAX_MODULE_LINES}


def long_functions(sources: list[tuple[str, str]]) -> dict[str, int]:
    found = {}
    for rel, text in sources:
        for node in ast.walk(ast.parse(text, rel)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                assert node.end_lineno is not None
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    found[f"{rel}:{node.name}"] = n
    return found


def test_no_module_over_1000_lines() -> None:
    long = long_modules(_sources())
    unexpected = {rel: n for rel, n in long.items() if rel not in KNOWN_LONG_MODULES}
    assert not unexpected, f"modules over {MAX_MODULE_LINES} lines (split them by concern): {unexpected}"


def test_no_function_over_150_lines() -> None:
    long = long_functions(_sources())
    unexpected = {name: n for name, n in long.items() if name not in KNOWN_LONG_FUNCTIONS}
    assert not unexpected, (
        f"functions over {MAX_FUNCTION_LINES} lines (cut them at their steps): {unexpected}"
    )


def test_every_known_exception_is_still_one() -> None:
    """An exception that the tree no longer needs goes from the lists, so it cannot hide a new one."""
    sources = _sources()
    stale = sorted(
        (set(KNOWN_LONG_MODULES) - set(long_modules(sources)))
        | (set(KNOWN_LONG_FUNCTIONS) - set(long_functions(sources)))
    )
    assert not stale, f"no longer over the limit, remove from the known exceptions: {stale}"


def test_the_measures_count_what_they_say() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    source = f"def long():\n{body}\n\n\ndef short():\n    pass\n"
    assert long_functions([("m.py", source)]) == {"m.py:long": MAX_FUNCTION_LINES + 1}
    assert long_modules([("m.py", "x = 1\n" * (MAX_MODULE_LINES + 1))]) == {"m.py": MAX_MODULE_LINES + 1}
    assert long_modules([("m.py", "x = 1\n" * MAX_MODULE_LINES)]) == {}
