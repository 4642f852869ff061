"""docs/gen_docs.py runs each page in its own empty directory and prints paths as users see them (issue 23)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

GEN = Path(__file__).resolve().parents[1] / "docs" / "gen_docs.py"


def _gen():
    spec = importlib.util.spec_from_file_location("gen_docs_under_test", GEN)
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_each_page_starts_in_its_own_empty_directory():
    gen = _gen()
    a, b = gen.Sandbox(), gen.Sandbox()
    try:
        assert a.run("ls -A") == "" and b.run("ls -A") == ""  # nothing of the generator's in the page's folder
        a.run("touch made-by-page-a")
        assert b.run("ls -A") == ""
        assert a.dir != b.dir
    finally:
        a.close()
        b.close()


def test_folder_names_are_not_rewritten():
    gen = _gen()
    box = gen.Sandbox()
    try:
        assert box.run("pwd") == str(box.dir)
        assert box.run("echo $PWD/x") == f"{box.dir}/x"
    finally:
        box.close()
