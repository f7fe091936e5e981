"""The package layout: specee_core's packages layered one way (and no import cycle between its modules),
kernels/ free of specee_core, no call into another module's private methods, the rows' state built in
one place, and the public API at the top.

The graph counts every import statement in a file (top level, inside functions, under
`if TYPE_CHECKING:`), relative imports resolved. `from specee_core.a.b import name` is an edge to the
module specee_core.a.b, or to specee_core.a.b.name where that is a module; a package's __init__.py is
the package's module, so re-exports count as its imports.

    python tests/test_layout.py [ROOT]   # ROOT holds specee_core/ (default: this checkout); prints a cycle
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = "specee_core"
REPO = Path(__file__).resolve().parent.parent
_TREES: dict[Path, ast.Module] = {}  # this checkout's files, parsed once while collecting (see parse)


def parse(path: Path) -> ast.Module:
    """path's syntax tree. This checkout's files are parsed when pytest collects this module, on one thread:
    CPython 3.11.7 shares the AST converter's recursion counter between threads (gh-106905, fixed in 3.11.8), and
    a parse in the middle of the run, beside another thread's, once raised "AST constructor recursion depth
    mismatch"."""
    path = Path(path).resolve()
    tree = _TREES.get(path)
    return tree if tree is not None else ast.parse(path.read_text(), str(path))  # (another tree: a test's own files)


