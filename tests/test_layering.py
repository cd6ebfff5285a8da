"""The imports of the tree: no cycle anywhere, and none against the rules ARCHITECTURE.md states.

Every module's source is read with `ast`, and every import in it counts: at the top, inside a
function, under `TYPE_CHECKING`. Each is resolved to the project module it names (`from a.b import
c` is `a.b.c` when that is a module, else `a.b`); an import of a module does not count as one of
its parent packages (a package's `__init__` re-exporting its modules is no cycle). The rules are the
`imports` block of ARCHITECTURE.md, read here, so the page and the test cannot disagree.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("hbone", "policy", "mesh", "xds", "ztunnel", "cni", "controlplane", "benches", "tests")


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the tree by its dotted name (a package by its own name)."""
    modules: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _resolve(name: str, modules: Mapping[str, Path]) -> str | None:
    """The longest prefix of dotted `name` that is a project module."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def imports_of(module: str, path: Path, modules: Mapping[str, Path]) -> set[str]:
    """The project modules `module` imports, wherever in its source the import statement is."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _resolve(alias.name, modules)
                if target is not None:
                    found.add(target)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                target = _resolve(f"{base}.{alias.name}", modules)
                if target is not None:
                    found.add(target)
    found.discard(module)
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = project_modules(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def _components(graph: Mapping[str, Iterable[str]]) -> list[set[str]]:
    """The strongly connected components of `graph` (Kosaraju, without recursion)."""
    order: list[str] = []
    seen: set[str] = set()
    for start in sorted(graph):
        if start in seen:
            continue
        seen.add(start)
        stack = [(start, iter(sorted(graph[start])))]
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                order.append(node)
                stack.pop()
            elif child in graph and child not in seen:
                seen.add(child)
                stack.append((child, iter(sorted(graph[child]))))
    reverse: dict[str, set[str]] = {node: set() for node in graph}
    for node, imported in graph.items():
        for child in imported:
            if child in reverse:
                reverse[child].add(node)
    components: list[set[str]] = []
    assigned: set[str] = set()
    for root in reversed(order):
        if root in assigned:
            continue
        component: set[str] = set()
        todo = [root]
        while todo:
            node = todo.pop()
            if node not in assigned:
                assigned.add(node)
                component.add(node)
                todo.extend(reverse[node] - assigned)
        components.append(component)
    return components


def find_cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """One shortest import cycle per tangle of modules (the first module repeated at the end)."""
    cycles = []
    for component in _components(graph):
        start = min(component)
        if len(component) == 1 and start not in graph[start]:
            continue
        # Breadth first from `start` back to it, inside the component.
        came_from: dict[str, str] = {}
        frontier = [start]
        while start not in came_from:
            following = []
            for node in frontier:
                for child in sorted(graph[node]):
                    if child in component and child not in came_from:
                        came_from[child] = node
                        following.append(child)
            frontier = following
        path = [start]
        while (node := came_from[path[-1]]) != start:
            path.append(node)
        cycles.append([start, *reversed(path)])
    return sorted(cycles)


# -- the rules -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """`subject: allowed ... !refused ...`: what the modules under `subject` may import;
    `subject <- allowed ...`: which modules may import those under `subject`."""

    subject: str
    allowed: tuple[str, ...]
    refused: tuple[str, ...] = ()
    importers: bool = False  # a `<-` rule


def _under(module: str, prefix: str) -> bool:
    return prefix == "*" or module == prefix or module.startswith(prefix + ".")


def parse_rules(text: str) -> list[Rule]:
    """The rules of the first ```imports block of `text`."""
    block = re.search(r"^```imports\n(.*?)^```", text, re.S | re.M)
    if block is None:
        raise ValueError("no ```imports block")
    rules = []
    for line in block.group(1).splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([\w.]+)\s*(:|<-)(.*)", line)
        if match is None:
            raise ValueError(f"neither `modules: allowed ...` nor `modules <- importers ...`: {line!r}")
        subject, kind, rest = match.groups()
        words = rest.split()
        rules.append(
            Rule(
                subject,
                tuple(w for w in words if not w.startswith("!") and w != "-"),
                tuple(w[1:] for w in words if w.startswith("!")),
                importers=kind == "<-",
            )
        )
    return rules


def rule_for(module: str, rules: Iterable[Rule], *, importers: bool = False) -> Rule | None:
    """The most specific rule of its kind whose subject covers `module`."""
    applying = [r for r in rules if r.importers is importers and _under(module, r.subject)]
    return max(applying, key=lambda r: len(r.subject), default=None)


def violations(graph: Mapping[str, Iterable[str]], rules: list[Rule]) -> list[str]:
    """Every import against the rules, as `importer -> imported (why)`."""
    found = []
    for module in sorted(graph):
        rule = rule_for(module, rules)
        for target in sorted(graph[module]):
            if rule is None:
                found.append(f"{module} -> {target} (no rule says what {module} may import)")
            elif any(_under(target, r) for r in rule.refused) or not any(
                _under(target, a) for a in rule.allowed
            ):
                found.append(f"{module} -> {target} (against `{rule.subject}:`)")
            guard = rule_for(target, rules, importers=True)
            if guard is not None and not any(_under(module, a) for a in guard.allowed):
                found.append(f"{module} -> {target} (against `{guard.subject} <-`)")
    return found


def architecture_rules() -> list[Rule]:
    return parse_rules((ROOT / "ARCHITECTURE.md").read_text())


# -- the tests --------------------------------------------------------------------------------------


@functools.cache
def tree_graph() -> dict[str, set[str]]:
    return import_graph()


def test_no_import_cycle() -> None:
    cycles = find_cycles(tree_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_imports_follow_architecture() -> None:
    bad = violations(tree_graph(), architecture_rules())
    assert not bad, "imports against ARCHITECTURE.md:\n" + "\n".join(bad)


def test_every_rule_names_modules_of_the_tree() -> None:
    """A rule naming a module that does not exist (a rename) would silently allow nothing."""
    modules = project_modules()
    for rule in architecture_rules():
        for name in (rule.subject, *rule.allowed, *rule.refused):
            assert name == "*" or any(_under(m, name) for m in modules), f"no module {name}"


def _tree(tmp_path: Path, files: Mapping[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_a_planted_cycle_is_found_through_a_function_and_type_checking(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "ztunnel/__init__.py": "",
            "ztunnel/a.py": "def f():\n    from ztunnel import b\n",
            "ztunnel/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import X\n",
            "ztunnel/c.py": "import ztunnel.a.sub\nX = 1\n",
            "hbone/__init__.py": "",
        },
    )
    graph = import_graph(root)
    assert graph["ztunnel.c"] == {"ztunnel.a"}  # `ztunnel.a.sub` is no module: its longest prefix is
    assert find_cycles(graph) == [["ztunnel.a", "ztunnel.b", "ztunnel.c", "ztunnel.a"]]
    graph["ztunnel.c"].clear()
    assert find_cycles(graph) == []


def test_a_package_reexporting_its_modules_is_no_cycle(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "ztunnel/__init__.py": "",
            "ztunnel/dns/__init__.py": "from ztunnel.dns.server import S\n",
            "ztunnel/dns/server.py": "from ztunnel.dns.resolver import R\n",
            "ztunnel/dns/resolver.py": "",
        },
    )
    assert find_cycles(import_graph(root)) == []


RULES = """
```imports
hbone: hbone                          # nothing but itself
policy: -                             # nothing at all
ztunnel: hbone ztunnel !ztunnel.cli
ztunnel.cli: *
ztunnel.proxy.outbound <- ztunnel.proxy.instance
```
"""


@pytest.mark.parametrize(
    ("importer", "imported", "allowed"),
    [
        ("hbone.tls", "hbone.identity", True),
        ("hbone.tls", "mesh.model", False),
        ("policy.rbac", "policy.model", False),  # "-": not even itself
        ("ztunnel.start", "hbone.tls", True),
        ("ztunnel.start", "ztunnel.cli", False),  # refused by "!"
        ("ztunnel.cli", "cni.agent", True),  # the more specific rule wins
        ("cni.agent", "xds", False),  # no rule covers cni
        ("ztunnel.proxy.instance", "ztunnel.proxy.outbound", True),
        ("ztunnel.proxy.inbound", "ztunnel.proxy.outbound", False),  # only the instance may
    ],
)
def test_rules_read_as_written(importer: str, imported: str, allowed: bool) -> None:
    found = violations({importer: {imported}}, parse_rules(RULES))
    assert (found == []) is allowed, found


def test_ztunnel_root_holds_only_entry_points_and_wiring() -> None:
    """`ztunnel/` is grouped by concern: at its root at most 12 modules (the entry points and the
    wiring), every other module in the package of its concern."""
    root_modules = sorted(p.name for p in (ROOT / "ztunnel").glob("*.py"))
    assert len(root_modules) <= 12, root_modules
