"""Each command opens each local input once, and a file replaced while it is read never mixes into an output.

An audit hook in a child process counts the ``open`` events of the input's path (the pinned file is reopened
through ``/proc/self/fd``, which is not the path); the race is a trainer's atomic save (``os.replace``) made
at the moment ckptfix comes back to the file for the second time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from safetensors.torch import load_file, save_file  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# argv[1]: JSON {"inputs": [...], "swap": [src, dst] or null, "held": int or null, "argv": [...]}
CHILD = r"""
import json, os, sys
cfg = json.loads(sys.argv[1])
inputs = {os.path.abspath(p) for p in cfg["inputs"]}
counts = {p: 0 for p in inputs}
swap = cfg["swap"]
state = {"done": False, "seen": 0}

def hook(event, args):
    if event not in ("open", "os.open") or not args or not isinstance(args[0], str):
        return
    path = args[0]
    full = os.path.abspath(path)
    if full in counts:
        counts[full] += 1
    if swap and not state["done"]:
        again = path.startswith("/proc/self/fd/") or (full == os.path.abspath(swap[1]) and counts[full] >= 2)
        if again:
            state["done"] = True
            os.replace(swap[0], swap[1])

if cfg["held"] is not None:
    from ckptfix.files import pins
    pins.MAX_HELD = cfg["held"]
sys.addaudithook(hook)
import atexit
named = lambda: {os.path.basename(k): v for k, v in counts.items()}
atexit.register(lambda: sys.stderr.write("\nCOUNTS " + json.dumps(named()) + "\n"))
sys.argv = ["ckptfix"] + cfg["argv"]
from ckptfix.__main__ import run
run()
"""


def _python(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """``python ARGS`` in ``cwd`` with only this checkout on the path (a plain environment)."""
    env = {"PYTHONPATH": str(ROOT), "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(cwd)}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _run(cwd: Path, argv: list[str], inputs: list[str], swap: list[str] | None = None, held: int | None = None):
    cfg = {"inputs": inputs, "swap": swap, "held": held, "argv": argv}
    p = _python(cwd, "-c", CHILD, json.dumps(cfg))
    line = [ln for ln in p.stderr.splitlines() if ln.startswith("COUNTS ")]
    assert line, p.stderr
    return p, json.loads(line[-1][len("COUNTS ") :])


def _state(seed: int, n: int = 64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "module.conv.weight": torch.randn(n, 3, 3, 3, generator=g),
        "module.conv.bias": torch.randn(n, generator=g),
        "module.fc.weight": torch.randn(10, n, generator=g),
    }


@pytest.fixture
def files(tmp_path: Path) -> Path:
    sd = _state(0)
    torch.save(sd, tmp_path / "m.pt")
    torch.save(sd, tmp_path / "m_legacy.pt", _use_new_zipfile_serialization=False)
    save_file(sd, str(tmp_path / "m.safetensors"))
    torch.save(sd, tmp_path / "b.pt")
    return tmp_path


CASES = [
    (["inspect", "m.pt"], ["m.pt"]),
    (["inspect", "--json", "m.safetensors"], ["m.safetensors"]),
    (["scan", "m.pt"], ["m.pt"]),
    (["scan", "m_legacy.pt"], ["m_legacy.pt"]),
    (["convert", "m.pt", "--strip-prefix", "-o", "o.safetensors"], ["m.pt"]),
    (["convert", "m_legacy.pt", "-o", "o.safetensors"], ["m_legacy.pt"]),
    (["convert", "m.safetensors", "-o", "o.pt"], ["m.safetensors"]),
    (["strip-prefix", "m.pt", "-o", "o.pt"], ["m.pt"]),
    (["strip-prefix", "m.safetensors", "-o", "o.safetensors"], ["m.safetensors"]),
    (["add-prefix", "m.pt", "--prefix", "x.", "-o", "o.pt"], ["m.pt"]),
    (["diff", "m.pt", "b.pt"], ["m.pt", "b.pt"]),
]


@pytest.mark.parametrize("argv,inputs", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_each_input_is_opened_once_per_command(files: Path, argv: list[str], inputs: list[str]):
    p, counts = _run(files, argv, inputs)
    assert p.returncode == 0, p.stderr
    assert counts == {os.path.basename(i): 1 for i in inputs}, p.stderr


def test_a_sharded_checkpoint_opens_each_shard_once(files: Path):
    (files / "sh").mkdir()
    p = _python(files, "-m", "ckptfix", "convert", "m.pt", "-o", "sh/model.safetensors", "--max-shard-size", "4KB")
    assert p.returncode == 0, p.stderr
    shards = sorted(str(Path("sh") / f.name) for f in (files / "sh").iterdir())
    assert len(shards) >= 3
    p, counts = _run(files, ["convert", "sh/model.safetensors.index.json", "-o", "one.safetensors"], shards)
    assert p.returncode == 0, p.stderr
    assert counts == {os.path.basename(s): 1 for s in shards}, p.stderr


def _replaced(files: Path) -> dict[str, torch.Tensor]:
    """``new.pt``: what a trainer's next save puts under the same name (other values, other sizes)."""
    sd = _state(1, n=96)
    torch.save(sd, files / "new.pt")
    return sd