def module_names(root: Path, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under root/package (a package is its __init__.py)."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(module: str | None, level: int, importer: str, is_package: bool) -> str:
    """The absolute module an ImportFrom names (level > 0: relative to the importer's package)."""
    if not level:
        return module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _known(name: str, modules: dict) -> str | None:
    """The longest prefix of a dotted name that is one of the modules (None: outside the package)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in modules:
            return ".".join(parts[:n])
    return None


def import_graph(root: Path, package: str = PACKAGE) -> dict[str, set[str]]:
    """module -> the package's modules it imports, from every Import / ImportFrom anywhere in its file."""
    modules = module_names(root, package)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(parse(path)):
            targets = []
            if isinstance(node, ast.Import):
                targets = [_known(a.name, modules) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(node.module, node.level, name, is_package)
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    targets.append(sub if sub in modules else _known(base, modules))
            graph[name].update(t for t in targets if t is not None and t != name)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None when the graph is acyclic."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (cycle := visit(n)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def test_no_import_cycle_between_specee_core_modules():
    graph = import_graph(REPO)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_graph_counts_imports_in_functions_and_under_type_checking():
    graph = import_graph(REPO)
    # engine imports the early-exit step and speculative decoding inside functions only
    assert {"specee_core.early_exit.step", "specee_core.spec.spec_decode"} <= graph["specee_core.decode.engine"]
    # the step contract imports the model's types under TYPE_CHECKING only
    assert "specee_core.model.kv_cache" in graph["specee_core.step.stepper"]
    assert "specee_core.decode.engine" in graph["specee_core"]


def test_submodules_import_their_precise_module_not_the_package():
    graph = import_graph(REPO)
    offenders = sorted(m for m, deps in graph.items() if PACKAGE in deps)
    assert not offenders, f"import from specee_core's precise modules, not `from specee_core import`: {offenders}"


def test_cycle_finder_sees_every_kind_of_import(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg.engine import Engine\n")
    (pkg / "engine.py").write_text("def f():\n    from pkg.sub import step\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "step.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                         "    from ..engine import Engine\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.engine"] == {"pkg.sub.step"} and graph["pkg.sub.step"] == {"pkg.engine"}
    assert find_cycle(graph) == ["pkg.engine", "pkg.sub.step", "pkg.engine"]
    (pkg / "sub" / "step.py").write_text("from . import other\nimport pkg.sub.other\n")
    (pkg / "sub" / "other.py").write_text("")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.sub.step"] == {"pkg.sub.other"} and find_cycle(graph) is None


# specee_core's layers, bottom first: a module imports from its own package and the layers below only.
# "" is specee_core/__init__.py (the public API on top).
LAYERS = ("machine", "options", "model", "step", "draft", "early_exit", "spec", "decode", "")
SOURCES = ("specee_core", "pipeline", "jobs", "tools", "kernels", "specee_eval")
_TREES.update((p.resolve(), ast.parse(p.read_text(), str(p)))  # while collecting (parse's docstring)
              for src in SOURCES + ("tests",) for p in sorted((REPO / src).rglob("*.py")))


def layer_of(module: str) -> str:
    return (module.split(".")[1:2] or [""])[0]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Edges from a package to one above it (or to a package not in LAYERS)."""
    rank = {name: i for i, name in enumerate(LAYERS)}
    return sorted(f"{m} -> {t}" for m, deps in graph.items() for t in deps
                  if rank.get(layer_of(t), len(LAYERS)) > rank.get(layer_of(m), -1))


def test_packages_import_downward_only():
    graph = import_graph(REPO)
    assert {layer_of(m) for m in graph} <= set(LAYERS), "a package missing from LAYERS"
    assert upward_imports(graph) == []


def test_the_layer_check_sees_an_upward_import():
    graph = {"specee_core.model.model": {"specee_core.machine"}, "specee_core.early_exit.step": {"specee_core.step.state"},
             "specee_core.spec.plan": {"specee_core.decode.core"}}
    assert upward_imports(graph) == ["specee_core.spec.plan -> specee_core.decode.core"]


def imported_modules(path: Path) -> set[str]:
    """Absolute module names a file imports (anywhere in it)."""
    out = set()
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            out.add(node.module or "")
    return out


def test_kernels_import_nothing_of_specee_core():
    offenders = sorted(f"{p.name}: {m}" for p in (REPO / "kernels").rglob("*.py") for m in imported_modules(p)
                       if m.split(".")[0] == PACKAGE)
    assert offenders == []


def test_user_commands_import_no_developer_tool():
    """jobs/ (what users run) stands without tools/ (benchmarks, probes, the bundled model's data and training)."""
    offenders = sorted(f"{p.name}: {m}" for p in (REPO / "jobs").rglob("*.py") for m in imported_modules(p)
                       if m.split(".")[0] == "tools")
    assert offenders == []


def private_calls_across_modules(root: Path = REPO) -> list[str]:
    """Calls `x._name(...)` (x not self / cls) of a private method that classes of other modules define and
    the calling module does not."""
    files = [p for src in SOURCES for p in sorted((root / src).rglob("*.py"))]
    trees = {p: parse(p) for p in files}
    owners: dict[str, set[Path]] = {}
    for p, tree in trees.items():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for fn in cls.body:
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.name.startswith("_") \
                        and not fn.name.startswith("__"):
                    owners.setdefault(fn.name, set()).add(p)
    found = []
    for p, tree in trees.items():
        for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)):
            name, obj = call.func.attr, call.func.value
            if name in owners and p not in owners[name] and not (isinstance(obj, ast.Name) and obj.id in ("self", "cls")):
                found.append(f"{p.relative_to(root)}:{call.lineno} {ast.unparse(call.func)}")
    return found


def test_no_module_calls_another_modules_private_methods():
    assert private_calls_across_modules() == []


def test_the_rows_state_is_built_in_one_place():
    """Batch (the rows of a lane) is constructed by Batch.empty only."""
    calls = [f"{p.relative_to(REPO)}:{n.lineno}" for src in SOURCES + ("tests",) for p in sorted((REPO / src).rglob("*.py"))
             for n in ast.walk(parse(p))
             if isinstance(n, ast.Call) and ast.unparse(n.func).split(".")[-1] == "Batch"]
    assert calls == []


def test_public_api():
    import specee_core
    from specee_core import (EngineOptions, GenerationResult, ModelConfig, PromptError, SpecEEEngine, load_model,
                             load_tokenizer)

    assert all(callable(x) for x in (EngineOptions, GenerationResult, ModelConfig, PromptError, SpecEEEngine,
                                     load_model, load_tokenizer))
    for name in specee_core.__all__:
        assert hasattr(specee_core, name), name


if __name__ == "__main__":
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO
    found = find_cycle(import_graph(root))
    print("import cycle: " + " -> ".join(found) if found else f"no import cycle in {root / PACKAGE}")
    sys.exit(1 if found else 0)
