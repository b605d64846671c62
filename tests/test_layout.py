"""The package layout as an architecture: no import cycles between zerodp's modules (imports inside
functions and under ``TYPE_CHECKING`` included), imports point down the package ranks
(config < runtime < stage3 < offload < checkpoint < engine < deepspeed < app), the library never imports
the application package ``zerodp.app``, every module says what it owns, and no source file outgrows one
concept."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import zerodp

PACKAGE_DIR = Path(zerodp.__file__).parent
APP = "zerodp.app"
MAX_LINES = 500
MAX_FUNCTION_LINES = 60  # a function or method of the library (zerodp.app excluded), decorators not counted

#: files still above MAX_LINES, each with the concepts it still mixes; none may pass HARD_MAX_LINES,
#: and a file that drops under MAX_LINES must leave this list (test_over_length_allow_list_is_current)
OVER_MAX_LINES: dict[str, str] = {}
HARD_MAX_LINES = 600

#: library functions still above MAX_FUNCTION_LINES (qualified name -> why), to be split
LONG_FUNCTIONS: dict[str, str] = {}

#: The package ranks, lowest first. A module may import modules of its own rank or a lower one, never a
#: higher one (imports inside functions and under ``TYPE_CHECKING`` included); a dependency that must
#: point up is inverted by a ``Protocol`` defined in the lower module and implemented above it.
#:
#: - ``config``: the validated configuration (``zerodp.config``, its strict base ``zerodp.config_base``,
#:   its sections ``zerodp.config_batch`` and ``zerodp.config_optimizer``, its key tables
#:   ``zerodp.config_keys``, and the offload sections' schema ``zerodp.offload.config``, which
#:   ``zerodp.config`` embeds). Every
#:   layer reads its settings from these, so they sit below everything and import no other layer.
#: - ``engine``: the engine and the top-level modules that sit with it and make up the library's
#:   public face (``zerodp.initialize``, ``zerodp.zero``, the safe accessors, tiling, activation
#:   checkpointing); each is named explicitly below, so a new top-level module must be placed.
#: - ``deepspeed`` and ``app`` are both clients of the engine; ``app`` is ranked above ``deepspeed``
#:   (the library never imports the application, see :func:`test_library_never_imports_the_application`).
RANKS = ("config", "runtime", "stage3", "offload", "checkpoint", "engine", "deepspeed", "app")

#: module or package -> its rank; the longest matching dotted prefix wins
RANK_OF_PREFIX = {
    "zerodp.config": "config",
    "zerodp.config_base": "config",
    "zerodp.config_batch": "config",
    "zerodp.config_keys": "config",
    "zerodp.config_optimizer": "config",
    "zerodp.offload.config": "config",
    "zerodp.runtime": "runtime",
    "zerodp.stage3": "stage3",
    "zerodp.offload": "offload",
    "zerodp.checkpoint": "checkpoint",
    "zerodp": "engine",  # the package itself: zerodp/__init__.py
    "zerodp.engine": "engine",
    "zerodp.entry": "engine",
    "zerodp.zero": "engine",
    "zerodp.accessors": "engine",
    "zerodp.tiling": "engine",
    "zerodp.checkpointing": "engine",
    "zerodp.deepspeed": "deepspeed",
    "zerodp.app": "app",
}


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
                return path[path.index(nxt) :] + [nxt]
            elif colour[nxt] == 0:
                colour[nxt] = 1
                path.append(nxt)
                stack.append((nxt, iter(sorted(graph[nxt]))))
    return None


def shown(path: Path) -> str:
    """``path`` relative to the repository (``src/zerodp/...``) when it lies inside it."""
    root = PACKAGE_DIR.parent.parent
    return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)


def rank_of(module: str) -> str | None:
    """The rank of ``module`` (see :data:`RANKS`): that of its longest dotted prefix in
    :data:`RANK_OF_PREFIX`, where only the package ``zerodp`` itself matches ``"zerodp"`` (a new
    top-level module has no rank until it is given one)."""
    best = None
    for prefix, rank in RANK_OF_PREFIX.items():
        matches = module == prefix or (prefix != "zerodp" and module.startswith(prefix + "."))
        if matches and (best is None or len(prefix) > len(best[0])):
            best = (prefix, rank)
    return best[1] if best else None


def import_lines(path: Path, name: str, target: str, modules: dict[str, Path]) -> list[int]:
    """Line numbers in ``path`` of the import statements that make ``name`` import ``target``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name == target for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = resolve(name, path.name == "__init__.py", node.level, node.module)
            subs = {f"{base}.{a.name}" for a in node.names}
            if target in subs or (base == target and any(s not in modules for s in subs)):
                lines.append(node.lineno)
    return sorted(lines)


def rank_violations(graph: dict[str, set[str]], modules: dict[str, Path] | None = None) -> list[str]:
    """One line per import of a higher-ranked module: ``file:line: importer (rank) imports target (rank)``."""
    out = []
    for name in sorted(graph):
        mine = RANKS.index(rank_of(name))
        for dep in sorted(graph[name]):
            theirs = RANKS.index(rank_of(dep))
            if theirs > mine:
                where = shown(modules[name]) if modules else name
                lines = import_lines(modules[name], name, dep, modules) if modules else []
                out.append(
                    f"{where}:{','.join(map(str, lines)) or '?'}: {name} ({RANKS[mine]}) imports "
                    f"{dep} ({RANKS[theirs]})"
                )
    return out


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


