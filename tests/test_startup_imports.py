"""Start-up (issue 25): what ``inspect`` / ``scan`` / ``gpus`` / ``pick-gpu`` import, pinned by module, not by time.

Each command runs in a fresh interpreter (``python -m ckptfix ...``, as ``benchmarks/bench_startup.py`` measures
it) that lists ``sys.modules`` at exit.  A module named here costs start-up on every run of the command when it
is imported without being used: a new import of one of them fails this test (import it where it is used).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, fake_smi_env

#: what none of the four imports (torch and numpy are optional; the others are the heavy stdlib and the parts
#: of ckptfix another command needs)
NEVER = [
    "torch",
    "numpy",
    "importlib.metadata",
    "ckptfix.ops.convert",
    "ckptfix.ops.rewrite",
    "ckptfix.ops.load",
    "ckptfix.train",
    "ckptfix.cli.convert",
    "ckptfix.cli.train",
    "ckptfix.cli.demo",
    "ckptfix.formats.dcp",
    "ckptfix.formats.dcp.checkpoint",
    "ctypes",
    "traceback",
    "json",
    "shlex",
]

#: the checkpoint side, which the GPU commands never import
CHECKPOINT_SIDE = [
    "ckptfix.cli.ckpt",
    "ckptfix.formats",
    "ckptfix.pickles",
    "ckptfix.ops.inspect",
    "ckptfix.ops.prefixes",
    "zipfile",
    "tarfile",
    "pickle",
    "shutil",
    "bz2",
    "lzma",
]

_LIST_MODULES = (
    "import atexit, sys\n"
    "atexit.register(lambda: sys.stderr.write('\\nMODULES ' + ' '.join(sorted(sys.modules)) + '\\n'))\n"
    "import runpy\n"
    "sys.argv[0] = 'ckptfix'\n"
    "runpy.run_module('ckptfix', run_name='__main__', alter_sys=True)\n"
)


def _modules(args: list[str], env: dict[str, str]) -> set[str]:
    env = {**env, "PYTHONPATH": str(ROOT)}
    p = subprocess.run(
        [sys.executable, "-c", _LIST_MODULES, *args], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert p.returncode == 0, p.stderr
    line = [ln for ln in p.stderr.splitlines() if ln.startswith("MODULES ")]
    assert line, p.stderr
    return set(line[-1].split()[1:])


@pytest.fixture(scope="module")
def torch_zip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small ``torch.save`` zip (a model's state dict)."""
    from tests.helpers import CkptFactory

    return Path(CkptFactory(tmp_path_factory.mktemp("startup")).plain().path)


def _check(mods: set[str], absent: list[str], present: list[str]) -> None:
    assert [m for m in present if m not in mods] == []  # the command ran the code path pinned here
    assert sorted(m for m in absent if m in mods) == []


@pytest.mark.parametrize("command", ["inspect", "scan"])
def test_inspect_and_scan_of_a_torch_zip_import_no_dcp_json_gpu_or_align(command, torch_zip):
    mods = _modules([command, str(torch_zip)], dict(os.environ))
    absent = NEVER + [
        "ckptfix.gpu",
        "ckptfix.cli.gpu",
        "ckptfix.ops.prefixes.align",
        "ckptfix.ops.sanitize",
        "ckptfix.ops.rewrite.keys",
        "ckptfix.pickles.writer",  # the readers never write
        "ckptfix.formats.legacy",  # the other formats' readers
        "ckptfix.formats.safetensors_fmt",
        "ckptfix.formats.sharded",
        "tarfile",  # a zip's first block is no tar header: refused without tarfile (sniffing.tar_opens)
        "subprocess",
        "pickletools",  # only for a pickle past protocol 2 (plaindata.opcodes_weights_only_cannot_read)
        # a local path never needs the remote drivers (ckptfix.files.remote imports fsspec only for a URL)
        "fsspec",
        "aiohttp",
        "s3fs",
    ]
    _check(mods, absent, ["ckptfix.ops.inspect", "ckptfix.formats.zipfmt"])


@pytest.mark.parametrize("args", [["gpus"], ["gpus", "--json"], ["pick-gpu", "--lease", "0"]])
def test_gpus_and_pick_gpu_import_nothing_of_the_checkpoint_side(args, tmp_path):
    mods = _modules(args, fake_smi_env(tmp_path, "h200_busy"))
    absent = NEVER + CHECKPOINT_SIDE
    if "--json" in args:  # --json renders with json, and only then
        absent.remove("json")
    _check(mods, absent, ["ckptfix.gpu.visible", "ckptfix.gpu.smi", "ckptfix.gpu.runner"])


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


def _child(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -c code args...`` with the checkout first on the path; it must succeed."""
    p = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert p.returncode == 0, p.stderr
    return p


def test_imports_pause_the_collector_and_give_it_back():
    """ckptfix._startup: no collection while modules are imported, the collector back (as it was) afterwards."""
    import gc

    from ckptfix import _startup
    from ckptfix._startup import imports_quietly

    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    try:
        with imports_quietly():
            assert not gc.isenabled()
        assert gc.isenabled() and gc.get_freeze_count() == frozen  # not the ckptfix process: nothing frozen
        _startup.command_process()
        with imports_quietly():
            pass
        assert gc.isenabled() and gc.get_freeze_count() > frozen
        gc.disable()  # a caller that turned it off keeps it off
        with imports_quietly():
            pass
        assert not gc.isenabled()
        with pytest.raises(ImportError):
            with imports_quietly():
                import ckptfix_no_such_module  # noqa: F401
        assert not gc.isenabled()
    finally:
        _startup._FREEZE[0] = False
        gc.enable()
        gc.unfreeze()


def test_the_ckptfix_process_freezes_what_it_imported(torch_zip):
    """The console script / python -m ckptfix (ckptfix.__main__.run): the imports are frozen, the collector on."""
    child = (
        "import atexit, gc, sys\n"
        "atexit.register(lambda: sys.stderr.write(f'\\nGC {gc.isenabled()} {gc.get_freeze_count() > 1000}\\n'))\n"
        "import runpy\n"
        "sys.argv[0] = 'ckptfix'\n"
        "runpy.run_module('ckptfix', run_name='__main__', alter_sys=True)\n"
    )
    p = _child(child, "inspect", str(torch_zip))
    assert "GC True True" in p.stderr
