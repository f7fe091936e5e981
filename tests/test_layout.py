"""The package layout: no import cycle between specee_core's modules, and the public API at the top.

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
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
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
    # the step contract imports the batch state under TYPE_CHECKING only
    assert "specee_core.decode.state" in graph["specee_core.decode.stepper"]
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
