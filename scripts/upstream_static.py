"""Static reading of upstream (vLLM, LMCache) sources: which symbols exist, with what signatures.

No upstream module is imported: every answer comes from parsing ``.py`` files with ``ast``,
so the CUDA build of vLLM is checked on a machine without a GPU (``scripts/compat.py``).

* :class:`SourceTree` -- where an upstream package's sources come from: a folder
  (site-packages, an unpacked copy), a wheel read in place (only the ``.py`` files asked for
  are read, and copied under ``extract_to`` for a developer to open), or an overlay of
  several (a test's edited copy of one file over the installed tree);
* :class:`Resolver` -- ``"module:Qual.name"`` to what it names (a module, a class, a function,
  another value), following re-exports, submodules and base classes;
* :func:`derive_uses` -- the upstream symbols HiState's own sources import, subclass,
  override, call or patch, found by walking their AST (so a new use cannot be forgotten);
* :func:`check` -- every use against a resolver: the symbol exists, a declared signature is
  the one we wrote against, our calls fit the upstream parameters, and our subclasses
  implement every abstract method of their upstream bases.

NOTE 1 (what "unknown" means). A class whose bases are outside the two upstream packages
(``torch.nn.Module``, a C extension) may get members from them; a member not found on it is
then not reported, and a module with a module-level ``__getattr__`` (vLLM's lazy top-level
exports) is assumed to provide any name. Only what the sources prove missing is a problem.
"""

from __future__ import annotations

import ast
import zipfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "UPSTREAM",
    "CallShape",
    "Resolver",
    "SourceTree",
    "Target",
    "Use",
    "check",
    "derive_uses",
    "render_params",
]

UPSTREAM = ("vllm", "lmcache")
"""The import packages whose symbols are checked."""

TRIVIAL_BASES = {"object", "ABC", "Generic", "Protocol", "Enum", "str", "int", "NamedTuple",
                 "TypedDict", "Exception", "RuntimeError", "ValueError"}
"""Bases that add no members a subclass of ours could rely on (NOTE 1)."""


# ------------------------------------------------------------------------- source trees
class SourceTree:
    """Sources of import packages: ``read("a/b.py")`` gives the text or None."""

    def __init__(self, *, folder: Path | None = None, wheel: Path | None = None,
                 extract_to: Path | None = None, over: Sequence[SourceTree] = ()) -> None:
        self.folder, self.wheel, self.extract_to, self.over = folder, wheel, extract_to, over
        self._zip: zipfile.ZipFile | None = None
        self._names: set[str] = set()
        self._parsed: dict[str, ast.Module | None] = {}
        if wheel is not None:
            self._zip = zipfile.ZipFile(wheel)
            self._names = set(self._zip.namelist())

    def __repr__(self) -> str:
        return f"SourceTree({self.folder or self.wheel})"

    def has_extension(self, rel: str) -> bool:
        """Whether the compiled module ``rel`` (``a/b`` for ``a.b``) is there (no source)."""
        if any(tree.has_extension(rel) for tree in self.over):
            return True
        if self.folder is not None:
            folder = self.folder / rel
            return any(folder.parent.glob(folder.name + ".*.so")) if folder.parent.is_dir() \
                else False
        return any(n.startswith(rel + ".") and n.endswith(".so") for n in self._names)

    def parse(self, relpath: str) -> ast.Module | None:
        """The parsed file, or None; parsed once per tree (an overlay asks its layers, so
        a shared base tree is parsed once for all the overlays on it)."""
        for tree in self.over:
            found = tree.parse(relpath)
            if found is not None:
                return found
        if relpath not in self._parsed:
            text = self._read_own(relpath)
            self._parsed[relpath] = None if text is None else ast.parse(text, relpath)
        return self._parsed[relpath]

    def read(self, relpath: str) -> str | None:
        for tree in self.over:
            text = tree.read(relpath)
            if text is not None:
                return text
        return self._read_own(relpath)

    def _read_own(self, relpath: str) -> str | None:
        if self.folder is not None:
            path = self.folder / relpath
            return path.read_text(encoding="utf-8") if path.is_file() else None
        if self._zip is not None and relpath in self._names:
            data = self._zip.read(relpath)
            if self.extract_to is not None:
                out = self.extract_to / relpath
                if not out.exists():
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_bytes(data)
            return data.decode("utf-8")
        return None


