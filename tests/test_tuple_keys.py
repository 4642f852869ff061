"""A state dict whose keys are not strings (``torch.save({("enc", 0): t})``, a real shape): every command says
what the keys are, in user terms; none dies inside."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from safetensors.torch import load_file  # noqa: E402

import ckptfix  # noqa: E402
from ckptfix.errors import UnsupportedError  # noqa: E402

from helpers import run_cli  # noqa: E402


@pytest.fixture
def tk(tmp_path):
    torch.save({("enc", 0): torch.ones(2), ("enc", 1): torch.zeros(3), "head": torch.ones(1)}, tmp_path / "tk.pt")
    return tmp_path


def test_load_anywhere_gives_the_keys_as_saved(tk):
    sd = ckptfix.load_anywhere(str(tk / "tk.pt"))
    assert list(sd) == [("enc", 0), ("enc", 1), "head"]


def test_load_anywhere_with_a_model_refuses_in_user_terms(tk):
    with pytest.raises(UnsupportedError) as e:
        ckptfix.load_anywhere(str(tk / "tk.pt"), model=torch.nn.Linear(2, 1))
    msg = str(e.value)
    assert msg.startswith(str(tk / "tk.pt")) and "not a string (('enc', 0), a tuple)" in msg
    assert "without model=" in msg


def test_convert_names_the_keys_it_turned_into_strings(tk):
    r = run_cli("convert", "tk.pt", "-o", "out.safetensors", cwd=tk)
    assert r.rc == 0, r.err
    assert "2 tensor key(s) that are not strings (('enc', 0), ...: tuple)" in r.err
    assert set(load_file(str(tk / "out.safetensors"))) == {"('enc', 0)", "('enc', 1)", "head"}


@pytest.mark.parametrize("argv", [["strip-prefix", "tk.pt", "-o", "o.pt"], ["add-prefix", "tk.pt", "--prefix", "m."]])
def test_rewrites_refuse_with_one_line(tk, argv):
    r = run_cli(*argv, cwd=tk)
    assert r.rc == 8, r.err
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and "not a string" in lines[0] and "Traceback" not in r.err
