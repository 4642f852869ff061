"""No public function of ckptfix returns ``Any``: users' type checkers see what they get.

Public: a module-level function, or a method of a module-level class, whose name and module path have
no leading underscore (``__init__`` modules count as their package).  A return annotated ``Any`` (or a
union with ``Any`` in it) is refused unless listed in :data:`JUSTIFIED` with its reason; ``object``
or a precise type says more.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "ckptfix"

_UNPICKLER = "overrides pickle.Unpickler, whose typeshed signature returns Any (any pickled value)"

#: "module:qualname" -> why it returns Any
JUSTIFIED = {
    "ckptfix.formats.dcp.meta:MetadataUnpickler.find_class": _UNPICKLER,
    "ckptfix.formats.dcp.meta:MetadataUnpickler.persistent_load": _UNPICKLER,
    "ckptfix.pickles.reader:RecordingUnpickler.load": _UNPICKLER,
    "ckptfix.pickles.reader:RecordingUnpickler.find_class": _UNPICKLER,
    "ckptfix.pickles.reader:RecordingUnpickler.persistent_load": _UNPICKLER,
    "ckptfix.pickles.writer:RecordPickler.reducer_override": "overrides pickle.Pickler (typeshed: Any)",
    "ckptfix.formats.statedict:at_path": "the value at a key path of an unpickled object graph: whatever the file "
    "holds there; each caller narrows it to what it looked up (a state dict, a tensor)",
    "ckptfix.pickles.subclass:encode_attribute": "a torchao attribute as JSON data: whatever JSON value torchao's "
    "encoder writes for it (a list, a dict, a number)",
    "ckptfix.pickles.subclass:decode_attribute": "the inverse of encode_attribute: whatever the pickle held there",
    **{
        f"ckptfix.ops.load:load_{fmt}": "a format's loader in the capability table: whatever torch.load / "
        "torch.jit.load / safetensors give for that file, narrowed by load_checkpoint"
        for fmt in ("zip", "legacy", "pickle", "safetensors", "sharded", "tar", "torchscript", "dcp_directory")
    },
    "ckptfix.formats.base:CheckpointFile.state_root": "the unpickled object graph (whatever the file holds) "
    "or a TorchScript archive's state dict; callers narrow it (the format registry rework owns this class)",
}


def _mentions_any(node: ast.expr | None) -> bool:
    if node is None:
        return False
    if isinstance(node, ast.Constant) and isinstance(node.value, str):  # a string annotation
        try:
            node = ast.parse(node.value, mode="eval").body
        except SyntaxError:
            return False
    if isinstance(node, ast.Name):
        return node.id == "Any"
    if isinstance(node, ast.Attribute):
        return node.attr == "Any"
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _mentions_any(node.left) or _mentions_any(node.right)
    if isinstance(node, ast.Subscript) and ast.unparse(node.value) in ("Optional", "typing.Optional", "Union"):
        inner = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        return any(_mentions_any(e) for e in inner)
    return False  # Any inside a container (dict[str, Any]) says what the container is


def _public_functions() -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    out = []
    for path in sorted(PKG.rglob("*.py")):
        parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        if any(p.startswith("_") for p in parts):
            continue
        mod = ".".join(parts)
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                out.append((f"{mod}:{node.name}", node))
            elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                for m in node.body:
                    if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and not m.name.startswith("_"):
                        out.append((f"{mod}:{node.name}.{m.name}", m))
    return out


def test_no_public_function_returns_any() -> None:
    found = {name for name, fn in _public_functions() if _mentions_any(fn.returns)}
    assert found - set(JUSTIFIED) == set(), "return a precise type or object, or justify it in JUSTIFIED"
    assert set(JUSTIFIED) - found == set(), "no longer returns Any: remove it from JUSTIFIED"


def test_the_checker_sees_the_forms_of_any() -> None:
    def ret(src: str) -> ast.expr | None:
        fn = ast.parse(src).body[0]
        assert isinstance(fn, ast.FunctionDef)
        return fn.returns

    assert _mentions_any(ret("def f() -> Any: ..."))
    assert _mentions_any(ret("def f() -> typing.Any: ..."))
    assert _mentions_any(ret("def f() -> 'Any': ..."))
    assert _mentions_any(ret("def f() -> Any | None: ..."))
    assert _mentions_any(ret("def f() -> Optional[Any]: ..."))
    assert not _mentions_any(ret("def f() -> dict[str, Any]: ..."))
    assert not _mentions_any(ret("def f() -> object: ..."))
    assert not _mentions_any(ret("def f(): ..."))
