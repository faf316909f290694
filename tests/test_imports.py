"""Imports run one way: no cycles among the modules of cachelib/ and app/, and no layer imports
one above it (app -> cli/sweep -> profile -> plan -> caches -> core).

The graph is read from the source with ``ast``, so an import inside a function counts as much
as one at the top: hiding a cycle in a function does not make it go away.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cachelib", "app")


@dataclass(frozen=True)
class Import:
    target: str  # the module imported (a package means its __init__)
    where: str  # "path:line" of the import statement


def module_files(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under ``packages`` of ``root``."""
    out = {}
    for top in packages:
        for path in sorted((root / top).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module ``import name`` runs last: ``name`` itself, or the nearest enclosing one
    (``cachelib.mlx.KVCache`` names a class of the package ``cachelib.mlx``)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str, modules: dict[str, Path], root: Path = ROOT) -> list[Import]:
    """Every import of ``module``'s file that lands in the scanned packages, wherever it stands."""
    path = modules[module]
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        where = f"{path.relative_to(root)}:{getattr(node, 'lineno', 0)}"
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # from . import x, from ..spec import Spec
                base = package[: len(package) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            names = [source]
            # ``from pkg import name`` imports the submodule pkg.name when there is one.
            names += [f"{source}.{a.name}" for a in node.names if f"{source}.{a.name}" in modules]
        for name in names:
            target = _resolve(name, modules)
            if target is not None and target != module:
                out.append(Import(target, where))
    return out


def import_graph(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, list[Import]]:
    modules = module_files(root, packages)
    return {m: imports_of(m, modules, root) for m in modules}


def _ancestors(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def runtime_graph(graph: dict[str, list[Import]]) -> dict[str, dict[str, str]]:
    """module -> {module it makes Python run: where}. Importing ``a.b.c`` runs the packages
    ``a`` and ``a.b`` first; a module's own enclosing packages are already running, so those
    edges are left out (a package importing its submodules is no cycle)."""
    out: dict[str, dict[str, str]] = {m: {} for m in graph}
    for m, imports in graph.items():
        own = set(_ancestors(m))
        for imp in imports:
            for t in [*_ancestors(imp.target), imp.target]:
                if t in graph and t != m and t not in own:
                    out[m].setdefault(t, imp.where)
    return out


def cycles(edges: dict[str, dict[str, str]]) -> list[list[str]]:
    """The strongly connected sets of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(found)


def _one_loop(component: list[str], edges: dict[str, dict[str, str]]) -> list[str]:
    """A shortest way around the cycle from its first module, with where each import stands."""
    start, members = component[0], set(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges[v]):
                if w == start:
                    path = paths[v] + [start]
                    return [f"{a} -> {b} ({edges[a][b]})" for a, b in zip(path, path[1:])]
                if w in members and w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    return []


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_the_walker_sees_imports_in_functions_relative_ones_submodules_by_name_and_package_inits(tmp_path):
    root = _tree(
        tmp_path,
        {
            "pkg/__init__.py": "from .low import thing\n",
            "pkg/low.py": "thing = 1\n",
            "pkg/sub/__init__.py": "",
            "pkg/sub/a.py": "from .. import low\nfrom ..sub import b\nimport json\n",
            "pkg/sub/b.py": "def f():\n    from pkg.sub.a import x  # hidden in a function\n",
            "pkg/top.py": "import pkg.sub\nfrom pkg.low import thing\n",
            "other/use.py": "import pkg.sub.a\n",
        },
    )
    graph = {m: {i.target for i in imports} for m, imports in import_graph(root, ("pkg", "other")).items()}
    assert graph["pkg"] == {"pkg.low"}
    assert graph["pkg.sub.a"] == {"pkg", "pkg.low", "pkg.sub", "pkg.sub.b"}  # json is not ours
    assert graph["pkg.sub.b"] == {"pkg.sub.a"}
    assert graph["pkg.top"] == {"pkg.sub", "pkg.low"}
    assert graph["other.use"] == {"pkg.sub.a"}
    edges = runtime_graph(import_graph(root, ("pkg", "other")))
    assert set(edges["other.use"]) == {"pkg", "pkg.sub", "pkg.sub.a"}  # a.b.c runs a and a.b first
    assert "pkg" not in edges["pkg.top"]  # its own package is running already
    assert cycles(edges) == [["pkg.sub.a", "pkg.sub.b"]]
    assert _one_loop(["pkg.sub.a", "pkg.sub.b"], edges) == [
        "pkg.sub.a -> pkg.sub.b (pkg/sub/a.py:2)",
        "pkg.sub.b -> pkg.sub.a (pkg/sub/b.py:2)",
    ]


def test_no_import_cycles():
    edges = runtime_graph(import_graph())
    found = cycles(edges)
    report = ["import cycle: " + " <-> ".join(c) + "\n    " + "\n    ".join(_one_loop(c, edges)) for c in found]
    assert not found, "\n".join(report)


# what the modules just above core must not import
ABOVE_CORE = (
    "cachelib.mlx",
    "cachelib.torch",
    "cachelib.plan",
    "cachelib.profile",
    "cachelib.sweep",
    "cachelib.cli",
    "app",
)
# (importer, what it must not import): prefixes of dotted names; "X" covers X and X.*
FORBIDDEN = [
    ("cachelib.mlx", ("cachelib.profile", "cachelib.plan", "cachelib.sweep", "cachelib.cli", "app")),
    ("cachelib.torch", ("cachelib.profile", "cachelib.plan", "cachelib.sweep", "cachelib.cli", "app")),
    # the planner is arithmetic over the strategy table: it never runs a backend (its CPU probe times
    # the runtimes' kernels: ALLOWED)
    ("cachelib.plan", ("cachelib.mlx", "cachelib.torch", "cachelib.profile", "cachelib.sweep", "cachelib.cli", "app")),
    ("cachelib.profile", ("cachelib.sweep", "cachelib.cli", "app")),
    # the strategy table, its specs and the introspection record sit just above core: both backends read them
    *((table, ABOVE_CORE) for table in ("cachelib.strategies", "cachelib.spec", "cachelib.introspect")),
    ("cachelib", ("app",)),
]


# (importer, what it may import all the same, why): exact module names, each a deliberate exception
ALLOWED = [
    # the CPU probe times the runtime's own kernels (it runs mlx-lm's and torch's already); a torch
    # quantized cache's decode is cachelib's codec, so the probe holds and decodes its codes
    ("cachelib.plan.cpu_probe", "cachelib.torch.storage", "the CPU probe times the torch runtime's own decode"),
]


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_imports_run_down_the_layers():
    wrong = []
    for m, imports in import_graph().items():
        for imp in imports:
            if (
                _under(m, "cachelib.core")
                and _under(imp.target, "cachelib")
                and not _under(imp.target, "cachelib.core")
            ):
                wrong.append(f"{m} imports {imp.target} ({imp.where}): cachelib.core imports nothing else of cachelib")
            if any(m == a and imp.target == b for a, b, _ in ALLOWED):
                continue
            for importer, banned in FORBIDDEN:
                if _under(m, importer) and any(_under(imp.target, b) for b in banned):
                    wrong.append(f"{m} imports {imp.target} ({imp.where}): {importer} sits below it")
    assert not wrong, "\n".join(wrong)
