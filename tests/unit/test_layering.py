"""The pure layers must not load torch: planners and schedules run with no cluster at all."""

from __future__ import annotations

import subprocess
import sys

import pytest

PURE = [
    "syncline",
    "syncline.train.config",
    "syncline.dp.config",
    "syncline.pipeline.config",
    "syncline.optim.config",
    "syncline.train.checkpoint_config",
    "syncline.registry",
    "syncline.models.registry",
    "syncline.data.registry",
    "syncline.data.files",
    "syncline.models.factory",
    "syncline.train.preflight",
    "syncline.dp.registry",
    "syncline.comm.registry",
    "syncline.cli.options",
    "syncline.errors",
    "syncline.extras",
    "syncline.dp.buckets",
    "syncline.comm.topology",
    "syncline.schedule",
    "syncline.launch.netns",
    "syncline.launch.devices",
    "syncline.launch.clusters",
    "syncline.launch.lifeline",
    "syncline.partition",
    "syncline.planner",
]


@pytest.mark.parametrize("module", PURE)
def test_pure_module_does_not_import_torch(module: str) -> None:
    code = f"import sys, {module}; assert 'torch' not in sys.modules, 'torch was loaded'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_only_comm_imports_torch_distributed() -> None:
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2] / "syncline"
    offenders = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(("comm/", "launch/", "testing/")):
            continue
        text = path.read_text()
        if "torch.distributed" in text and "import torch.distributed" in text:
            offenders.append(rel)
    assert offenders == []


# The layers, lowest first: a module may import its own layer and the ones below, never one
# above; subpackages of one layer must not import each other in a cycle. Imports inside
# functions and under TYPE_CHECKING count too.
LAYERS: list[tuple[str, ...]] = [
    ("syncline.errors", "syncline.extras"),
    ("syncline.fields", "syncline.registry"),
    ("syncline.schedule", "syncline.partition"),
    ("syncline.comm", "syncline.launch"),
    ("syncline.models", "syncline.data", "syncline.optim"),
    # syncline.hooks: the compressors as DDP communication hooks (beside the engine);
    # syncline.lightning: a Lightning strategy over the engine (imports Lightning itself)
    ("syncline.dp", "syncline.compression", "syncline.hooks", "syncline.lightning"),
    ("syncline.pipeline",),
    ("syncline.planner",),
    ("syncline.train",),
    # the harness runs the trainer in-process and spans its options (run_training, matrix)
    ("syncline.testing",),
    ("syncline.cli",),
]
#: the package's facade resolves its public names lazily and may name any layer
TOP = "syncline"


def _unit(module: str) -> str:
    """The layered unit a module belongs to (its subpackage, or a top-level module)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def _layer_of(unit: str) -> int:
    for i, units in enumerate(LAYERS):
        if unit in units:
            return i
    raise AssertionError(f"{unit} is in no layer: add it to LAYERS in {__file__}")


def _imports(path, module: str) -> list[tuple[str, int]]:
    """Every ``syncline`` module ``path`` imports, anywhere in the file, with its line."""
    import ast

    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")
                parent = parent[: len(parent) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            if base == TOP:  # ``from syncline import comm`` imports syncline.comm
                found += [(f"{TOP}.{a.name}", node.lineno) for a in node.names]
            else:
                found.append((base, node.lineno))
    return [(name, line) for name, line in found if name.split(".")[0] == "syncline"]


def _import_graph():
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2] / "syncline"
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        yield path, module, _imports(path, module)


def test_layers_only_import_downward() -> None:
    upward = []
    for path, module, imports in _import_graph():
        if module == TOP:
            continue
        here = _layer_of(_unit(module))
        for name, line in imports:
            target = _unit(name)
            if target == TOP:
                upward.append(f"{path.name}:{line} {module} imports the facade 'syncline'")
            elif _layer_of(target) > here:
                upward.append(
                    f"{module}:{line} imports {name} (layer {_layer_of(target)} > {here})"
                )
    assert upward == []


def test_no_import_cycle_between_subpackages() -> None:
    edges: dict[str, set[str]] = {}
    for _, module, imports in _import_graph():
        if module == TOP:
            continue
        for name, _ in imports:
            a, b = _unit(module), _unit(name)
            if a != b:
                edges.setdefault(a, set()).add(b)

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in edges.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    cycles = sorted(unit for unit in edges if unit in reach(unit))
    assert cycles == [], f"subpackages in an import cycle: {cycles}"


MAX_NONBLANK_LINES = 500


def test_no_oversized_module() -> None:
    """Small modules with one job each: none in the package or the benchmarks over 500
    non-blank lines (split it by job instead)."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]
    sizes = {
        str(path.relative_to(root)): sum(
            1 for line in path.read_text().splitlines() if line.strip()
        )
        for folder in ("syncline", "benchmarks")
        for path in (root / folder).rglob("*.py")
    }
    assert sizes, "no module found"
    assert {p: n for p, n in sizes.items() if n > MAX_NONBLANK_LINES} == {}
