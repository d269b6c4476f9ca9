"""The package's import graph: no cycle between modules (counting imports inside functions), no
import from a lower layer to a higher one, and Lightning only where the layers allow it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_pp"
# DESIGN.md's layers, bottom up; a module may import its own layer and the ones below.
LAYERS = {"schedules": 0, "runtime": 1, "moe": 2, "callbacks": 3, "integrations": 3, "strategies": 4}
NO_LIGHTNING = ("schedules", "runtime", "moe")
# The rooms inside runtime/ (a top-level module or a sub-package), bottom up (docs/architecture.md):
# a runtime module may import its own floor and the ones below. A new room gets a floor here.
RUNTIME_FLOORS = [
    ("protocols", "process", "topology", "timeline", "context", "dtensors", "layer"),
    ("failure",),    # one rank's failure made every rank's clear error
    ("transport",),  # stage-boundary transfers, bounded waits
    ("plans",),      # schedule-plan nodes, the zero-bubble split
    ("cut",),        # cutting a model into chunks, layouts
    ("tp",),         # tensor parallelism inside stages: which DTensors are the tensor-parallel ones
    ("dp",),         # data-parallel machinery: gradient reductions, sharding, the norm
    ("compile",),    # compile=
    ("config",),     # PipelineConfig, ResolvedPipeline
    ("step",),       # the step loop and what one action does
    ("measure", "measure_runtime"),  # layout="auto"'s measurements
    ("build",),      # build_pipeline: assembles everything
]
RUNTIME_FLOOR = {room: floor for floor, rooms in enumerate(RUNTIME_FLOORS) for room in rooms}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: Path, name: str, modules: dict) -> set[str]:
    """Every lightning_pp module ``path`` imports, at module level or inside functions (not in
    ``if TYPE_CHECKING:`` blocks, which never run). ``from package import name`` counts as an
    import of the submodule ``package.name`` when that is a module, else of the package."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def visit(node):
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("lightning_pp"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            if base.startswith("lightning_pp"):
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    found.add(sub if sub in modules else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m for m in found if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, name, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def strong(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
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
            if len(component) > 1 or v in graph[v]:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return cycles


def _layer(module: str):
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def test_no_import_cycle_between_modules_counting_imports_inside_functions():
    graph = _graph()
    # Packages' own __init__ may import their submodules (their public API); a submodule importing
    # its package's __init__ back would close a cycle, and is counted.
    assert _cycles(graph) == []


def test_no_module_imports_a_higher_layer():
    upward = [(a, b) for a, targets in _graph().items() for b in targets
              if _layer(a) is not None and _layer(b) is not None and _layer(b) > _layer(a)]
    assert upward == []


def _runtime_room(module: str):
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "runtime" else None


def test_every_runtime_room_has_a_floor():
    rooms = {_runtime_room(m) for m in _modules()} - {None}
    assert sorted(rooms - set(RUNTIME_FLOOR)) == []


def test_no_runtime_import_runs_back_up_between_its_rooms():
    upward = [(a, b) for a, targets in _graph().items() for b in targets
              if _runtime_room(a) in RUNTIME_FLOOR and _runtime_room(b) in RUNTIME_FLOOR
              and RUNTIME_FLOOR[_runtime_room(b)] > RUNTIME_FLOOR[_runtime_room(a)]]
    assert upward == []


def test_the_lower_layers_do_not_import_lightning():
    offenders = []
    for name, path in _modules().items():
        parts = name.split(".")
        if len(parts) < 2 or parts[1] not in NO_LIGHTNING:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{name}: {n}" for n in names if n.split(".")[0] in ("lightning", "pytorch_lightning")]
    assert offenders == []


def test_the_checker_finds_a_cycle_and_an_upward_import():
    # the checker itself: a two-module cycle and a layer violation in a made-up graph
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    assert _layer("lightning_pp.strategies.core") > _layer("lightning_pp.runtime.build")
    assert RUNTIME_FLOOR[_runtime_room("lightning_pp.runtime.step.executor")] > RUNTIME_FLOOR[
        _runtime_room("lightning_pp.runtime.dp.sharding")]


def test_no_test_module_imports_another():
    """Fixtures live in the helper modules (tests/README.md): a test file importing another test
    file runs that file's module code in this one's collection and ties the two together."""
    tests = Path(__file__).resolve().parent
    offenders = []
    for path in sorted(tests.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0].startswith("test_")]
    assert offenders == []


def _executor_reaches(path: Path) -> set[str]:
    """Attributes read or written on anything named like an executor (``executor``, ``ex``,
    ``self._executor``, ``engine.executor``) in one module."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            owner = node.value
            name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
            if name in ("executor", "_executor", "ex"):
                found.add(node.attr)
    return found


def test_the_strategies_and_callbacks_use_only_the_executors_surface():
    from lightning_pp.runtime.step.executor import PipelineExecutor

    outside = [p for layer in ("strategies", "callbacks", "integrations", "moe") for p in (PACKAGE / layer).rglob("*.py")]
    reached = {f"{p.relative_to(PACKAGE)}: {attr}" for p in outside for attr in _executor_reaches(p)
               if attr not in PipelineExecutor.SURFACE}
    assert sorted(reached) == []
    # every name of the surface exists on an executor
    assert [n for n in PipelineExecutor.SURFACE if not hasattr(PipelineExecutor, n)
            and n not in PipelineExecutor.__init__.__code__.co_names] == []
