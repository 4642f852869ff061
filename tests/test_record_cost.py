"""What one pickled record may cost (issue 33 §5, F5): an object memoized once and referenced many times.

The pickler stores a shared object once; every reader that expands it per reference must budget the
expansion by reference (each place it appears counts), never copy it first.  A command that cannot stay
within its budget refuses with a typed ``ResourceLimitError`` (exit 12) that names the budget and how to
raise it, before the work.  The memory ceiling is asserted only through a child under ``RLIMIT_AS``
(an address-space cap: a copy per reference fails there with MemoryError, exit 1), never by timing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

_CHILD = """
import resource, sys
cap = int(sys.argv[1]) << 20
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
from ckptfix.cli import main
sys.exit(main(sys.argv[2:]))
"""


def _capped(cap_mib: int, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-c", _CHILD, str(cap_mib), *map(str, args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _extra(path: Path) -> dict | None:
    import json

    from safetensors import safe_open

    with safe_open(str(path), "np") as f:
        meta = f.metadata()
        assert f.get_tensor("w").tolist() == [1.0, 1.0]
    return json.loads(meta["ckptfix.extra"]) if "ckptfix.extra" in meta else None


def test_a_string_shared_a_thousand_times_is_budgeted_by_reference(tmp_path):
    src = tmp_path / "shared.pt"
    torch.save({"w": torch.ones(2), "meta": ["x" * 10**6] * 1000}, src)  # 1 MB: the string is pickled once
    assert src.stat().st_size < 2 << 20
    out = tmp_path / "o.safetensors"
    # the JSON of the non-tensor entries would repeat the string 1000 times (1 GB): not built, not kept
    # (over ckptfix.extra's limit, as any larger one), the weights converted, within the cap
    r = _capped(768, "convert", src, "-o", out)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "not representable in metadata" in r.stderr
    assert _extra(out) is None
    r = _capped(768, "convert", src, "-o", tmp_path / "j.safetensors", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "characters of JSON" in r.stdout
    # the same string shared 10 times (10 MB of JSON) is within the limit: kept
    torch.save({"w": torch.ones(2), "meta": ["x" * 10**6] * 10}, src)
    r = _capped(768, "convert", src, "-o", out, "--force")
    assert r.returncode == 0, r.stderr[-2000:]
    assert _extra(out) == {"meta": ["x" * 10**6] * 10}


def test_the_json_budget_counts_each_place_a_shared_string_appears():
    from ckptfix.ops.convert.extras import _Extras
    from ckptfix.ops.convert.report import ConvertReport

    s = "y" * 1000

    def walk(v):
        ex = _Extras(None, ConvertReport(source="", outputs=[]), max_chars=100_000)
        ex.value(v, "x")
        return ex.too_big

    assert not walk({"a": [s] * 99})
    shared = [s] * 60  # one list, referenced twice: 120 places of the string
    assert walk({"a": shared, "b": shared})
    assert walk([{"k" * 60_000: 1}] * 2)  # a key, at each place too


def test_a_tensor_named_many_times_costs_each_row_what_it_lists(tmp_path):
    from ckptfix.ops.inspect import SHARED_WITH_MAX, inspect_checkpoint

    from helpers import run_cli

    src = tmp_path / "dict.pt"
    t = torch.zeros(2)
    torch.save({f"k{i}": t for i in range(20_000)}, src)  # one tensor under 20,000 names (memoized)
    r = inspect_checkpoint(src)
    assert len(r.tensors) == 20_000 and r.shared == [[f"k{i}" for i in range(20_000)]]
    assert all(len(row["shared_with"]) == SHARED_WITH_MAX for row in r.tensors)
    assert r.tensors[0]["shared_with"][:2] == ["k1", "k2"] and r.tensors[5]["shared_with"][:2] == ["k0", "k1"]
    out = run_cli("inspect", str(src), "--keys", "--limit", "2").stdout
    assert "shares storage with k1 (+19998)" in out
    assert "k0 = k1 = k2 = k3 = k4 = k5 = k6 = k7 (+19992 more)" in out
