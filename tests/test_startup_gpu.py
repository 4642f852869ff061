"""Start-up of ``gpus`` and ``pick-gpu`` (issue 25): what they import and compile, pinned by name, not by time.

Each command runs as pip's console script runs it (``from ckptfix.cli import main``) in a fresh interpreter
started with ``-S``: the development venv's editable install imports ``pathlib`` and ``re`` from a ``.pth`` file
at every start-up, which a user's ``pip install ckptfix`` does not, so without ``-S`` the absence of ``pathlib``
could not be seen.  ``-S`` skips the ``.pth`` files; ``PYTHONPATH`` names the checkout and the venv's
site-packages (click) instead.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import click
import pytest

from tests.helpers import ROOT, fake_smi_env

#: modules the GPU commands used to import without needing them: ``pathlib`` (with ``urllib.parse``,
#: ``ipaddress``, ``fnmatch`` and ``ntpath``: about 2.5 ms) came with ``ckptfix.gpu.leases`` and ``ckptfix.gpu.pick``
REMOVED = ["pathlib", "urllib.parse", "urllib", "ipaddress", "fnmatch", "ntpath"]

#: where click is installed (a venv's site-packages, or the system's): on PYTHONPATH, since -S skips site
_SITE = os.path.dirname(os.path.dirname(click.__file__))

_RUN = (
    "import atexit, sys\n"
    "import re._compiler as C\n"
    "compiled = []\n"
    "orig = C.compile\n"
    "def spy(p, flags=0):\n"
    "    f = sys._getframe(1)\n"
    "    while f is not None and f.f_code.co_filename.startswith(C.__file__.rsplit('/', 1)[0]):\n"
    "        f = f.f_back\n"
    "    if f is not None and '/ckptfix/gpu/' in f.f_code.co_filename.replace('\\\\', '/'):\n"
    "        compiled.append(repr(p))\n"
    "    return orig(p, flags)\n"
    "C.compile = spy\n"
    "def report():\n"
    "    sys.stderr.write('\\nMODULES ' + ' '.join(sorted(sys.modules)) + '\\n')\n"
    "    sys.stderr.write('COMPILED ' + ' '.join(compiled) + '\\n')\n"
    "atexit.register(report)\n"
    "sys.argv[0] = 'ckptfix'\n"
    "from ckptfix.cli import main\n"
    "sys.exit(main())\n"
)


def _run(args: list[str], env: dict[str, str]) -> tuple[set[str], str]:
    """(``sys.modules`` at exit, the patterns ``ckptfix.gpu`` compiled) of ``ckptfix ARGS`` as a console script."""
    env = {**env, "PYTHONPATH": f"{ROOT}:{_SITE}"}
    p = subprocess.run(
        [sys.executable, "-S", "-c", _RUN, *args], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert p.returncode == 0, p.stderr
    mods = [ln for ln in p.stderr.splitlines() if ln.startswith("MODULES ")]
    compiled = [ln for ln in p.stderr.splitlines() if ln.startswith("COMPILED")]
    assert mods and compiled, p.stderr
    return set(mods[-1].split()[1:]), compiled[-1][len("COMPILED") :].strip()


GPU_COMMANDS = [["gpus"], ["gpus", "--json"], ["pick-gpu", "--lease", "0"], ["pick-gpu"], ["pick-gpu", "--export"]]


@pytest.mark.parametrize("args", GPU_COMMANDS, ids=" ".join)
def test_gpu_commands_import_no_pathlib(args, tmp_path):
    mods, _ = _run(args, fake_smi_env(tmp_path, "h200_busy"))
    assert "ckptfix.gpu.visible" in mods  # the command ran the code path pinned here
    if args[0] == "pick-gpu":
        assert "ckptfix.gpu.leases" in mods and "fcntl" in mods
        assert "ckptfix.gpu.render" not in mods  # the table's module: pick-gpu shortens UUIDs with records'
    assert sorted(m for m in REMOVED if m in mods) == []


@pytest.mark.parametrize("args", GPU_COMMANDS, ids=" ".join)
def test_gpu_commands_compile_no_regular_expression(args, tmp_path):
    """ckptfix.gpu.parse reads nvidia-smi's values by hand (tests/test_gpu_parse_scan.py): compiling its patterns
    cost about 0.8 ms; ``nvidia-smi -L``'s (a MIG host only) are compiled on first use."""
    _, compiled = _run(args, fake_smi_env(tmp_path, "h200_busy"))
    assert compiled == ""


def test_the_interpreter_alone_imports_none_of_them(tmp_path):
    """The check above means something: ``-S`` and the imports before ckptfix's do not bring them."""
    p = subprocess.run(
        [sys.executable, "-S", "-c", "import sys, click; print(' '.join(sys.modules))"],
        env={**fake_smi_env(tmp_path), "PYTHONPATH": _SITE},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    assert sorted(m for m in REMOVED if m in p.stdout.split()) == []


_COLLECTIONS = (
    "import gc, sys\n"
    "seen = []\n"
    "def cb(phase, info):\n"
    "    if phase == 'start':\n"
    "        seen.append(('ckptfix.gpu' in sys.modules, sys.argv[1] in sys.modules))\n"
    "gc.callbacks.append(cb)\n"
    "import atexit\n"
    "atexit.register(lambda: sys.stderr.write(f'\\nSEEN {seen} FROZEN {gc.get_freeze_count()}\\n'))\n"
    "sys.argv = ['ckptfix', *sys.argv[2:]]\n"
    "from ckptfix.__main__ import run\n"
    "run()\n"
)


@pytest.mark.parametrize(
    ("args", "last"),
    [(["gpus"], "ckptfix.gpu.render"), (["pick-gpu", "--lease", "0"], "ckptfix.gpu.pick")],
    ids=["gpus", "pick-gpu"],
)
def test_gpu_modules_load_without_a_collection_and_are_frozen(args, last, tmp_path):
    """The commands import the library's GPU modules inside ``ckptfix._startup.imports_quietly``: no collection
    walks them while they load (a dozen modules, ~0.4 ms of passes) or afterwards (frozen, in the command
    process)."""
    env = {**fake_smi_env(tmp_path, "h200_busy"), "PYTHONPATH": str(ROOT)}
    p = subprocess.run(
        [sys.executable, "-c", _COLLECTIONS, last, *args], env=env, capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr
    line = [ln for ln in p.stderr.splitlines() if ln.startswith("SEEN ")][-1]
    seen = ast.literal_eval(line[5 : line.index(" FROZEN")])
    assert (True, False) not in seen  # none between the first GPU module and the last one the command needs
    assert int(line.split(" FROZEN ")[1]) > 1000
