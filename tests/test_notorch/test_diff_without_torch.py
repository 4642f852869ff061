"""``ckptfix diff`` without torch (issue 35): bit equality and the first differing element, and a line saying how
to get the statistics; torch (and numpy) never imported, not even tried.

The checkpoints: tests/fixtures/ckpt (written by torch) and safetensors files written here by hand.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

from notorch_helpers import CKPT, clean_env

# torch blocked (``import torch`` fails, find_spec says absent), and every attempt to import torch or numpy recorded;
# the attempts are printed to stderr at exit as one line
RUNNER = (
    "import sys, builtins, atexit\n"
    "sys.modules['torch'] = None\n"
    "tried = []\n"
    "_imp = builtins.__import__\n"
    "def guard(name, *a, **k):\n"
    "    if name.split('.')[0] in ('torch', 'numpy'):\n"
    "        tried.append(name)\n"
    "    return _imp(name, *a, **k)\n"
    "builtins.__import__ = guard\n"
    "def report():\n"
    "    top = ('torch', 'numpy')\n"
    "    loaded = sorted(m for m, v in sys.modules.items() if v is not None and m.split('.')[0] in top)\n"
    "    sys.stderr.write(f'IMPORTS {sorted(set(tried))} {loaded}\\n')\n"
    "atexit.register(report)\n"
    "from ckptfix.cli import main\n"
    "rc = main(sys.argv[1:])\n"
    "sys.stdout.flush()\n"
    "sys.exit(rc)\n"
)


def _run(tmp_path: Path, *args: str) -> tuple[int, str, str]:
    p = subprocess.run(
        [sys.executable, "-c", RUNNER, *args], env=clean_env(tmp_path), capture_output=True, text=True, timeout=120
    )
    last = p.stderr.strip().splitlines()[-1]
    assert last == "IMPORTS [] []", p.stderr  # torch and numpy: never tried, never loaded
    return p.returncode, p.stdout, p.stderr


def _save(path: Path, tensors: dict[str, list[float]]) -> None:
    """A safetensors file of F32 vectors, written by hand."""
    header: dict[str, object] = {}
    body = b""
    for name, values in tensors.items():
        data = struct.pack(f"<{len(values)}f", *values)
        header[name] = {"dtype": "F32", "shape": [len(values)], "data_offsets": [len(body), len(body) + len(data)]}
        body += data
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + body)


def test_equal_across_containers_without_torch(tmp_path: Path) -> None:
    for name in ("ddp.pth", "legacy.pth", "lightning.ckpt", "sharded"):
        rc, out, _ = _run(tmp_path, "diff", str(CKPT / name), str(CKPT / "model.safetensors"))
        assert rc == 0, out
        assert out.strip().splitlines()[-1] == "0 of 3 tensors differ; 0 missing; 0 extra"
    rc, out, _ = _run(tmp_path, "diff", str(CKPT / "ddp.pth"), str(CKPT / "model.safetensors"))
    assert "keys: strip 'module.'" in out and "pip install" not in out


def test_differing_bytes_first_position_and_how_to_get_statistics(tmp_path: Path) -> None:
    a = [float(i) for i in range(1000)]
    b = list(a)
    b[517] += 0.5
    b[900] = -1.0
    _save(tmp_path / "a.safetensors", {"w": a, "same": a[:10]})
    _save(tmp_path / "b.safetensors", {"w": b, "same": a[:10]})
    rc, out, _ = _run(tmp_path, "diff", str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors"))
    assert rc == 1
    assert "w: bytes differ from element 517" in out
    assert "bit-identical: 1 tensors" in out
    assert "pip install torch" in out  # how to get the statistics
    assert out.strip().splitlines()[-1] == "1 of 2 tensors differ (first at w); 0 missing; 0 extra"
    rc, out, _ = _run(tmp_path, "diff", str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors"), "--json")
    doc = json.loads(out)
    assert rc == 1 and doc["statistics"] == "none" and doc["equal"] is False
    w = next(t for t in doc["tensors"] if t["name"] == "w")
    assert w["status"] == "differ" and w["first_diff"] == 517 and w["max_abs"] is None
    assert any("pip install torch" in n for n in doc["notes"])
    rc, out, _ = _run(tmp_path, "diff", str(tmp_path / "a.safetensors"), str(tmp_path / "a.safetensors"), "-q")
    assert rc == 0 and out == "0 of 2 tensors differ; 0 missing; 0 extra\n"


def test_consolidated_folders_without_torch(tmp_path: Path) -> None:
    """A DeepSpeed ZeRO folder and a HuggingFaceStorageWriter folder vs their consolidated files, torch-free."""
    fw = CKPT.parent / "frameworks"
    pairs = [
        (fw / "deepspeed" / "zero3_fp32", fw / "deepspeed" / "zero3_fp32" / "expected.safetensors"),
        (fw / "hfstorage" / "run", fw / "hfstorage" / "expected" / "model-00001-of-00001.safetensors"),
        (fw / "trainer" / "checkpoint-2", fw / "trainer.expected.safetensors"),
    ]
    for a, b in pairs:
        rc, out, _ = _run(tmp_path, "diff", str(a), str(b), "-q")
        assert rc == 0 and out.startswith("0 of ") and out.endswith(" tensors differ; 0 missing; 0 extra\n"), (a, out)