# ---------------------------------------------------------------------------- signatures
def render_params(args: ast.arguments) -> tuple[str, ...]:
    """A function's parameters as written: ``name``, ``name=`` (has a default), ``*name``,
    ``kw:name`` / ``kw:name=`` (keyword-only), ``**name``; ``/`` ends positional-only ones."""
    positional = [*args.posonlyargs, *args.args]
    first_default = len(positional) - len(args.defaults)
    out: list[str] = []
    for i, arg in enumerate(positional):
        out.append(arg.arg + ("=" if i >= first_default else ""))
        if args.posonlyargs and i == len(args.posonlyargs) - 1:
            out.append("/")
    if args.vararg is not None:
        out.append("*" + args.vararg.arg)
    for arg, default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        out.append("kw:" + arg.arg + ("" if default is None else "="))
    if args.kwarg is not None:
        out.append("**" + args.kwarg.arg)
    return tuple(out)


@dataclass(frozen=True)
class CallShape:
    """How one of our call sites calls an upstream callable."""

    positional: int
    keywords: tuple[str, ...]
    starred: bool  # *args or **kwargs at the call: only the names can be checked
    bound: bool  # called on an instance or through super(): ``self`` is implicit
    where: str


def call_problem(params: tuple[str, ...], call: CallShape) -> str | None:
    """Why ``params`` cannot take ``call``, or None."""
    plist = [p for p in params if p != "/"]
    posonly = params.index("/") if "/" in params else 0
    positional = [p for p in plist if not p.startswith(("*", "kw:"))]
    if call.bound and positional:
        positional, posonly = positional[1:], max(0, posonly - 1)
    has_var = any(p.startswith("*") and not p.startswith("**") for p in plist)
    has_kw = any(p.startswith("**") for p in plist)
    names = {p.removeprefix("kw:").rstrip("=") for p in plist if not p.startswith("*")}
    if not call.starred and call.positional > len(positional) and not has_var:
        return f"takes {len(positional)} positional arguments, we pass {call.positional}"
    for key in call.keywords:
        if key not in names and not has_kw:
            return f"has no parameter {key!r}"
        if key in {p.rstrip("=") for p in positional[:posonly]}:
            return f"parameter {key!r} is positional-only"
    if call.starred:
        return None
    covered = set(call.keywords) | {p.rstrip("=") for p in positional[:call.positional]}
    required = [p for p in positional if not p.endswith("=")]
    required += [p[3:] for p in plist if p.startswith("kw:") and not p.endswith("=")]
    missing = [p for p in required if p not in covered]
    return f"requires {', '.join(missing)}, which we do not pass" if missing else None


# ------------------------------------------------------------------------------ resolver
@dataclass
class Module:
    name: str
    is_package: bool
    tree: ast.Module
    names: dict[str, ast.AST] = field(default_factory=dict)  # top-level definitions
    imports: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (module, attr)
    lazy: bool = False  # has a module-level __getattr__ (NOTE 1)


@dataclass(frozen=True)
class Target:
    """What a symbol names: a module, a class (its module and node), a function, a value."""

    kind: str  # "module", "class", "function", "value", "unknown"; "opaque": a chain that
    # runs on past a function or a value (attributes of what it returns or holds)
    module: str
    node: ast.AST | None = None


def _top_level(body: Iterable[ast.stmt]) -> Iterator[ast.stmt]:
    for stmt in body:
        if isinstance(stmt, ast.If | ast.With):
            yield from _top_level(stmt.body)
            yield from _top_level(getattr(stmt, "orelse", []))
        elif isinstance(stmt, ast.Try):
            for part in (stmt.body, stmt.orelse, stmt.finalbody, *[h.body for h in stmt.handlers]):
                yield from _top_level(part)
        else:
            yield stmt


