"""What type checkers see of the lazy packages equals what they load: ``from ckptfix import load_anywhere`` is
the real function to mypy and pyright, not ``Any`` (the ``if TYPE_CHECKING:`` blocks of ckptfix/__init__.py and
ckptfix/gpu/__init__.py name exactly the lazy tables' entries)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import ckptfix
import ckptfix.gpu

REPO = Path(__file__).resolve().parents[1]


def _type_checking_imports(path: Path) -> dict[str, str]:
    """name -> module of every ``from MODULE import NAME [as NAME]`` under a top-level ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom) and imp.module, ast.dump(imp)
                for alias in imp.names:
                    out[alias.asname or alias.name] = imp.module
    return out


def test_ckptfix_type_checking_block_is_the_lazy_table():
    seen = _type_checking_imports(REPO / "ckptfix" / "__init__.py")
    assert seen == ckptfix._LAZY


def test_ckptfix_type_checking_names_are_explicit_reexports():
    """``import X as X``: mypy --strict (no implicit re-export) accepts ``from ckptfix import X``."""
    tree = ast.parse((REPO / "ckptfix" / "__init__.py").read_text(encoding="utf-8"))
    block = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING")
    for imp in block.body:
        assert isinstance(imp, ast.ImportFrom)
        assert all(a.asname == a.name for a in imp.names), ast.unparse(imp)


def test_gpu_type_checking_block_is_the_lazy_table():
    seen = _type_checking_imports(REPO / "ckptfix" / "gpu" / "__init__.py")
    lazy = {n: "ckptfix.gpu.pick" for n in ckptfix.gpu._FROM_PICK}
    lazy.update({n: "ckptfix.gpu.leases" for n in ckptfix.gpu._FROM_LEASES})
    assert seen == lazy
    assert set(lazy) <= set(ckptfix.gpu.__all__)  # a literal __all__: re-exported to type checkers


@pytest.mark.parametrize("name", sorted(ckptfix._LAZY))
def test_each_lazy_name_is_the_object_of_its_module(name):
    assert getattr(ckptfix, name) is getattr(importlib.import_module(ckptfix._LAZY[name]), name)
