"""DeepSpeed ZeRO and HuggingFaceStorageWriter folders convert without torch (and without numpy for --dtype).

The fixtures are tests/fixtures/frameworks/ (see tests/test_zero.py and tests/test_hfstorage.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from notorch_helpers import FIXTURES, clean_env, read_safetensors

ZERO = FIXTURES / "frameworks" / "deepspeed"
HF = FIXTURES / "frameworks" / "hfstorage"


@pytest.mark.parametrize("case", ["zero1_bf16", "zero2_fp32", "zero3_fp32", "zero3_frozen"])
def test_zero_convert_without_torch(cli, tmp_path: Path, case: str) -> None:
    out = tmp_path / "m.safetensors"
    r = cli("convert", str(ZERO / case), "-o", str(out))
    assert r.rc == 0, r.err
    got, exp = read_safetensors(out), read_safetensors(ZERO / case / "expected.safetensors")
    shared = dict(json.loads((ZERO / case / "expected.json").read_text())["shared_params"])
    assert set(got) == set(exp) - set(shared)
    for k, v in exp.items():
        assert got[shared.get(k, k)] == v, k


def test_zero_dtype_bf16_without_torch_or_numpy(cli, tmp_path: Path) -> None:
    """The pure-Python rounding path: the same bytes as with numpy (checked against torch in tests/test_zero.py)."""
    out = tmp_path / "m.safetensors"
    env = clean_env(tmp_path)
    blocker = tmp_path / "blk"
    blocker.mkdir()
    (blocker / "numpy.py").write_text("raise ImportError('numpy blocked for this test')\n")
    env["PYTHONPATH"] = f"{blocker}:{env['PYTHONPATH']}"
    r = cli("convert", str(ZERO / "zero2_bf16"), "-o", str(out), "--dtype", "bf16", env=env)
    assert r.rc == 0, r.err
    got = read_safetensors(out)
    assert got["embed.weight"][0] == "BF16" and got["steps"][0] == "I64"
    # bf16 of an fp32 value: its top 16 bits, rounded to nearest even
    exp = read_safetensors(ZERO / "zero2_bf16" / "expected.safetensors")["norm.bias"][2]
    want = b""
    for i in range(0, len(exp), 4):
        u = int.from_bytes(exp[i : i + 4], "little")
        want += (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF).to_bytes(2, "little")
    assert got["norm.bias"][2] == want


def test_hf_storage_without_torch(cli, tmp_path: Path) -> None:
    out = tmp_path / "m.safetensors"
    r = cli("convert", str(HF / "run"), "-o", str(out))
    assert r.rc == 0, r.err
    assert out.read_bytes() == (HF / "expected" / "model-00001-of-00001.safetensors").read_bytes()