def _absolute(module: str, is_package: bool, level: int, target: str | None) -> str:
    if level == 0:
        return target or ""
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, *([target] if target else [])])


class Resolver:
    """Resolve ``"module:Qual.name"`` symbols over one :class:`SourceTree` per package."""

    def __init__(self, trees: dict[str, SourceTree],
                 aliases: dict[str, str] | None = None) -> None:
        """``aliases``: ``"module:Name"`` bound at import time to what another symbol names
        (read by a person, not derivable from the sources; see ``compat.ALIASES``)."""
        self.trees = trees
        self.aliases = dict(aliases or {})
        self._modules: dict[str, Module | None] = {}

    def module(self, name: str) -> Module | None:
        if name in self._modules:
            return self._modules[name]
        found: Module | None = None
        tree = self.trees.get(name.split(".")[0])
        if tree is not None:
            rel = name.replace(".", "/")
            for relpath, is_package in ((rel + ".py", False), (rel + "/__init__.py", True)):
                parsed = tree.parse(relpath)
                if parsed is not None:
                    found = self._index(name, is_package, parsed)
                    break
        self._modules[name] = found
        return found

    def _index(self, name: str, is_package: bool, tree: ast.Module) -> Module:
        mod = Module(name, is_package, tree)
        for stmt in _top_level(tree.body):
            if isinstance(stmt, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                mod.names[stmt.name] = stmt
                mod.lazy |= stmt.name == "__getattr__"
            elif isinstance(stmt, ast.Assign | ast.AnnAssign):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                for target in targets:
                    for node in ast.walk(target):
                        if isinstance(node, ast.Name):
                            mod.names.setdefault(node.id, stmt)
            elif isinstance(stmt, ast.ImportFrom):
                source = _absolute(name, is_package, stmt.level, stmt.module)
                for alias in stmt.names:
                    mod.imports[alias.asname or alias.name] = (source, alias.name)
            elif isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    if alias.asname:
                        mod.imports[alias.asname] = (alias.name, "")
                    else:
                        head = alias.name.split(".")[0]
                        mod.imports[head] = (head, "")
        return mod

    def resolve(self, symbol: str) -> Target | None:
        """The target of ``"module:Qual.name"``; None if the sources prove it missing;
        ``Target("unknown", ...)`` where they cannot tell (NOTE 1)."""
        module, _, qual = symbol.partition(":")
        return self._walk(module, [p for p in qual.split(".") if p], depth=0)

    def _walk(self, module: str, parts: list[str], depth: int) -> Target | None:
        if depth > 40:
            return Target("unknown", module)
        if module.split(".")[0] not in self.trees:
            return Target("unknown", module)
        mod = self.module(module)
        if mod is None:
            tree = self.trees[module.split(".")[0]]
            return Target("unknown", module) if tree.has_extension(module.replace(".", "/")) \
                else None
        if not parts:
            return Target("module", module)
        head, rest = parts[0], parts[1:]
        alias = self.aliases.get(f"{module}:{head}")
        if alias is not None:
            target_module, _, qual = alias.partition(":")
            return self._walk(target_module, [*qual.split("."), *rest], depth + 1)
        node = mod.names.get(head)
        if isinstance(node, ast.ClassDef):
            return self._member(Target("class", module, node), rest, depth)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            return Target("function" if not rest else "opaque", module, node)
        if node is not None:
            return Target("value" if not rest else "opaque", module, node)
        if head in mod.imports:
            source, attr = mod.imports[head]
            return self._walk(source, ([attr] if attr else []) + rest, depth + 1)
        if self.module(f"{module}.{head}") is not None:
            return self._walk(f"{module}.{head}", rest, depth + 1)
        return Target("unknown", module) if mod.lazy else None

    def _member(self, cls: Target, parts: list[str], depth: int) -> Target | None:
        if not parts:
            return cls
        found = self.class_member(cls, parts[0], depth)
        if found is None or found.kind != "class":
            return found if len(parts) == 1 or found is None else Target("opaque", cls.module)
        return self._member(found, parts[1:], depth + 1)

    def bases(self, cls: Target, depth: int = 0) -> list[Target | None]:
        """The class's bases, resolved where they are upstream; None for a trivial base."""
        out: list[Target | None] = []
        mod = self.module(cls.module)
        assert isinstance(cls.node, ast.ClassDef) and mod is not None
        for base in cls.node.bases:
            expr = base.value if isinstance(base, ast.Subscript) else base
            chain = _chain(expr)
            if chain is None:
                out.append(Target("unknown", cls.module))
                continue
            if chain[-1] in TRIVIAL_BASES:
                out.append(None)
                continue
            target = self._walk(cls.module, chain, depth + 1)
            out.append(target if target is not None else Target("unknown", cls.module))
        return out

    def class_member(self, cls: Target, name: str, depth: int = 0) -> Target | None:
        """``cls.name`` through the class's bases (definition order, depth first)."""
        if depth > 40:
            return Target("unknown", cls.module)
        assert isinstance(cls.node, ast.ClassDef)
        for stmt in _top_level(cls.node.body):
            if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef) and stmt.name == name:
                return Target("function", cls.module, stmt)
            if isinstance(stmt, ast.ClassDef) and stmt.name == name:
                return Target("class", cls.module, stmt)
            targets = (stmt.targets if isinstance(stmt, ast.Assign)
                       else [stmt.target] if isinstance(stmt, ast.AnnAssign) else [])
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return Target("value", cls.module, stmt)
        unknown = False
        for base in self.bases(cls, depth):
            if base is None:
                continue
            if base.kind != "class":
                unknown = True
                continue
            found = self.class_member(base, name, depth + 1)
            if found is not None and found.kind != "unknown":
                return found
            unknown |= found is not None
        return Target("unknown", cls.module) if unknown else None

    def abstract_methods(self, cls: Target, depth: int = 0) -> dict[str, str]:
        """Abstract methods of ``cls`` (its own and its bases' not defined on the way):
        name -> the class declaring it abstract."""
        out: dict[str, str] = {}
        if depth > 40:
            return out
        for base in self.bases(cls, depth):
            if base is not None and base.kind == "class":
                for name, owner in self.abstract_methods(base, depth + 1).items():
                    out.setdefault(name, owner)
        assert isinstance(cls.node, ast.ClassDef)
        for stmt in _top_level(cls.node.body):
            if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
                if any((_chain(d) or [""])[-1] == "abstractmethod" for d in stmt.decorator_list):
                    out[stmt.name] = f"{cls.module}:{cls.node.name}"
                else:
                    out.pop(stmt.name, None)
        return out