RACES = [
    (["strip-prefix", "m.pt", "-o", "out.pt"], "out.pt"),
    (["convert", "m.pt", "--strip-prefix", "-o", "out.safetensors"], "out.safetensors"),
    (["convert", "m_legacy.pt", "-o", "out.safetensors"], "out.safetensors"),
]


def _read(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        return load_file(str(path))
    return torch.load(path, weights_only=True)


@pytest.mark.parametrize("argv,out", RACES, ids=[" ".join(a) for a, _ in RACES])
def test_a_file_replaced_mid_read_is_read_as_it_was(files: Path, argv: list[str], out: str):
    """The path is replaced when ckptfix comes back to it: the output is the first file's, whole."""
    old = _state(0)
    _replaced(files)
    p, _ = _run(files, argv, [argv[1]], swap=["new.pt", argv[1]])
    assert p.returncode == 0, p.stderr
    assert not (files / "new.pt").exists(), "the swap did not happen: the test tests nothing"
    got = _read(files / out)
    strip = argv[0] == "strip-prefix" or "--strip-prefix" in argv
    name = {k: k.removeprefix("module.") if strip else k for k in old}
    assert set(got) == set(name.values())
    for k, v in old.items():
        assert torch.equal(got[name[k]], v), k


@pytest.mark.parametrize("argv,out", RACES, ids=[" ".join(a) for a, _ in RACES])
def test_without_a_held_descriptor_a_replaced_file_is_exit_16_and_nothing_written(files: Path, argv, out):
    """No descriptor held (no /proc, or past MAX_HELD): the replacement is found and nothing is written."""
    _replaced(files)
    p, _ = _run(files, argv, [argv[1]], swap=["new.pt", argv[1]], held=0)
    assert not (files / "new.pt").exists(), "the swap did not happen: the test tests nothing"
    assert p.returncode == 16, p.stderr
    err = [ln for ln in p.stderr.splitlines() if ln.startswith("Error:")]
    assert len(err) == 1 and "replaced while it was read" in err[0], p.stderr
    assert "Traceback" not in p.stderr
    assert not (files / out).exists()
    assert not [f for f in os.listdir(files) if f.startswith(".")], os.listdir(files)


def test_load_anywhere_reads_one_version(files: Path):
    """The library's loader: a replaced file between its sniff and torch.load is still the first version."""
    _replaced(files)
    child = (
        "import os, sys, torch\n"
        "import ckptfix\n"
        "state = {'n': 0}\n"
        "def hook(ev, args):\n"
        "    if ev == 'open' and args and isinstance(args[0], str) and args[0].startswith('/proc/self/fd/') "
        "and not state['n']:\n"
        "        state['n'] = 1; os.replace('new.pt', 'm.pt')\n"
        "sys.addaudithook(hook)\n"
        "sd = ckptfix.load_anywhere('m.pt')\n"
        "print(sd['module.conv.weight'].shape[0], state['n'])\n"
    )
    p = _python(files, "-c", child)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["64", "1"]
