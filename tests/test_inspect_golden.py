"""``ckptfix inspect`` prints exactly tests/golden/inspect/<case>.txt.

Each case runs the CLI in a fresh process on a checkpoint of tests/fixtures/ckpt, or on one the
``ckpt`` factory builds (tied weights; a global that no longer imports), from the checkpoint's folder
(so the paths printed are the relative ones given), and compares the command line, stdout, stderr and
exit code with the golden file, byte for byte.

After an intended change of the output, regenerate the files and review the diff::

    CKPTFIX_UPDATE_GOLDEN=1 pytest tests/test_inspect_golden.py
    git diff tests/golden/inspect/
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers import GOLDEN, ROOT, CkptFactory, check_golden, run_cli

FIXTURES = ROOT / "tests" / "fixtures" / "ckpt"
GOLDEN_INSPECT = GOLDEN / "inspect"

# case -> the command line after ``ckptfix``, run in tests/fixtures/ckpt
CASES: dict[str, tuple[str, ...]] = {
    "ddp": ("inspect", "ddp.pth"),
    "legacy": ("inspect", "legacy.pth"),
    "lightning": ("inspect", "lightning.ckpt"),
    "safetensors": ("inspect", "model.safetensors"),
    "sharded": ("inspect", "sharded"),
    "missing": ("inspect", "no-such-file.pth"),
}


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CKPTFIX_", "CUDA_"))}
    for k in ("NO_COLOR", "FORCE_COLOR", "TERM", "COLUMNS"):
        env.pop(k, None)
    return env


# case -> (factory method, file name): built into tmp_path by the test
BUILT: dict[str, tuple[str, str]] = {
    "tied": ("tied", "tied.pt"),
    "unimportable_global": ("unimportable_args", "args.pt"),
}


def _check(case: str, args: tuple[str, ...], cwd: Path) -> None:
    r = run_cli(*args, env=_env(), cwd=cwd, isolated=True)
    assert r.torch_imported is False
    text = f"$ ckptfix {' '.join(args)}\n{r.out}--- stderr\n{r.err}--- exit code {r.rc}\n"
    check_golden(GOLDEN_INSPECT / f"{case}.txt", text)


@pytest.mark.parametrize("case", sorted(CASES))
def test_inspect_text_is_golden(case: str) -> None:
    _check(case, CASES[case], FIXTURES)


@pytest.mark.parametrize("case", sorted(BUILT))
def test_inspect_text_of_built_checkpoints_is_golden(case: str, ckpt: CkptFactory, tmp_path: Path) -> None:
    method, name = BUILT[case]
    getattr(ckpt, method)(name)
    _check(case, ("inspect", name), tmp_path)


def test_every_inspect_golden_file_belongs_to_a_case() -> None:
    assert {p.name for p in GOLDEN_INSPECT.glob("*.txt")} <= {f"{c}.txt" for c in [*CASES, *BUILT]}