def _chain(expr: ast.AST) -> list[str] | None:
    """``a.b.c`` as ``["a", "b", "c"]``; None for anything else."""
    parts: list[str] = []
    while isinstance(expr, ast.Attribute):
        parts.insert(0, expr.attr)
        expr = expr.value
    if isinstance(expr, ast.Name):
        return [expr.id, *parts]
    return None


def params_of(target: Target | None, resolver: Resolver) -> tuple[str, ...] | None:
    """Parameters of a function target, or of a class's ``__init__``; None if unknown."""
    if target is None:
        return None
    if target.kind == "function":
        assert isinstance(target.node, ast.FunctionDef | ast.AsyncFunctionDef)
        return render_params(target.node.args)
    if target.kind == "class":
        assert isinstance(target.node, ast.ClassDef)
        if any(_chain(d.func if isinstance(d, ast.Call) else d) in (["dataclass"],
               ["dataclasses", "dataclass"]) for d in target.node.decorator_list):
            return None  # generated __init__: not read here
        init = resolver.class_member(target, "__init__")
        if init is not None and init.kind == "function":
            return params_of(init, resolver)
    return None


# ----------------------------------------------------------------------------- our uses
@dataclass
class Use:
    """One upstream symbol our sources rely on, with how and where."""

    symbol: str
    kinds: set[str] = field(default_factory=set)  # import/attribute/subclass/override/patch/call
    where: list[str] = field(default_factory=list)
    params: tuple[str, ...] | None = None  # an override's parameters, as we wrote them
    calls: list[CallShape] = field(default_factory=list)
    subclasses: dict[str, set[str]] = field(default_factory=dict)
    """For "subclass": each class of ours on it (``file:Class``) -> the methods it defines."""


