"""The layers of the library, read from the source with `ast`: imports point down only, the table layer
never needs torch, the dashboard reads through the table and jobs layers, and no module imports itself
back through a cycle.

    fca.tables  (0)  torch-free: store, manifest, statistics, profiles, conditions, reports, studies
    fca.engine  (1)  torch: sites, adapters, record and replay passes, execution audit, model families
    fca.jobs    (2)  what users run; `fca.testing` (random-weight models for tests and benches) sits here
    fca.cli     (3)  and `fca.__main__`
    app         (4)  the dashboard
The package `fca` itself only names the public API and loads it on first use, so it may be imported from
anywhere.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"fca.tables": 0, "fca.engine": 1, "fca.jobs": 2, "fca.testing": 2, "fca.cli": 3, "fca.__main__": 3, "app": 4}
LAYER_NAMES = {0: "tables", 1: "engine", 2: "jobs", 3: "cli", 4: "app"}
TORCH_LIKE = ("torch", "transformers", "safetensors")  # safetensors.torch imports torch
APP_MAY_IMPORT = ("fca.tables", "fca.jobs")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> dict[str, Path]:
    files = [*ROOT.glob("fca/**/*.py"), *ROOT.glob("app/**/*.py")]
    return {_module_name(p): p for p in sorted(files)}


MODULES = _sources()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, *, module_level_only: bool) -> list[ast.Import | ast.ImportFrom]:
    """Import statements, skipping `if TYPE_CHECKING:` bodies (annotations only, never executed) and, when
    asked, function bodies (run later, not while the module is being imported)."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append(child)
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.orelse:
                    visit(ast.Module(body=[stmt], type_ignores=[]))
            elif module_level_only and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            else:
                visit(child)

    visit(tree)
    return found


def _targets(module: str, path: Path, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The modules an import statement names: `from fca.tables import data` names `fca.tables.data`."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: resolved against the importing module's package
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join(package + ([base] if base else []))
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]


def _import_table(*, module_level_only: bool) -> dict[str, set[str]]:
    table = {}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        table[module] = {
            t for node in _imports(tree, module_level_only=module_level_only) for t in _targets(module, path, node)
        }
    return table


def _layer(module: str) -> int | None:
    for prefix, layer in LAYERS.items():
        if module == prefix or module.startswith(prefix + "."):
            return layer
    return None


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def layer_violations(table: dict[str, set[str]]) -> list[str]:
    wrong = []
    for module, targets in table.items():
        here = _layer(module)
        for target in sorted(targets):
            there = _layer(target)
            if here is not None and there is not None and there > here:
                wrong.append(f"{module} ({LAYER_NAMES[here]}) imports {target} ({LAYER_NAMES[there]})")
    return wrong


def test_every_module_has_a_layer() -> None:
    assert not [m for m in MODULES if m != "fca" and _layer(m) is None]


def test_imports_point_down_only() -> None:
    assert layer_violations(_import_table(module_level_only=False)) == []


def test_the_table_layer_never_imports_torch() -> None:
    table = _import_table(module_level_only=False)
    wrong = {
        m: sorted(t for t in targets if _within(t, TORCH_LIKE))
        for m, targets in table.items()
        if _within(m, ("fca.tables",))
    }
    assert {m: t for m, t in wrong.items() if t} == {}


def test_the_app_reads_through_tables_and_jobs() -> None:
    table = _import_table(module_level_only=False)
    reaching = {
        m: sorted(t for t in targets if _within(t, ("fca",)) and t != "fca" and not _within(t, APP_MAY_IMPORT))
        for m, targets in table.items()
        if _within(m, ("app",))
    }
    assert {m: t for m, t in reaching.items() if t} == {}


def import_cycles(table: dict[str, set[str]]) -> list[list[str]]:
    """Cycles among the modules' import-time imports. Importing `a.b.c` runs the packages `a` and `a.b`
    first, so those count as imported too (except the importer's own packages, which are already
    running)."""
    graph: dict[str, set[str]] = {}
    for module, targets in table.items():
        own = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)}
        edges = set()
        for target in targets:
            parts = target.split(".")
            edges |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
        graph[module] = {t for t in edges if t in table and t != module and t not in own}
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return cycles


def test_no_import_cycles() -> None:
    assert [" -> ".join(c) for c in import_cycles(_import_table(module_level_only=True))] == []


def test_the_checks_see_what_they_should() -> None:
    """The checks on made-up import tables: an upward import, a cycle, and a cycle through a package."""
    table = {
        "fca.tables.stats": {"fca.engine.sites"},
        "fca.engine.sites": {"fca.tables.spec"},
        "fca.tables.spec": set(),
    }
    assert layer_violations(table) == ["fca.tables.stats (tables) imports fca.engine.sites (engine)"]
    table = {"fca.engine.a": {"fca.engine.b"}, "fca.engine.b": {"fca.engine.a"}}
    assert import_cycles(table) == [["fca.engine.a", "fca.engine.b", "fca.engine.a"]]
    table = {
        "fca.engine.models": {"fca.engine.models.x"},
        "fca.engine.models.x": {"fca.engine.capture"},
        "fca.engine.capture": {"fca.engine.models.y"},
        "fca.engine.models.y": set(),
    }
    assert import_cycles(table) == [
        ["fca.engine.capture", "fca.engine.models", "fca.engine.models.x", "fca.engine.capture"]
    ]
