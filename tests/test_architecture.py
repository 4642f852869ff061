"""The layers of docs/architecture.md, checked on the import graph (every import, in functions too).

An import from a higher layer than the importer's is an upward arrow: there are none, and no two
packages import each other, directly or round a loop.  What a lower layer dispatches to above it is
named as a string in ``formats.registry.FORMATS`` and imported at dispatch.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator

PKG = Path(__file__).resolve().parents[1] / "ckptfix"

#: each folder of the package, and the modules at its root (the ground), with its floor: a folder imports only
#: the ground, the floors below it and itself (docs/architecture.md)
GROUND = ["errors", "text", "display", "_torch", "_startup", "_version"]
LAYERS = {
    **dict.fromkeys(GROUND, 0),
    "files": 1,  # bytes, local or remote
    "pickles": 2,  # the pickle policy, opcode simulation, records, stubs
    "formats": 3,  # containers read torch-free, framework layouts, the state dict in an object graph
    "ops": 4,  # inspect, scan, load, convert, rewrite, sanitize, prefixes
    "gpu": 0.5,  # beside the checkpoint side: the ground below it, nothing of the checkpoint side above
    "train": 5,
    "cli": 6,
    "__main__": 7,
}

#: (importer, imported) package pairs that still point up: none left (keep it empty)
KNOWN_UPWARD: set[tuple[str, str]] = set()


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


def _imports() -> Iterator[tuple[str, str, str]]:
    """(importer module, imported ckptfix module, the name as written) for every import, in functions too."""
    mods = _modules()
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[: len(base) - node.level + 1]
                    b = ".".join(base + ([node.module] if node.module else []))
                else:
                    b = node.module or ""
                targets = [f"{b}.{a.name}" if f"{b}.{a.name}" in mods else b for a in node.names]
            for t in targets:
                name = t
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t.startswith("ckptfix") and t != mod:
                    yield mod, t, name


def _edges() -> set[tuple[str, str, str, str]]:
    """(importer package, imported package, importer module, imported name) for every ckptfix import."""
    out = set()
    for mod, t, name in _imports():
        src, dst = mod.split(".")[1:2] or ["ckptfix"], t.split(".")[1:2] or ["ckptfix"]
        if src != dst and src[0] != "ckptfix":  # the facade (ckptfix/__init__.py) may name anything
            out.add((src[0], dst[0], mod, name))
    return out


def test_every_package_has_a_layer():
    pkgs = {a for a, *_ in _edges()} | {b for _, b, *_ in _edges()}
    assert pkgs - {"ckptfix"} <= set(LAYERS), sorted(pkgs - {"ckptfix"} - set(LAYERS))


def test_every_arrow_points_down():
    """No module below the facade imports it (the version is ckptfix._version, at the ground)."""
    up = {}
    for a, b, mod, name in _edges():
        assert b != "ckptfix", (mod, name)
        if LAYERS[b] > LAYERS[a]:
            up.setdefault((a, b), []).append(mod)
    assert set(up) - KNOWN_UPWARD == set(), {k: v for k, v in up.items() if k not in KNOWN_UPWARD}
    assert KNOWN_UPWARD - set(up) == set(), "an arrow is gone: delete it from KNOWN_UPWARD"


def test_the_dcp_reader_imports_nothing_else_of_the_formats():
    """formats/dcp/ (the DCP format's reader) imports nothing from the rest of formats/ or any operation, except the
    adapter to a CheckpointFile, formats/dcp/checkpoint.py."""
    bad = [
        (mod, t)
        for mod, t, _name in _imports()
        if mod.startswith("ckptfix.formats.dcp")
        and mod != "ckptfix.formats.dcp.checkpoint"
        and (
            t.startswith("ckptfix.ops") or (t.startswith("ckptfix.formats") and not t.startswith("ckptfix.formats.dcp"))
        )
    ]
    assert not bad, bad


def test_gpu_and_the_checkpoint_side_do_not_meet():
    checkpoint_side = {k for k, v in LAYERS.items() if 1 <= v <= 4}
    assert not [(m, n) for a, b, m, n in _edges() if a == "gpu" and b in checkpoint_side]
    assert not [(m, n) for a, b, m, n in _edges() if a in checkpoint_side and b == "gpu"]


def _components(edges: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one package."""

    def reach(a: str) -> set[str]:
        seen, todo = set(), [a]
        while todo:
            for b in edges.get(todo.pop(), ()):
                if b not in seen:
                    seen.add(b)
                    todo.append(b)
        return seen

    out: list[set[str]] = []
    for a in sorted(edges):
        comp = {a} | {b for b in reach(a) if a in reach(b)}
        if len(comp) > 1 and comp not in out:
            out.append(comp)
    return out


def test_no_package_cycles_in_a_layer():
    edges: dict[str, set[str]] = {}
    for a, b, *_ in _edges():
        if b != "ckptfix" and LAYERS[a] == LAYERS[b]:
            edges.setdefault(a, set()).add(b)
    assert _components(edges) == []


def test_no_package_level_strongly_connected_component():
    """Across all layers, counting in-function imports: no two packages reach each other."""
    edges: dict[str, set[str]] = {}
    for a, b, *_ in _edges():
        if b != "ckptfix":
            edges.setdefault(a, set()).add(b)
    assert _components(edges) == []


def _module_edges() -> dict[str, set[str]]:
    """importer module -> imported modules (in functions too), the facade left out."""
    out: dict[str, set[str]] = {}
    for mod, t, _name in _imports():
        if t.startswith("ckptfix.") and mod != "ckptfix":
            out.setdefault(mod, set()).add(t)
    return out


def test_module_cycles_stay_inside_one_package():
    """A cycle of modules (counting in-function imports) never spans packages (it did: formats, inspecting,
    loading, deepspeed, frameworks and convert/ were one); inside convert/ the router and its directions
    still call each other."""
    comps = _components(_module_edges())
    assert [c for c in comps if len({m.split(".")[1] for m in c}) > 1] == []
