"""``inspect --keys``: one line per tensor (name, shape, dtype, device, what it shares), a filter, paging; the
rows always in ``--json``; ``scan`` summarising a long list of safe globals (issue #38 item 3).

The checkpoints are written by torch at test time; torch's own view of them (``torch.load``) is the oracle.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ckptfix.ops.inspect import inspect_checkpoint, tensor_name_matches

from helpers import run_cli

torch = pytest.importorskip("torch")
nn = torch.nn

FIX = Path(__file__).parent / "fixtures" / "frameworks" / "deepspeed"


def _gpt_like(path: Path) -> dict:
    """A small model with a tied head, a 0-dim buffer and a half tensor, saved with torch.save."""
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    m = nn.ModuleDict({"wte": emb, "ln": nn.LayerNorm(4), "lm_head": head})
    sd = m.state_dict()
    sd["step"] = torch.tensor(7)
    sd["half"] = torch.zeros(2, 3, dtype=torch.float16)
    torch.save(sd, path)
    return torch.load(path, weights_only=True)


def _row(line: str) -> list[str]:
    return line.split()


def test_keys_lists_name_shape_dtype_device_as_torch_sees_them(tmp_path):
    ref = _gpt_like(tmp_path / "m.pt")
    p = run_cli("inspect", str(tmp_path / "m.pt"), "--keys")
    assert p.rc == 0, p.err
    lines = p.out.splitlines()
    start = next(i for i, x in enumerate(lines) if x.startswith("  tensors"))
    assert lines[start].split() == ["tensors", str(len(ref))]
    rows = lines[start + 1 : start + 1 + len(ref)]
    for line, (name, t) in zip(rows, ref.items(), strict=True):
        cells = line.split("  ")
        cells = [c.strip() for c in cells if c.strip()]
        assert cells[:4] == [name, str(list(t.shape)), str(t.dtype).removeprefix("torch."), str(t.device)], line
    tied = {r.split()[0]: r for r in rows}
    assert "shares storage with lm_head.weight" in tied["wte.weight"]
    assert "shares storage with wte.weight" in tied["lm_head.weight"]
    assert "shares" not in tied["ln.weight"]
    assert "[]" in tied["step"]  # a 0-dim tensor: torch.Size([])
    assert run_cli("inspect", str(tmp_path / "m.pt"), "-v").out == p.out
    assert "\n  tensors " not in run_cli("inspect", str(tmp_path / "m.pt")).out  # the summary alone by default


def test_json_always_has_the_rows(tmp_path):
    ref = _gpt_like(tmp_path / "m.pt")
    doc = json.loads(run_cli("inspect", str(tmp_path / "m.pt"), "--json").out)
    assert [r["name"] for r in doc["tensors"]] == list(ref)
    by = {r["name"]: r for r in doc["tensors"]}
    for name, t in ref.items():
        assert by[name]["shape"] == list(t.shape)
        assert by[name]["dtype"] == str(t.dtype).removeprefix("torch.")
        assert by[name]["device"] == "cpu"
    assert by["wte.weight"]["shared_with"] == ["lm_head.weight"] and by["ln.bias"]["shared_with"] == []
    assert doc["tensor_filter"] is None
    from test_schemas import validate

    validate(doc, "inspect")


def test_filter_glob_or_substring_and_the_counts_stay_whole(tmp_path):
    _gpt_like(tmp_path / "m.pt")
    p = run_cli("inspect", str(tmp_path / "m.pt"), "--filter", "*.weight")
    assert p.rc == 0, p.err
    assert "tensors       3 of 6 match '*.weight'" in p.out
    assert "ln.bias" not in p.out.split("  tensors")[1]
    doc = json.loads(run_cli("inspect", str(tmp_path / "m.pt"), "--filter", "ln", "--json").out)
    assert [r["name"] for r in doc["tensors"]] == ["ln.weight", "ln.bias"]
    assert doc["tensor_count"] == 6 and doc["tensor_filter"] == "ln"
    assert tensor_name_matches("layer1.0.conv1.weight", "layer1.*.weight")
    assert not tensor_name_matches("layer10.conv.weight", "layer1.?.weight")
    assert tensor_name_matches("encoder.layer.3.attn", "layer.3")


def test_a_long_listing_shows_the_first_n_and_a_count(tmp_path):
    torch.save({f"blocks.{i}.w": torch.zeros(i % 3 + 1) for i in range(120)}, tmp_path / "long.pt")
    p = run_cli("inspect", str(tmp_path / "long.pt"), "--keys")
    listed = [x for x in p.out.splitlines() if x.startswith("    blocks.")]
    assert len(listed) == 50 and listed[0].split()[0] == "blocks.0.w"
    assert "    ... 70 more (--limit 0 lists all" in p.out
    p = run_cli("inspect", str(tmp_path / "long.pt"), "--keys", "--limit", "0")
    assert len([x for x in p.out.splitlines() if x.startswith("    blocks.")]) == 120 and "more" not in p.out
    doc = json.loads(run_cli("inspect", str(tmp_path / "long.pt"), "--json", "--limit", "5").out)
    assert len(doc["tensors"]) == 120  # --json is data: never paged


def test_cuda_tags_are_the_device_column(tmp_path):
    from helpers import tagged

    with tagged("cuda:3"):
        torch.save({"w": torch.zeros(2, 2)}, tmp_path / "c3.pt")
    r = inspect_checkpoint(tmp_path / "c3.pt")
    assert r.tensors == [
        {"name": "w", "shape": [2, 2], "dtype": "float32", "device": "cuda:3", "shared_with": [], "shared_count": 0}
    ]


def test_a_consolidated_zero_folder_lists_its_shapes():
    d = FIX / "zero2_fp32"
    expected = json.loads((d / "expected.json").read_text())
    from safetensors import safe_open

    with safe_open(str(d / "expected.safetensors"), "np") as f:
        shapes = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
    r = inspect_checkpoint(d)
    got = {t["name"]: t["shape"] for t in r.tensors}
    assert {k: got[k] for k in shapes} == shapes, expected
    assert all(t["device"] is None for t in r.tensors)


def test_scan_summarises_a_long_list_of_safe_globals(tmp_path):
    src = tmp_path / "mk.py"
    src.write_text(
        "import torch, torch.nn as nn\n"
        "class B(nn.Module):\n"
        "    def __init__(s):\n"
        "        super().__init__(); s.l = nn.Linear(2, 2); s.c = nn.Conv2d(1, 1, 1); s.n = nn.BatchNorm1d(2)\n"
        "    def forward(s, x):\n"
        "        return s.l(x)\n"
        "torch.jit.save(torch.jit.script(nn.Sequential(B(), B())), r'%s')\n" % (tmp_path / "ts.pt")
    )
    import runpy

    runpy.run_path(str(src))
    p = run_cli("scan", str(tmp_path / "ts.pt"), "--limit", "2")
    lines = p.out.splitlines()
    safe = [x for x in lines if x.startswith("  safe ")]
    assert len(safe) == 2
    assert any(x.startswith("  unknown   torch.jit._pickle.build_intlist") for x in lines)  # never hidden
    n = int(lines[0].split(", ")[-1].split()[0])
    more = [x for x in lines if x.startswith("  ... ")]
    shown = [x for x in lines[1:] if x.startswith(("  safe ", "  unknown ", "  dangerous "))]
    assert more and more[0].startswith(f"  ... {n - len(shown)} more safe globals, ")  # every global counted once
    assert "TorchScript classes (__torch__.*)" in more[0]
    full = run_cli("scan", str(tmp_path / "ts.pt"), "--limit", "0").out
    assert "more safe globals" not in full and len(full.splitlines()) == n + 1
    doc = json.loads(run_cli("scan", str(tmp_path / "ts.pt"), "--json", "--limit", "2").out)
    assert len(doc["globals"]) == n


def test_many_views_of_one_storage_cost_linear_memory(tmp_path):
    """30,000 views of one storage (``{f'v{i}': s[i % 7:]}``, 2.4 MB): every row named the 29,999 others (900
    million names: MemoryError at 3.8 GiB).  Now a row names at most SHARED_WITH_MAX of them and counts the rest;
    run in a child process under a 1 GiB address-space limit (no wall-clock assertion)."""
    import resource
    import subprocess
    import sys

    s = torch.zeros(16384)
    p = tmp_path / "views.pt"
    torch.save({f"v{i}": s[i % 7 :] for i in range(30000)}, p)
    ref = torch.load(p, weights_only=True)
    assert len({t.untyped_storage().data_ptr() for t in ref.values()}) == 1  # the oracle: one storage

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    for extra in ([], ["--json"]):
        r = subprocess.run(
            [sys.executable, "-m", "ckptfix", "inspect", str(p), *extra],
            capture_output=True, text=True, preexec_fn=limit, env=env, timeout=600,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr[-500:]
        assert "MemoryError" not in r.stderr
    from ckptfix.ops.inspect import SHARED_WITH_MAX

    doc = json.loads(r.stdout)
    rows = {t["name"]: t for t in doc["tensors"]}
    assert len(rows) == 30000 and [len(g) for g in doc["shared"]] == [30000]
    assert rows["v5"]["shared_count"] == 29999 and len(rows["v5"]["shared_with"]) == SHARED_WITH_MAX
    assert "v5" not in rows["v5"]["shared_with"]
    p.unlink()