def _symbol(ref: tuple[str, str], rest: Sequence[str] = ()) -> str:
    module, attr = ref
    qual = ".".join([p for p in (attr, *rest) if p])
    return f"{module}:{qual}"


def _shorten(symbol: str, resolver: Resolver) -> str:
    """``symbol`` as far as it names an upstream definition (an attribute chain may run on
    into a value's own attributes), rooted at its innermost module (``a.b:c.D`` with ``c``
    a submodule is ``a.b.c:D``)."""
    module, _, qual = symbol.partition(":")
    parts = qual.split(".") if qual else []
    while parts and resolver.module(f"{module}.{parts[0]}") is not None:
        module, parts = f"{module}.{parts[0]}", parts[1:]
    alias = resolver.aliases.get(f"{module}:{parts[0]}") if len(parts) > 1 else None
    if alias is not None:  # a member of an aliased class: named where it is defined
        module, _, qual = alias.partition(":")
        parts = [*qual.split("."), *parts[1:]]
    for n in range(len(parts), 0, -1):
        target = resolver.resolve(f"{module}:{'.'.join(parts[:n])}")
        if target is None and n == len(parts):
            break  # missing: named in full
        if target is not None and target.kind != "opaque":
            return f"{module}:{'.'.join(parts[:n])}"
    return f"{module}:{'.'.join(parts)}"


