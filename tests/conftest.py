"""Shared fixtures: a factory that builds tiny checkpoints of every kind into tmp_path.

The factory and the helpers the tests share live in tests/helpers.py; test modules import them from there.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from helpers import CkptFactory
from s3server import s3, s3_server  # noqa: F401 (moto's S3 server fixtures for the remote tests, issue #26)

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
# subprocesses (python -m ckptfix ...) must find the package too
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)

# The variables that change what ckptfix does or prints start unset in every test, whatever the shell that ran
# pytest had (CKPTFIX_DEBUG=1 adds tracebacks, FORCE_COLOR=1 colours errors, COLUMNS re-wraps --help ...): a
# test that needs one sets it.  Kept: the suite's own opt-ins (CKPTFIX_REALWORLD*, CKPTFIX_FUZZ_*,
# CKPTFIX_UPDATE_GOLDEN, CKPTFIX_EXPECT_NO_TORCH).
_SUITE_OPT_INS = ("CKPTFIX_REALWORLD", "CKPTFIX_FUZZ_", "CKPTFIX_UPDATE_GOLDEN", "CKPTFIX_EXPECT_NO_TORCH")
_OUTPUT_VARS = ("NO_COLOR", "FORCE_COLOR", "CLICOLOR", "CLICOLOR_FORCE", "COLUMNS", "LINES")
for _k in list(os.environ):
    if (_k.startswith("CKPTFIX_") and not _k.startswith(_SUITE_OPT_INS)) or _k in _OUTPUT_VARS:
        del os.environ[_k]

# Ctrl-C as an interactive shell delivers it, whatever started pytest: a shell without job control starts a
# background job (`.ci/run &`, `nohup ... &`) with SIGINT ignored, and Python then installs no KeyboardInterrupt
# handler, here nor in the interpreters the tests start (an ignored signal stays ignored across exec; a handler
# does not).  The tests that send SIGINT need it handled.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def ckpt(tmp_path: Path) -> CkptFactory:
    return CkptFactory(tmp_path)


@pytest.fixture
def dp_work(tmp_path: Path) -> Path:
    """A working directory holding ``m.pt``, a DataParallel state dict (``module.a``, ``module.b``)."""
    import torch

    torch.save({"module.a": torch.zeros(3), "module.b": torch.ones(2)}, tmp_path / "m.pt")
    return tmp_path


@pytest.fixture(scope="session")
def session_ckpt(tmp_path_factory: pytest.TempPathFactory) -> CkptFactory:
    """A factory for read-only fixtures shared by several tests (never modify what it builds)."""
    return CkptFactory(tmp_path_factory.mktemp("shared_ckpts"))


# --------------------------------------------------------------------------- heavy read-only fixtures, once per run


@pytest.fixture(scope="session")
def fsdp2_gloo_dcp(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """An FSDP2 + DTensor DCP checkpoint saved by 2 gloo ranks, and its full state dict (never modify it)."""
    from heavy import build_fsdp2_gloo_dcp

    return build_fsdp2_gloo_dcp(tmp_path_factory.mktemp("fsdp2_gloo"))


@pytest.fixture(scope="session")
def fsdp_trained_dcp(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    """``train --mode fsdp`` for two epochs as DCP: (output directory, TrainResult) (never modify it)."""
    from heavy import build_fsdp_trained_dcp

    return build_fsdp_trained_dcp(tmp_path_factory.mktemp("fsdp_trained"))


@pytest.fixture(scope="session")
def ddp_trained_pt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    """``train --mode ddp`` for two epochs as .pt: (output directory, TrainResult) (never modify it)."""
    from heavy import build_ddp_trained_pt

    return build_ddp_trained_pt(tmp_path_factory.mktemp("ddp_trained"))
