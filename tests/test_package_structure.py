"""The installed package's import structure: no cycles, no test code.

Static, from the sources (``ast``; nothing is imported, so it runs without the live extra):
the package is ``lmcache_histate/`` plus ``backends/`` (installed as
``lmcache_histate.backends``). An edge ``a -> b`` is any ``import`` / ``from ... import`` in
``a`` naming package module ``b`` (also ``from pkg import submodule``), at module level,
inside a function (a lazy import still ties the two modules together) or under ``if
TYPE_CHECKING:`` (it never runs, but a module that needs another's types for its
signatures depends on it as much: a cycle hidden there is still a cycle).
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {"lmcache_histate": ROOT / "lmcache_histate",
                "lmcache_histate.backends": ROOT / "backends"}
TEST_FRAMEWORKS = {"pytest", "hypothesis", "_pytest"}


def package_modules() -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is a package ``__init__``)."""
    out: dict[str, tuple[Path, bool]] = {}
    for prefix, base in PACKAGE_DIRS.items():
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            if is_pkg:
                parts.pop()
            out[".".join([prefix, *parts])] = (path, is_pkg)
    return out


def imported_names(name: str, path: Path, is_pkg: bool) -> Iterator[str]:
    """Every absolute module name (and ``module.attribute``) ``name``'s file imports."""
    package = name if is_pkg else name.rpartition(".")[0]

    def walk(node: ast.AST) -> Iterator[str]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                yield from (alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")[: len(package.split(".")) - child.level + 1]
                    module = ".".join([*base, *([child.module] if child.module else [])])
                else:
                    module = child.module or ""
                yield module
                yield from (f"{module}.{alias.name}" for alias in child.names)
            yield from walk(child)

    yield from walk(ast.parse(path.read_text(), str(path)))


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (built once per test run; read only)."""
    modules = package_modules()
    return {name: {m for m in imported_names(name, path, is_pkg) if m in modules and m != name}
            for name, (path, is_pkg) in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_cycle_finder_finds_a_planted_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_imports_under_type_checking_are_edges(tmp_path: Path) -> None:
    """An import only type checkers run still ties the two modules together."""
    path = tmp_path / "m.py"
    path.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                    "    from .peer import Thing\n")
    assert "pkg.peer" in set(imported_names("pkg.m", path, False))


def test_the_package_has_no_import_cycle() -> None:
    graph = import_graph()
    assert "lmcache_histate.backends.server.runtime.runtime" in graph  # both folders were scanned
    assert "lmcache_histate.backends.upstream.patching" in graph
    assert cycles(graph) == []


def test_the_package_imports_no_test_code() -> None:
    test_modules = {p.stem for p in (ROOT / "tests").rglob("*.py")} | {"tests", "support"}
    offending = []
    for name, (path, is_pkg) in package_modules().items():
        for module in imported_names(name, path, is_pkg):
            top = module.split(".")[0]
            if top in test_modules or top in TEST_FRAMEWORKS:
                offending.append(f"{name} imports {module}")
    assert offending == []
    # The test-only server modules live under tests/support, not in the package.
    for module in ("pressure_override", "zero_restore_hook"):
        assert (ROOT / "tests" / "support" / f"{module}.py").is_file()
        assert not [p for base in PACKAGE_DIRS.values() for p in base.rglob(f"{module}.py")]


def test_nothing_outside_the_core_reaches_behind_its_facade() -> None:
    """The core's index, eviction queue, tiered store and interval controller are private
    to ``HiStateCache``: no package module outside ``core/`` reads them off another object
    (a class's own ``self._index`` or ``super()._store`` is its own business)."""
    private = {"_index", "_store", "_queue", "_interval", "_hit_model", "_residence",
               "_reaccess"}
    offending = []
    for name, (path, _is_pkg) in package_modules().items():
        if name.startswith("lmcache_histate.core"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in private and not _own(node.value):
                offending.append(f"{name}: .{node.attr}")
    assert offending == []


def _own(value: ast.expr) -> bool:
    """``self`` or ``super()``: an object's own attributes."""
    if isinstance(value, ast.Name):
        return value.id == "self"
    return (isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
            and value.func.id == "super")


def test_every_import_of_the_package_names_a_module_that_exists() -> None:
    """After modules move, an import of the old path must not survive anywhere: in the
    package (lazy imports too), the tests, benchmarks and examples."""
    modules = package_modules()
    missing = []
    files = [(name, path, is_pkg) for name, (path, is_pkg) in modules.items()]
    files += [(None, p, False) for d in ("tests", "benchmarks", "examples")
              for p in sorted((ROOT / d).rglob("*.py"))]
    for name, path, is_pkg in files:
        package = (name if is_pkg else name.rpartition(".")[0]) if name else ""
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    targets = [".".join([*base, *([node.module] if node.module else [])])]
                else:
                    targets = [node.module or ""]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            missing += [f"{path.relative_to(ROOT)}: {t}" for t in targets
                        if t.startswith("lmcache_histate") and t not in modules]
    assert missing == []


def test_the_runtime_lock_is_taken_in_one_place() -> None:
    """``runtime`` module doc: one context, ``HiStateRuntime.step``, takes the runtime's
    lock; the only other locks the runtime package takes are ``TierActions``' own two
    (the expected removals, the refused deletes), never held while calling anything. No
    module (or test support) reads a lock off a runtime."""
    runtime_dir = ROOT / "backends" / "server" / "runtime"
    taken = []
    for path in sorted(runtime_dir.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.With, ast.AsyncWith)):
                taken += [f"{path.name}: {ast.unparse(item.context_expr)}" for item in node.items
                          if ast.unparse(item.context_expr).endswith("lock")]
    assert sorted(taken) == ["runtime.py: self._lock", "tier_actions.py: self._expected_lock",
                             "tier_actions.py: self._expected_lock",
                             "tier_actions.py: self._expected_lock",
                             "tier_actions.py: self._retry_lock",
                             "tier_actions.py: self._retry_lock"]
    offending = []
    files = [path for path, _is_pkg in package_modules().values()]
    for path in [*files, *sorted((ROOT / "tests" / "support").glob("*.py"))]:
        text = path.read_text()
        if "lock" not in text:
            continue
        for node in ast.walk(ast.parse(text, str(path))):
            if (isinstance(node, ast.Attribute) and node.attr in ("lock", "_lock")
                    and "runtime" in ast.unparse(node.value)):
                offending.append(f"{path.relative_to(ROOT)}: {ast.unparse(node)}")
    assert offending == []


def test_the_runtime_parts_call_down_only() -> None:
    """``runtime`` module doc: the runtime drives its parts, the tier actions read the
    object map, the object map reads the core and nothing above it (no import, not even
    for types)."""
    graph = import_graph()
    pkg = "lmcache_histate.backends.server.runtime"
    above = {f"{pkg}.{m}" for m in ("runtime", "tier_actions", "recovery", "reporting",
                                     "cpu_eviction")}
    assert not graph[f"{pkg}.objects"] & above
    assert not graph[f"{pkg}.tier_actions"] & {f"{pkg}.runtime"}
    assert not graph[f"{pkg}.stats"] - {"lmcache_histate.core.tiers", "lmcache_histate.core"}
