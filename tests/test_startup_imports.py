"""What each command imports, as users feel it: no command imports torch, numpy or a remote driver (fsspec,
s3fs, aiohttp, botocore, huggingface_hub) unless it uses them.

Each command runs in a fresh interpreter (``python -m ckptfix ...``) that lists ``sys.modules`` at exit.  How
fast the start-up is, is ``benchmarks/bench_startup.py``'s (no test asserts time).
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, fake_smi_env

#: what a command imports only when it uses it: torch and numpy (optional), the remote drivers (a URL input)
HEAVY = ["torch", "numpy", "fsspec", "s3fs", "aiohttp", "botocore", "huggingface_hub"]

_LIST_MODULES = (
    "import atexit, sys\n"
    "atexit.register(lambda: sys.stderr.write('\\nMODULES ' + ' '.join(sorted(sys.modules)) + '\\n'))\n"
    "import runpy\n"
    "sys.argv[0] = 'ckptfix'\n"
    "runpy.run_module('ckptfix', run_name='__main__', alter_sys=True)\n"
)


def _heavy_imported(args: list[str], env: dict[str, str], cwd: Path) -> list[str]:
    env = {**env, "PYTHONPATH": str(ROOT)}
    p = subprocess.run(
        [sys.executable, "-c", _LIST_MODULES, *args], env=env, capture_output=True, text=True, timeout=120, cwd=cwd
    )
    assert p.returncode == 0, p.stderr
    line = [ln for ln in p.stderr.splitlines() if ln.startswith("MODULES ")]
    assert line, p.stderr
    mods = set(line[-1].split()[1:])
    return sorted(m for m in mods if m.split(".")[0] in HEAVY)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A small ``torch.save`` zip, the same with a ``model.`` prefix, and a safetensors file (written by torch)."""
    import torch
    from safetensors.torch import save_file

    d = tmp_path_factory.mktemp("startup")
    t = {"w": torch.ones(4, 4), "b": torch.ones(4)}
    torch.save(t, d / "m.pt")
    torch.save({f"model.{k}": v for k, v in t.items()}, d / "p.pt")
    save_file(t, str(d / "m.safetensors"))
    return {"pt": d / "m.pt", "prefixed": d / "p.pt", "st": d / "m.safetensors"}


CHECKPOINT_COMMANDS = {
    "--help": lambda f, o: ["--help"],
    "inspect": lambda f, o: ["inspect", str(f["pt"])],
    "inspect --json": lambda f, o: ["inspect", "--json", str(f["pt"])],
    "inspect safetensors": lambda f, o: ["inspect", str(f["st"])],
    "scan": lambda f, o: ["scan", str(f["pt"])],
    "convert": lambda f, o: ["convert", str(f["pt"]), "-o", str(o / "o.safetensors")],
    "strip-prefix": lambda f, o: ["strip-prefix", str(f["prefixed"]), "-o", str(o / "s.pt")],
    "sanitize": lambda f, o: ["sanitize", str(f["pt"]), "-o", str(o / "z.pt")],
}


@pytest.mark.parametrize("name", list(CHECKPOINT_COMMANDS))
def test_local_checkpoint_commands_import_no_torch_numpy_or_remote_driver(name, files, tmp_path):
    args = CHECKPOINT_COMMANDS[name](files, tmp_path)
    assert _heavy_imported(args, dict(os.environ), tmp_path) == []


@pytest.mark.parametrize("args", [["gpus"], ["gpus", "--json"], ["pick-gpu", "--lease", "0"]], ids=" ".join)
def test_gpu_commands_import_no_torch_numpy_or_remote_driver(args, tmp_path):
    assert _heavy_imported(args, fake_smi_env(tmp_path, "h200_busy"), tmp_path) == []


def test_the_help_and_version_options_are_clicks():
    from click.testing import CliRunner

    from ckptfix import __version__
    from ckptfix.cli.group import cli

    runner = CliRunner()
    version = runner.invoke(cli, ["--version"])
    assert version.exit_code == 0 and version.output == f"ckptfix, version {__version__}\n"
    for args in (["-h"], ["--help"], ["inspect", "-h"], ["scan", "--help"], ["convert", "-h"]):
        r = runner.invoke(cli, args)
        assert r.exit_code == 0 and "Show this message and exit." in r.output and "Usage:" in r.output
    bad = runner.invoke(cli, ["inspect", "--nope"])
    assert bad.exit_code == 2 and "Try 'cli inspect --help' for help." in bad.output
    short = runner.invoke(cli, ["convert", "missing.pt", "-o"])
    assert short.exit_code == 2 and "Option '-o' requires an argument." in short.output


def test_the_collector_is_back_as_it_was_after_the_imports():
    """A command's own work (a long convert, train) collects garbage as usual; a caller that turned the collector
    off keeps it off."""
    from ckptfix._startup import imports_quietly

    assert gc.isenabled()
    try:
        with imports_quietly():
            assert not gc.isenabled()
        assert gc.isenabled()
        gc.disable()
        with imports_quietly():
            pass
        assert not gc.isenabled()
        gc.enable()
        with pytest.raises(ImportError):
            with imports_quietly():
                import ckptfix_no_such_module  # noqa: F401
        assert gc.isenabled()
    finally:
        gc.enable()
