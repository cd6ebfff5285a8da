"""The runtime reaches libraries only through their public API.

Read from the source of every runtime package (not the tests, not the benches, not protoc's
generated `xds/gen`): no private module or name of a library is imported, no private attribute of
a library's module or object is read or written, no private method of a library's class is
overridden, and no `getattr`-style call names a private attribute. "Private" is Python's
convention: one leading underscore, not a dunder. A library is anything that is not one of our
packages: the standard library included.
"""

from __future__ import annotations

import ast
import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
RUNTIME = ("hbone", "ztunnel", "xds", "mesh", "policy", "controlplane", "cni")
OURS = frozenset(RUNTIME)
# Underscored names the library documents as public API, each with where it does.
DOCUMENTED = {
    ("os", "_exit"): "os module docs: the exit of a child after fork",
    ("sys", "_current_frames"): "sys module docs (the sampling profiler)",
    ("logging", "_srcfile"): "the Logging HOWTO, 'Optimization': set to None to skip caller lookup",
}
# Attribute names known to be private state of libraries this project once reached into.
KNOWN_PRIVATE = frozenset(
    {
        "_sslobj",
        "_data_to_send",
        "_inbound_window_manager",
        "_decode_headers",
        "_headers_buffer",
        "_receive_frame",
        "_prepare_for_sending",
        "_receive_goaway_frame",
    }
)
REFLECTION = frozenset({"getattr", "hasattr", "setattr", "delattr"})


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _sources() -> list[pathlib.Path]:
    out = []
    for pkg in RUNTIME:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if "gen" not in path.relative_to(ROOT).parts:
                out.append(path)
    return out


class _Scan(ast.NodeVisitor):
    def __init__(self, where: str) -> None:
        self.where = where
        self.found: list[str] = []
        self.libs: dict[str, str] = {}  # local name -> the library module or object it is

    def _report(self, node: ast.AST, what: str) -> None:
        self.found.append(f"{self.where}:{getattr(node, 'lineno', '?')}: {what}")

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            top = alias.name.split(".")[0]
            if top in OURS:
                continue
            if any(_private(part) for part in alias.name.split(".")):
                self._report(node, f"imports private module {alias.name}")
            if alias.asname:  # `import a.b as c` binds c to a.b; `import a.b` binds a
                self.libs[alias.asname] = alias.name
            else:
                self.libs[top] = top

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        if node.level or module.split(".")[0] in OURS or module == "__future__":
            return
        if any(_private(part) for part in module.split(".")):
            self._report(node, f"imports from private module {module}")
        for alias in node.names:
            if _private(alias.name):
                self._report(node, f"imports private name {alias.name} from {module}")
            self.libs[alias.asname or alias.name] = f"{module}.{alias.name}"

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if _private(node.attr):
            root, path = node.value, []
            while isinstance(root, ast.Attribute):  # a dotted chain: `asyncio.events._x`
                path.append(root.attr)
                root = root.value
            if isinstance(root, ast.Name) and root.id in self.libs:
                owner = ".".join([self.libs[root.id], *reversed(path)])
                if (owner, node.attr) not in DOCUMENTED:
                    self._report(node, f"reads {owner}.{node.attr}")
            elif node.attr in KNOWN_PRIVATE:
                self._report(node, f"reads a library's private {node.attr}")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        fn = node.func
        if isinstance(fn, ast.Name) and fn.id in REFLECTION and len(node.args) >= 2:
            name = node.args[1]
            target = node.args[0]
            own = isinstance(target, ast.Name) and target.id in ("self", "cls")
            value = name.value if isinstance(name, ast.Constant) else None
            if isinstance(value, str) and _private(value) and not own:
                self._report(node, f"{fn.id}(..., {value!r})")
        self.generic_visit(node)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        bases = []
        for base in node.bases:
            dotted = ast.unparse(base)
            head, _, rest = dotted.partition(".")
            if head in self.libs:
                bases.append(self.libs[head] + ("." + rest if rest else ""))
        for qualified in bases:
            cls = _resolve(qualified)
            if cls is None:
                continue
            for item in node.body:
                if (
                    isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
                    and _private(item.name)
                    and hasattr(cls, item.name)
                ):
                    self._report(item, f"{node.name} overrides {qualified}.{item.name}")
        self.generic_visit(node)


def _resolve(qualified: str) -> object | None:
    parts = qualified.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr, None)
            if obj is None:
                return None
        return obj
    return None


def scan(source: str, where: str = "<source>") -> list[str]:
    visitor = _Scan(where)
    visitor.visit(ast.parse(source))
    return visitor.found


def test_the_runtime_uses_no_private_name_of_a_library() -> None:
    sources = _sources()
    assert len(sources) > 100  # the whole runtime was read
    found = [hit for path in sources for hit in scan(path.read_text(), str(path.relative_to(ROOT)))]
    assert found == []


@pytest.mark.parametrize(
    "source",
    [
        "import ssl\ndef peer(o):\n    return o._sslobj.get_verified_chain()\n",
        "from h2.connection import H2Connection\nclass S(H2Connection):\n    def _receive_frame(self, f): ...\n",
        "import h2.connection\nclass S(h2.connection.H2Connection):\n    def _open_streams(self, r): ...\n",
        "import asyncio\nasyncio.events._get_running_loop()\n",
        "from ssl import _create_unverified_context\n",
        "import asyncio.sslproto as _sp\nimport asyncio._x\n",
        "def f(t):\n    return getattr(t, '_ssl_protocol', None)\n",
    ],
)
def test_the_scan_catches_what_it_forbids(source: str) -> None:
    assert scan(source), source


def test_the_scan_lets_our_own_privates_and_documented_names_be() -> None:
    source = (
        "import os, sys, logging\nfrom hbone.tls import _joined\n"
        "class A:\n    def _x(self):\n        return getattr(self, '_y', None)\n"
        "os._exit(0)\nlogging._srcfile = None\nsys._current_frames()\n"
    )
    assert scan(source) == []