def derive_uses(files: Iterable[tuple[str, str]], resolver: Resolver) -> dict[str, Use]:
    """Upstream symbols used by our sources ``(name, text)``, resolved against ``resolver``
    (the reference versions) to decide how far an attribute chain names upstream code."""
    uses: dict[str, Use] = {}

    def add(symbol: str, kind: str, where: str) -> Use:
        symbol = _shorten(symbol, resolver)
        use = uses.setdefault(symbol, Use(symbol))
        use.kinds.add(kind)
        if where not in use.where:
            use.where.append(where)
        return use

    for name, text in files:
        tree = ast.parse(text, name)
        aliases: dict[str, tuple[str, str]] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                    node.module.split(".")[0] in UPSTREAM:
                for alias in node.names:
                    aliases[alias.asname or alias.name] = (node.module, alias.name)
                    add(_symbol((node.module, alias.name)), "import", f"{name}:{node.lineno}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] in UPSTREAM:
                        local = alias.asname or alias.name.split(".")[0]
                        aliases[local] = (alias.name if alias.asname else local, "")
                        add(f"{alias.name}:", "import", f"{name}:{node.lineno}")
        _walk_uses(name, tree, aliases, add, resolver)
    return uses


def _walk_uses(name: str, tree: ast.Module, aliases: dict[str, tuple[str, str]],
               add: Callable[[str, str, str], Use], resolver: Resolver) -> None:
    def ref_of(expr: ast.AST) -> str | None:
        chain = _chain(expr)
        if chain is None or chain[0] not in aliases:
            return None
        return _symbol(aliases[chain[0]], chain[1:])

    inner: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            inner.add(id(node.value))
    for node in ast.walk(tree):
        where = f"{name}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            ref = ref_of(node)
            if ref is not None:
                add(ref, "attribute", where)
        if isinstance(node, ast.Call):
            func_ref = ref_of(node.func)
            if func_ref is not None:
                use = add(func_ref, "call", where)
                use.calls.append(_shape(node, bound=False, where=where))
            if isinstance(node.func, ast.Name) and node.func.id == "patch" and \
                    len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
                owner = ref_of(node.args[0])
                if owner is not None:
                    add(f"{_shorten(owner, resolver)}.{node.args[1].value}".replace(":.", ":"),
                        "patch", where)
        if isinstance(node, ast.ClassDef):
            upstream = [ref_of(b) for b in node.bases]
            bases = [r for r in upstream if r is not None]
            if not bases:
                continue
            base = _shorten(bases[0], resolver)
            use = add(base, "subclass", where)
            methods = [s for s in node.body if isinstance(s, ast.FunctionDef)]
            use.subclasses[f"{name}:{node.name}"] = {m.name for m in methods}
            base_target = resolver.resolve(base)
            for method in methods:
                if base_target is not None and base_target.kind == "class":
                    member = resolver.class_member(base_target, method.name)
                    if member is not None and member.kind == "function" and \
                            method.name not in ("__new__", "__init__"):
                        over = add(f"{base}.{method.name}", "override",
                                   f"{name}:{method.lineno}")
                        params = render_params(method.args)
                        if not any(p.startswith("*") for p in params):
                            over.params = params
                for sub in ast.walk(method):
                    if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and \
                            isinstance(sub.func.value, ast.Call) and \
                            isinstance(sub.func.value.func, ast.Name) and \
                            sub.func.value.func.id == "super" and sub.func.attr != "__new__":
                        called = add(f"{base}.{sub.func.attr}", "call",
                                     f"{name}:{sub.lineno}")
                        called.calls.append(_shape(sub, bound=True, where=f"{name}:{sub.lineno}"))


def _shape(call: ast.Call, *, bound: bool, where: str) -> CallShape:
    starred = any(isinstance(a, ast.Starred) for a in call.args) or \
        any(k.arg is None for k in call.keywords)
    return CallShape(len([a for a in call.args if not isinstance(a, ast.Starred)]),
                     tuple(k.arg for k in call.keywords if k.arg is not None), starred, bound,
                     where)


# -------------------------------------------------------------------------------- check
def check(uses: dict[str, Use], declared: dict[str, tuple[str, ...] | None],
          resolver: Resolver, packages: Sequence[str] = UPSTREAM) -> list[str]:
    """Problems of ``uses`` (derived) and ``declared`` (the table) on ``resolver``'s
    sources, one line each, naming the symbol; only symbols of ``packages`` are checked."""
    problems: list[str] = []
    for symbol in sorted(set(uses) | set(declared)):
        if symbol.split(".")[0].split(":")[0] not in packages:
            continue
        use = uses.get(symbol)
        where = f" (used at {use.where[0]})" if use is not None and use.where else ""
        target = resolver.resolve(symbol)
        if target is None:
            problems.append(f"{symbol}: missing{where}")
            continue
        upstream = params_of(target, resolver)
        expected = declared.get(symbol)
        if use is not None and use.params is not None:
            expected = use.params
        if expected is not None and upstream is not None and upstream != expected:
            problems.append(f"{symbol}: signature {_sig(upstream)}, we wrote against "
                            f"{_sig(expected)}{where}")
            continue
        if use is not None and upstream is not None:
            for call in use.calls:
                if target.kind == "class":  # a constructor: self is implicit
                    call = CallShape(call.positional, call.keywords, call.starred, True,
                                     call.where)
                why = call_problem(upstream, call)
                if why is not None:
                    problems.append(f"{symbol}{_sig(upstream)} {why} (called at {call.where})")
        if use is not None and use.subclasses and target.kind == "class":
            abstract = sorted(resolver.abstract_methods(target).items())
            for where_ours, methods in sorted(use.subclasses.items()):
                ours = where_ours.rsplit(":", 1)[1]
                problems += [f"{owner}.{method}: abstract, not implemented by {ours} "
                             f"({where_ours})" for method, owner in abstract
                             if method not in methods]
    return problems


def _sig(params: Sequence[str]) -> str:
    return "(" + ", ".join(params) + ")"
