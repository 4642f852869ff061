"""safetensors 0.8's newer dtypes (issue 39 §6): F8_E4M3FNUZ, F8_E5M2FNUZ and F4 (two 4-bit values a byte).

The files are written by safetensors itself (``safetensors.torch.save_file``, 0.8.0 in the dev venv) and
``safetensors.torch.load_file`` is the oracle: ckptfix reads them (inspect, load_anywhere), converts them to
.pt and back, byte for byte.  safetensors records an F4 tensor's shape in values (its last dimension twice
torch's ``float4_e2m1fn_x2`` shape); a header whose F4 last dimension is odd is corrupt.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")

from helpers import run_cli  # noqa: E402

DTYPES = [d for d in ("float8_e4m3fnuz", "float8_e5m2fnuz", "float4_e2m1fn_x2") if hasattr(torch, d)]


def _make(path: Path, dtype: str) -> dict:
    raw = torch.arange(24, dtype=torch.uint8).reshape(2, 12) * 7
    sd = {"x": raw.view(getattr(torch, dtype)), "y": torch.ones(3)}
    st.save_file(sd, str(path))
    return sd


def _bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t


@pytest.mark.parametrize("dtype", DTYPES)
def test_new_dtypes_read_convert_and_round_trip(tmp_path: Path, dtype: str) -> None:
    src = tmp_path / "a.safetensors"
    sd = _make(src, dtype)
    oracle = st.load_file(str(src))
    assert oracle["x"].dtype == getattr(torch, dtype) and oracle["x"].shape == sd["x"].shape
    r = run_cli("inspect", str(src), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["dtypes"].get(dtype) == 1
    from ckptfix import load_anywhere

    got = load_anywhere(str(src))
    assert got["x"].dtype == oracle["x"].dtype and torch.equal(_bits(got["x"]), _bits(oracle["x"]))
    pt = tmp_path / "a.pt"
    r = run_cli("convert", str(src), "-o", str(pt))
    assert r.returncode == 0, r.stderr
    back = torch.load(pt, weights_only=True)
    assert back["x"].dtype == oracle["x"].dtype and torch.equal(_bits(back["x"]), _bits(oracle["x"]))
    again = tmp_path / "b.safetensors"
    r = run_cli("convert", str(pt), "-o", str(again))
    assert r.returncode == 0, r.stderr
    two = st.load_file(str(again))
    assert two["x"].shape == oracle["x"].shape and torch.equal(_bits(two["x"]), _bits(oracle["x"]))
    r = run_cli("strip-prefix", str(src), "-o", str(tmp_path / "s.safetensors"), "--prefix", "nothing.")
    assert r.returncode in (0, 3, 5, 6, 7), r.stderr  # (nothing to strip is its own message, never a crash)
    assert "internal error" not in r.stderr


def test_an_f4_tensor_with_an_odd_last_dimension_is_corrupt(tmp_path: Path) -> None:
    if "float4_e2m1fn_x2" not in DTYPES:
        pytest.skip("torch without float4_e2m1fn_x2")
    src = tmp_path / "a.safetensors"
    _make(src, "float4_e2m1fn_x2")
    data = src.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header["x"]["shape"] = [2, 23]
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (n - len(text))
    assert len(text) == n
    src.write_bytes(data[:8] + text + data[8 + n :])
    r = run_cli("inspect", str(src))
    assert r.returncode == 4 and "multiple of 2" in r.stderr, r.stderr
