"""DCP folders saved with torch's ZStandard extension (issue 37 §10): read with the ``zstandard`` package (the
``[zstd]`` extra), else refused naming the extra.

The fixture (tests/fixtures/frameworks/make_dcp_zstd.py) was written by torch 2.13's
``FileSystemWriter(_extensions=[ZStandard()])``; ``dcp_zstd.expected.safetensors`` is what torch's ``dcp.load``
read back.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from ckptfix.errors import UnsupportedError
from ckptfix.ops.convert import convert

FIX = Path(__file__).parent / "fixtures" / "frameworks"
ZDCP = FIX / "dcp_zstd"


def _tensors(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    body = raw[8 + n :]
    return {k: (v["dtype"], v["shape"], body[v["data_offsets"][0] : v["data_offsets"][1]]) for k, v in header.items()}


def test_zstd_dcp_converts_bit_equal_to_dcp_load(tmp_path: Path) -> None:
    pytest.importorskip("zstandard")
    out = tmp_path / "z.safetensors"
    r = convert(ZDCP, out)
    assert r.verified and r.tensors == 3
    assert _tensors(out) == _tensors(Path(f"{ZDCP}.expected.safetensors"))


def test_zstd_dcp_loads_with_load_anywhere() -> None:
    pytest.importorskip("zstandard")
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    from ckptfix import load_anywhere

    exp = load_file(f"{ZDCP}.expected.safetensors")
    lc = load_anywhere(ZDCP)
    assert lc["step"] == 7
    for k, v in exp.items():
        assert torch.equal(lc[k], v) and lc[k].dtype == v.dtype, k


def test_without_zstandard_the_extra_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "zstandard" else real(n, *a))
    with pytest.raises(UnsupportedError, match=r"ZStandard extension .*the zstd extra\): pip install zstandard"):
        convert(ZDCP, tmp_path / "z.safetensors")
    assert not (tmp_path / "z.safetensors").exists()
