"""The import graph of ``ckptfix.gpu``: every arrow points down a fixed stack of layers, so there is no cycle.

Imports inside functions count (they run sooner or later); ``if TYPE_CHECKING:`` imports do not.
"""

from __future__ import annotations

import ast
from pathlib import Path

import ckptfix.gpu

GPU = Path(ckptfix.gpu.__file__).parent

# lowest first: a module may import only modules of lower layers
LAYERS: list[set[str]] = [
    {"records", "runner", "cudainit", "leases"},  # records, running nvidia-smi, process state, lease files
    {"parse", "cvd", "order", "wheels"},  # pure parsers, CUDA's numbering rules, torch wheels' architectures
    {"smi", "diagnosis"},  # query = run + parse; problems of a view
    {"visible"},  # GpuView, build_view (selectors), visible_gpus
    {"pick", "doctor"},  # choose_gpus, doctor_report
    {"render"},  # the text of gpus / doctor
    {"__init__"},  # the public facade (pick_gpu)
]


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def gpu_imports(path: Path) -> set[str]:
    """The ``ckptfix.gpu`` submodules ``path`` imports (at any depth, not under ``TYPE_CHECKING``)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for n in node.orelse:
                visit(n)
            return
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "ckptfix.gpu":
                found.update(a.name for a in node.names if (GPU / f"{a.name}.py").exists())
            elif node.module.startswith("ckptfix.gpu."):
                found.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[2] for a in node.names if a.name.startswith("ckptfix.gpu."))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def test_every_gpu_module_has_a_layer():
    modules = {p.stem for p in GPU.glob("*.py")}
    placed = set().union(*LAYERS)
    assert modules == placed, f"place these in LAYERS: {modules - placed}; gone: {placed - modules}"


def test_every_import_points_down():
    layer = {m: i for i, mods in enumerate(LAYERS) for m in mods}
    up = []
    for p in sorted(GPU.glob("*.py")):
        for target in gpu_imports(p):
            if layer[target] >= layer[p.stem]:
                up.append(f"{p.stem} (layer {layer[p.stem]}) imports {target} (layer {layer[target]})")
    assert not up, "\n".join(up)


def test_the_gpu_package_never_imports_click():
    for p in GPU.glob("*.py"):
        assert "import click" not in p.read_text(), p