def test_every_module_has_a_rank():
    unranked = sorted(m for m in all_modules() if rank_of(m) is None)
    assert not unranked, f"modules with no rank (add them to RANK_OF_PREFIX in {__file__}): {unranked}"


def test_rank_of_matches_whole_dotted_names():
    assert rank_of("zerodp.checkpointing") == "engine"  # not the package zerodp.checkpoint
    assert rank_of("zerodp.checkpoint.layout") == "checkpoint"
    assert rank_of("zerodp.config_keys") == "config"
    assert rank_of("zerodp.offload.config") == "config" and rank_of("zerodp.offload.nvme") == "offload"
    assert rank_of("zerodp") == "engine" and rank_of("zerodp.something_new") is None


def test_rank_violations_are_listed():
    graph = {
        "zerodp.runtime.a": {"zerodp.stage3.b", "zerodp.config"},
        "zerodp.stage3.b": {"zerodp.runtime.a"},
        "zerodp.offload.config": {"zerodp.offload.nvme"},
    }
    assert rank_violations(graph) == [
        "zerodp.offload.config:?: zerodp.offload.config (config) imports zerodp.offload.nvme (offload)",
        "zerodp.runtime.a:?: zerodp.runtime.a (runtime) imports zerodp.stage3.b (stage3)",
    ]


def test_imports_point_down_the_package_ranks():
    modules = all_modules()
    violations = rank_violations(import_graph(), modules)
    assert not violations, (
        f"imports of a higher-ranked module (ranks, lowest first: {' < '.join(RANKS)}); move the shared "
        "code down, or define a Protocol in the lower module:\n" + "\n".join(violations)
    )


def private_imports(name: str, path: Path) -> list[str]:
    """``file:line: module imports _name from other`` for each underscore name (not a dunder) that
    ``name`` imports from another zerodp module: a helper two modules share belongs, public, in a
    module both import."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = resolve(name, path.name == "__init__.py", node.level, node.module)
            if not base.startswith("zerodp") or base == name:
                continue
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    out.append(f"{shown(path)}:{node.lineno}: {name} imports {alias.name} from {base}")
    return out


def test_no_module_imports_another_modules_private_names(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("from zerodp.offload.nvme import OffloadError, _cleanup\nfrom zerodp import __version__\n")
    assert [line.split(": ", 1)[1] for line in private_imports("zerodp.probe", probe)] == [
        "zerodp.probe imports _cleanup from zerodp.offload.nvme"
    ]
    found = [v for name, path in all_modules().items() for v in private_imports(name, path)]
    assert not found, "private names imported across modules (make them public in a shared module):\n" + "\n".join(
        found
    )


def test_library_never_imports_the_application():
    offenders = {
        m: sorted(d for d in deps if d == APP or d.startswith(APP + "."))
        for m, deps in import_graph().items()
        if not (m == APP or m.startswith(APP + "."))
    }
    offenders = {m: d for m, d in offenders.items() if d}
    assert not offenders, f"library modules importing {APP}: {offenders}"


@pytest.mark.parametrize("name", sorted(all_modules()))
def test_module_has_docstring_and_fits_one_concept(name):
    path = all_modules()[name]
    source = path.read_text()
    assert ast.get_docstring(ast.parse(source)), f"{path} has no module docstring saying what it owns"
    lines = source.count("\n")
    cap = HARD_MAX_LINES if name in OVER_MAX_LINES else MAX_LINES
    assert lines <= cap, f"{path} has {lines} lines (> {cap}): split it by concept"


def test_over_length_allow_list_is_current():
    modules = all_modules()
    stale = [n for n in OVER_MAX_LINES if n not in modules or modules[n].read_text().count("\n") <= MAX_LINES]
    assert not stale, f"{stale} fit in {MAX_LINES} lines now (or are gone): remove them from OVER_MAX_LINES"


def function_lengths(name: str, path: Path) -> dict[str, int]:
    """Qualified name (module.Class.function) -> lines from ``def`` to the end of the body."""
    out: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                qual = f"{prefix}.{child.name}"
                out[qual] = child.end_lineno - child.lineno + 1
                visit(child, qual)
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}.{child.name}")

    visit(ast.parse(path.read_text()), name)
    return out


def library_function_lengths() -> dict[str, int]:
    return {
        q: n
        for m, p in all_modules().items()
        if not (m == APP or m.startswith(APP + "."))
        for q, n in function_lengths(m, p).items()
    }


def test_no_library_function_above_the_line_cap():
    lengths = library_function_lengths()
    long = {q: n for q, n in lengths.items() if n > MAX_FUNCTION_LINES and q not in LONG_FUNCTIONS}
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them): {long}"
    stale = [q for q in LONG_FUNCTIONS if lengths.get(q, 0) <= MAX_FUNCTION_LINES]
    assert not stale, f"{stale} fit in {MAX_FUNCTION_LINES} lines now (or are gone): remove them from LONG_FUNCTIONS"


def test_function_lengths_are_measured_from_def_to_end(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("class A:\n    def f(self):\n        x = 1\n\n        return x\n\n\ndef g():\n    pass\n")
    assert function_lengths("probe", probe) == {"probe.A.f": 4, "probe.g": 2}
