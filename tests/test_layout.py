"""The package layout as an architecture: no import cycles between zerodp's modules (imports inside
functions and under ``TYPE_CHECKING`` included), the library never imports the application package
``zerodp.app``, every module says what it owns, and no source file outgrows one concept."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import zerodp

PACKAGE_DIR = Path(zerodp.__file__).parent
APP = "zerodp.app"
MAX_LINES = 600


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE_DIR.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}


def resolve(importer: str, is_package: bool, level: int, target: str | None) -> str:
    """Absolute name of a (possibly relative) ``from ... import`` target."""
    if level == 0:
        return target or ""
    base = importer.split(".")
    if not is_package:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """zerodp modules that ``name`` imports anywhere in its source. ``from pkg import x`` is an edge to
    ``pkg.x`` when that is a module, else to ``pkg`` (whose ``__init__`` defines ``x``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("zerodp"):
                    out.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = resolve(name, path.name == "__init__.py", node.level, node.module)
            if not base.startswith("zerodp"):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if sub in modules else base)
    return {m for m in out if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path ``[a, b, ..., a]``, or None (iterative three-colour DFS)."""
    colour = {n: 0 for n in graph}  # 0 unvisited, 1 on the current path, 2 done
    for root in sorted(graph):
        if colour[root]:
            continue
        stack = [(root, iter(sorted(graph[root])))]
        path = [root]
        colour[root] = 1
        while stack:
            node, edges = stack[-1]
            nxt = next(edges, None)
            if nxt is None:
                colour[node] = 2
                stack.pop()
                path.pop()
            elif colour[nxt] == 1:
                return path[path.index(nxt):] + [nxt]
            elif colour[nxt] == 0:
                colour[nxt] = 1
                path.append(nxt)
                stack.append((nxt, iter(sorted(graph[nxt]))))
    return None


def test_import_graph_sees_real_edges():
    graph = import_graph()
    assert "zerodp.engine" in graph and "zerodp.app.cli" in graph
    # a function-level and a TYPE_CHECKING-free top-level import are both seen
    assert "zerodp.runtime.comm" in graph["zerodp.engine"]
    assert "zerodp.app.train" in graph["zerodp.app.cli"]


def test_find_cycle_detects_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    assert find_cycle({"a": {"a"}}) == ["a", "a"]


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_library_never_imports_the_application():
    offenders = {m: sorted(d for d in deps if d == APP or d.startswith(APP + "."))
                 for m, deps in import_graph().items() if not (m == APP or m.startswith(APP + "."))}
    offenders = {m: d for m, d in offenders.items() if d}
    assert not offenders, f"library modules importing {APP}: {offenders}"


@pytest.mark.parametrize("name", sorted(all_modules()))
def test_module_has_docstring_and_fits_one_concept(name):
    path = all_modules()[name]
    source = path.read_text()
    assert ast.get_docstring(ast.parse(source)), f"{path} has no module docstring saying what it owns"
    lines = source.count("\n")
    assert lines <= MAX_LINES, f"{path} has {lines} lines (> {MAX_LINES}): split it by concept"
