"""What the tests share: one way to run the CLI (and Python in a fresh process), a fake nvidia-smi on PATH,
and a factory of tiny checkpoints of every kind (:class:`CkptFactory`, the ``ckpt`` fixture of conftest.py).

``run_cli`` runs ``ckptfix`` like the console script does (``ckptfix.cli.main``): in-process with captured
streams for ordinary commands, in a new interpreter (which also reports whether torch ended up imported) when
the test passes ``isolated=True`` or runs ``pick-gpu``, ``train`` or ``demo`` (see :func:`run_cli`).
``fake_smi_env`` builds an environment whose ``nvidia-smi`` is
tests/fixtures/nvidia-smi/fake-nvidia-smi.sh, replaying a scenario of tests/fixtures/nvidia-smi/scenarios/.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import hashlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import warnings
import zipfile
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping
from unittest import mock

import pytest
import torch
import torch.serialization as tser
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
REPO = ROOT
FAKE_SMI = Path(__file__).parent / "fixtures" / "nvidia-smi"
SCENARIOS = FAKE_SMI / "scenarios"

# the console script's entry point, then "True"/"False" (torch imported?) into $TORCH_REPORT when set
CLI_PROGRAM = r"""
import os, sys, pathlib
from ckptfix.cli import main
rc = main(sys.argv[1:])
sys.stdout.flush()
if os.environ.get("TORCH_REPORT"):
    pathlib.Path(os.environ["TORCH_REPORT"]).write_text(str("torch" in sys.modules))
sys.exit(rc)
"""

# variables that change what the GPU commands see or report: a test sets them explicitly
_MACHINE_VARS = ("CUDA_", "CKPTFIX_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_", "NCCL_", "TORCH_NCCL")


class CliRun:
    """One finished ``ckptfix`` run: exit code, stdout, stderr, and (run in a fresh interpreter) whether torch
    was imported."""

    def __init__(self, rc: int, out: str, err: str, torch_imported: bool | None = None, *, isolated: bool = True):
        self.rc = rc
        self.out = out
        self.err = err
        self.isolated = isolated
        self._torch = torch_imported  # None: the process died before reporting

    @property
    def torch_imported(self) -> bool | None:
        """Whether the command imported torch (a fresh interpreter's answer; ``None`` if it died first)."""
        if not self.isolated:
            raise AssertionError(
                "torch_imported is only known for a run in a fresh interpreter: call run_cli(..., isolated=True) "
                "(in-process runs share this process's sys.modules, where torch is already imported)"
            )
        return self._torch

    @property
    def returncode(self) -> int:
        return self.rc

    @property
    def stdout(self) -> str:
        return self.out

    @property
    def stderr(self) -> str:
        return self.err

    def __repr__(self) -> str:
        return f"CliRun(rc={self.rc!r}, out={self.out!r}, err={self.err!r}, isolated={self.isolated})"


def cli_argv(*args: str) -> list[str]:
    """The argv that runs ``ckptfix ARGS`` like the console script (for ``subprocess.Popen`` in a test).

    Args:
        args: the command line after ``ckptfix``.

    Returns:
        ``[python, "-c", CLI_PROGRAM, *args]``.
    """
    return [sys.executable, "-c", CLI_PROGRAM, *map(str, args)]


# commands whose behaviour belongs to the process: pick-gpu holds leases for the life of the process and
# execs `-- COMMAND`; train and demo start torchrun and set torch's global state (threads, seeds)
_PROCESS_COMMANDS = frozenset({"pick-gpu", "train", "demo"})
_HELPERS = str(Path(__file__).resolve())


# variables ckptfix reads once, when a module is imported (ckptfix/formats/dcp/meta.py, chunks.py): a run that
# changes one needs a fresh interpreter to see it
_IMPORT_TIME_VARS = ("CKPTFIX_DCP_MAX_",)


def _needs_interpreter(args: tuple[str, ...], env: Mapping[str, str]) -> bool:
    """A process command, a ``PYTHONPATH`` naming a folder this interpreter's ``sys.path`` lacks, or a change to
    a variable read at import time."""
    command = next((a for a in args if not a.startswith("-")), None)
    here = {os.path.abspath(p or ".") for p in sys.path}
    elsewhere = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) not in here]
    names = {k for k in (*env, *os.environ) if k.startswith(_IMPORT_TIME_VARS)}
    import_time = any(env.get(k) != os.environ.get(k) for k in names)
    return command in _PROCESS_COMMANDS or bool(elsewhere) or import_time


def run_cli(
    *args: str,
    env: Mapping[str, str] | None = None,
    scenario: str | None = None,
    timeout: float = 60,
    cwd: str | Path | None = None,
    isolated: bool | None = None,
    **extra: str,
) -> CliRun:
    """Run ``ckptfix ARGS`` as the console script does: in this process (``main()`` with captured streams), or
    in a fresh interpreter.

    Which one is decided from the arguments alone, never from the calling test's code:

    - ``isolated=True``: a fresh interpreter.  A test that reads ``.torch_imported`` must pass it (only a new
      process can say whether torch was imported; an in-process run's ``.torch_imported`` raises, saying so).
    - ``isolated=False``: in this process, whatever the command.
    - ``isolated=None`` (the default): a fresh interpreter for the commands whose behaviour belongs to the
      process (``pick-gpu``: leases held for the process's life, ``exec``; ``train``, ``demo``) and for an
      environment that sets the interpreter up differently (a ``PYTHONPATH`` naming a folder this interpreter
      lacks, a changed ``CKPTFIX_DCP_MAX_*`` limit, read at import); in this process otherwise: same exit
      code, stdout and stderr, without a new interpreter's start-up.

    Args:
        args: the command line after ``ckptfix``.
        env: the whole environment (default: this process's); e.g. from :func:`fake_smi_env`.
        scenario: the fake nvidia-smi's scenario (``$FAKE_SMI_SCENARIO``).
        timeout: seconds before the test fails (a fresh interpreter is killed; an in-process run that is still
            going dumps every thread's stack to stderr, to show where it hangs).
        cwd: working directory (default: the repository root).
        isolated: ``True``: a fresh interpreter; ``False``: in-process; ``None``: decide as above.
        extra: more environment variables.

    Returns:
        The :class:`CliRun`.
    """
    args = tuple(map(str, args))
    e = dict(os.environ if env is None else env)
    e.setdefault("PYTHONPATH", str(ROOT))
    if scenario is not None:
        e["FAKE_SMI_SCENARIO"] = scenario
    e.update(extra)
    if isolated is None:
        isolated = _needs_interpreter(args, e)
    if not isolated:
        return _run_cli_in_process(args, e, timeout, ROOT if cwd is None else Path(cwd))
    fd, report = tempfile.mkstemp(prefix="ckptfix-torch-report-")
    os.close(fd)
    e["TORCH_REPORT"] = report
    try:
        p = subprocess.run(
            cli_argv(*args),
            env=e,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT if cwd is None else cwd,
        )
        said = Path(report).read_text()
    finally:
        os.unlink(report)
    return CliRun(p.returncode, p.stdout, p.stderr, None if not said else said == "True")


class CliHang(BaseException):
    """An in-process ``ckptfix`` run still going after its timeout (a BaseException: ``main()`` does not catch it)."""


class _HangAlarm:
    """SIGALRM after ``timeout`` seconds raises :class:`CliHang` naming the command (main thread only)."""

    def __init__(self, args: tuple[str, ...], timeout: float) -> None:
        self.old: Any = None
        if threading.current_thread() is not threading.main_thread():
            return

        def fire(signum: int, frame: Any) -> None:
            raise CliHang(f"ckptfix {' '.join(args)}: still running after {timeout:g} s (hung?)")

        self.old = signal.signal(signal.SIGALRM, fire)
        signal.setitimer(signal.ITIMER_REAL, timeout)

    def cancel(self) -> None:
        if self.old is not None:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.old)


def _run_cli_in_process(args: tuple[str, ...], env: dict[str, str], timeout: float, cwd: Path) -> CliRun:
    """``main(args)`` here, with ``os.environ`` set to exactly ``env``, in ``cwd``, stdout and stderr captured."""
    from click.testing import CliRunner

    from ckptfix.cli import main

    env.setdefault("COLUMNS", "80")  # what a fresh interpreter writing to a pipe sees
    env.setdefault("LINES", "24")
    saved_env, saved_cwd, saved_argv = dict(os.environ), os.getcwd(), sys.argv
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = ["ckptfix", *args]
    with contextlib.suppress(AttributeError, ValueError, OSError):  # the real stderr, even under capsys
        faulthandler.dump_traceback_later(timeout, exit=False, file=sys.__stderr__)
    alarm = _HangAlarm(args, timeout)
    try:
        with CliRunner().isolation() as (out, err, _):
            try:
                rc = main(list(args))
            except SystemExit as e:  # what the console script would exit with
                rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            sys.stdout.flush()
            sys.stderr.flush()
            stdout, stderr = out.getvalue(), err.getvalue()
    finally:
        alarm.cancel()
        faulthandler.cancel_dump_traceback_later()
        sys.argv = saved_argv
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
    return CliRun(
        rc, stdout.decode("utf-8", "replace"), stderr.decode("utf-8", "backslashreplace"), None, isolated=False
    )


def run_python(
    code: str, *, env: Mapping[str, str] | None = None, timeout: float = 120, cwd: str | Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``python -c CODE`` in a fresh interpreter (stdout and stderr captured).

    Args:
        code: the program.
        env: the whole environment (default: this process's).
        timeout: seconds before the test fails.
        cwd: working directory (default: the repository root).

    Returns:
        The finished process.
    """
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT if cwd is None else cwd,
        env=None if env is None else dict(env),
        timeout=timeout,
    )


def plain_env(home: str | os.PathLike, **extra: str) -> dict[str, str]:
    """The environment of a plain login shell, whatever this process's: ``env -i HOME=... PATH=/usr/bin:/bin``
    plus the package on ``PYTHONPATH`` and ``EXTRA``; none of ``PYTHONUNBUFFERED``, ``PYTHONDONTWRITEBYTECODE``,
    ``PYTHONHASHSEED``, ``LANG``/``LC_*``, ``TERM``, ``COLUMNS``, ``CKPTFIX_*`` unless the test passes it.

    Args:
        home: the ``HOME`` (the test's own directory).
        extra: more variables (``PYTHONUNBUFFERED="1"`` ...).

    Returns:
        The environment.
    """
    return {"HOME": os.fspath(home), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), **extra}


def fake_smi_env(tmp_path: Path, scenario: str | None = None) -> dict[str, str]:
    """An environment with the fake nvidia-smi first on PATH, a private lease directory, no CUDA/rank variables.

    Args:
        tmp_path: the test's directory (the fake's ``bin/``, its call log ``smi.log`` and ``leases/`` go there).
        scenario: the scenario to replay (or pass ``scenario=`` to :func:`run_cli`).

    Returns:
        The environment.
    """
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    shutil.copy(FAKE_SMI / "fake-nvidia-smi.sh", bin_dir / "nvidia-smi")
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(_MACHINE_VARS)}
    env.update(
        PATH=f"{bin_dir}:/usr/bin:/bin",
        FAKE_SMI_DIR=str(SCENARIOS),
        FAKE_SMI_LOG=str(tmp_path / "smi.log"),
        CKPTFIX_LEASE_DIR=str(tmp_path / "leases"),
        PYTHONPATH=str(ROOT),
    )
    if scenario is not None:
        env["FAKE_SMI_SCENARIO"] = scenario
    return env


def smi_calls(env: Mapping[str, str]) -> list[str]:
    """The fake nvidia-smi's calls so far, one line each (``query-gpu ...``, ``apps ...``, ``L ...``).

    Args:
        env: the environment from :func:`fake_smi_env`.

    Returns:
        The logged calls, oldest first.
    """
    log = Path(env["FAKE_SMI_LOG"])
    return log.read_text().splitlines() if log.exists() else []


# --------------------------------------------------------------------------- checkpoints to test with

HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


# --------------------------------------------------------------------------- tiny models


class TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 3)
        self.bn = nn.BatchNorm1d(3)  # buffers + num_batches_tracked (int64)
        self.fc2 = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


class TiedNet(nn.Module):
    """Embedding and output projection share one weight (like GPT-2's lm_head)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x))


def tiny_model(seed: int = 0) -> TinyNet:
    torch.manual_seed(seed)
    m = TinyNet()
    with torch.no_grad():
        m.bn.running_mean.uniform_(-1, 1)
        m.bn.running_var.uniform_(0.5, 2)
        m.bn.num_batches_tracked.fill_(7)
    return m.eval()


def sample_input(seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(5, 4, generator=g)


def plain_keys(sd: Any) -> list[str]:
    return [k for k in sd.keys()]


def assert_same_tensors(got: Any, expected: Any) -> None:
    """Same keys (in any order), bit-identical values, same dtypes and shapes, all on CPU."""
    got_keys = sorted(k for k in got.keys())
    assert got_keys == sorted(expected.keys())
    for k, v in expected.items():
        g = got[k]
        assert isinstance(g, torch.Tensor), (k, type(g))
        assert g.dtype == v.dtype, k
        assert g.shape == v.shape, k
        assert torch.equal(g.cpu(), v.cpu()), k


def sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@contextlib.contextmanager
def tagged(location: str | dict[str, str] | Any):
    """Make torch.save write ``location`` as every storage's tag (or call it with the storage)."""

    def tag(storage: Any) -> str:
        if callable(location):
            return location(storage)
        return location

    with mock.patch.object(tser, "location_tag", tag):
        yield


def assert_one_line_error(p: CliRun | subprocess.CompletedProcess[str], code: int) -> None:
    """Assert ``p`` failed with exit ``code`` and one ``Error: ...`` line on stderr, no traceback."""
    assert p.returncode == code, (p.returncode, p.stdout, p.stderr)
    assert "Traceback" not in p.stderr, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), p.stderr


class Evil:
    """Unpickling this runs ``touch <marker>`` -- ckptfix must never do that."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


# --------------------------------------------------------------------------- factory


@dataclass
class Built:
    path: Path
    expected: dict  # name -> original tensor (the state dict as it should load)
    model: Any = None
    extra: dict = field(default_factory=dict)


class CkptFactory:
    def __init__(self, root: Path) -> None:
        self.root = root

    def p(self, name: str) -> Path:
        out = self.root / name
        out.parent.mkdir(parents=True, exist_ok=True)
        return out

    @staticmethod
    def _save(obj: Any, path: Path, legacy: bool = False, location: Any = None) -> None:
        kw = {"_use_new_zipfile_serialization": False} if legacy else {}
        if location is None:
            torch.save(obj, path, **kw)
        else:
            with tagged(location):
                torch.save(obj, path, **kw)

    # plain / wrapped state dicts
    def plain(self, name: str = "plain.pt", *, legacy: bool = False, location: Any = None, seed: int = 0) -> Built:
        m = tiny_model(seed)
        sd = m.state_dict()
        path = self.p(name)
        self._save(sd, path, legacy, location)
        return Built(path, {k: v.clone() for k, v in sd.items()}, m)

    def dataparallel(self, name: str = "dp.pt", *, legacy: bool = False, location: Any = None) -> Built:
        m = tiny_model()
        sd = nn.DataParallel(m).state_dict()
        assert all(k.startswith("module.") for k in sd)
        path = self.p(name)
        self._save(sd, path, legacy, location)
        return Built(path, {k: v.clone() for k, v in sd.items()}, m)

    def compiled(self, name: str = "compiled.pt") -> Built:
        m = tiny_model()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cm = torch.compile(m, backend="eager")
        sd = cm.state_dict()
        assert all(k.startswith("_orig_mod.") for k in sd)
        path = self.p(name)
        torch.save(sd, path)
        return Built(path, {k: v.clone() for k, v in sd.items()}, m)

    def legacy(self, name: str = "legacy.pt", **kw: Any) -> Built:
        return self.plain(name, legacy=True, **kw)

    def cuda_tagged(
        self, name: str = "cuda7.pt", device: str = "cuda:7", *, legacy: bool = False, dp: bool = False
    ) -> Built:
        return (self.dataparallel if dp else self.plain)(name, legacy=legacy, location=device)

    def mixed_tagged(self, name: str = "mixed.pt", *, legacy: bool = False) -> Built:
        """Float parameters tagged cuda:1, integer buffer (num_batches_tracked) tagged cpu."""
        m = tiny_model()
        sd = m.state_dict()
        cpu_ptr = sd["bn.num_batches_tracked"].data_ptr()
        path = self.p(name)
        self._save(sd, path, legacy, lambda st: "cpu" if st.data_ptr() == cpu_ptr else "cuda:1")
        return Built(path, {k: v.clone() for k, v in sd.items()}, m)

    def tied(self, name: str = "tied.pt", *, legacy: bool = False, location: Any = None) -> Built:
        torch.manual_seed(0)
        m = TiedNet().eval()
        sd = m.state_dict()
        assert sd["emb.weight"].data_ptr() == sd["head.weight"].data_ptr()
        path = self.p(name)
        self._save(sd, path, legacy, location)
        return Built(path, {k: v.clone() for k, v in sd.items()}, m)

    def wrapped(
        self, name: str = "wrapped.pt", *, legacy: bool = False, location: Any = None, prefix: str = "module."
    ) -> Built:
        """{'model': {prefix+k: t}, 'optimizer': ..., 'epoch': 5} -- a training checkpoint."""
        m = tiny_model()
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        m.train()
        m(sample_input()).sum().backward()
        opt.step()
        m.eval()
        base = m.state_dict()
        sd = OrderedDict((prefix + k, v) for k, v in base.items())
        sd._metadata = OrderedDict(
            [("", {"version": 1})]
            + [  # type: ignore[attr-defined]
                ((prefix + k) if k else prefix.rstrip("."), v) for k, v in base._metadata.items()
            ]
        )
        obj = {"model": sd, "optimizer": opt.state_dict(), "epoch": 5, "best": 0.25, "note": "hi"}
        path = self.p(name)
        self._save(obj, path, legacy, location)
        return Built(path, {k: v.clone() for k, v in sd.items()}, m, {"optimizer": opt.state_dict(), "epoch": 5})

    def lightning(self, name: str = "lit.ckpt", *, legacy: bool = False) -> Built:
        m = tiny_model()
        base = m.state_dict()
        sd = OrderedDict(("model." + k, v) for k, v in base.items())
        sd._metadata = OrderedDict(
            [("", {"version": 1})]
            + [  # type: ignore[attr-defined]
                (("model." + k) if k else "model", v) for k, v in base._metadata.items()
            ]
        )
        obj = {
            "epoch": 3,
            "global_step": 120,
            "pytorch-lightning_version": "2.1.0",
            "state_dict": sd,
            "optimizer_states": [{"state": {}, "param_groups": [{"lr": 0.01, "params": [0, 1]}]}],
            "lr_schedulers": [],
            "hyper_parameters": argparse.Namespace(lr=0.01, hidden=3, name="tiny"),
        }
        path = self.p(name)
        self._save(obj, path, legacy)
        return Built(path, {k: v.clone() for k, v in sd.items()}, m, {"epoch": 3})

    def safetensors(self, name: str = "model.safetensors", *, prefix: str = "", metadata: dict | None = None) -> Built:
        from safetensors.torch import save_file

        m = tiny_model()
        sd = {prefix + k: v.contiguous() for k, v in m.state_dict().items()}
        path = self.p(name)
        save_file(sd, str(path), metadata=metadata)
        return Built(path, {k: v.clone() for k, v in sd.items()}, m)

    def sharded_bin(self, dirname: str = "hf_bin", prefix: str = "") -> Built:
        m = tiny_model()
        sd = {prefix + k: v for k, v in m.state_dict().items()}
        keys = list(sd)
        half = len(keys) // 2
        d = self.p(dirname)
        d.mkdir(exist_ok=True)
        shards = {"pytorch_model-00001-of-00002.bin": keys[:half], "pytorch_model-00002-of-00002.bin": keys[half:]}
        wm = {}
        for fname, ks in shards.items():
            torch.save({k: sd[k] for k in ks}, d / fname)
            wm.update({k: fname for k in ks})
        idx = d / "pytorch_model.bin.index.json"
        idx.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": wm}))
        return Built(idx, {k: v.clone() for k, v in sd.items()}, m, {"dir": d, "shards": list(shards)})

    def sharded_safetensors(self, dirname: str = "hf_st", prefix: str = "") -> Built:
        from safetensors.torch import save_file

        m = tiny_model()
        sd = {prefix + k: v.contiguous() for k, v in m.state_dict().items()}
        keys = list(sd)
        half = len(keys) // 2
        d = self.p(dirname)
        d.mkdir(exist_ok=True)
        shards = {"model-00001-of-00002.safetensors": keys[:half], "model-00002-of-00002.safetensors": keys[half:]}
        wm = {}
        for fname, ks in shards.items():
            save_file({k: sd[k] for k in ks}, str(d / fname), metadata={"format": "pt"})
            wm.update({k: fname for k in ks})
        idx = d / "model.safetensors.index.json"
        idx.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": wm}))
        return Built(idx, {k: v.clone() for k, v in sd.items()}, m, {"dir": d, "shards": list(shards)})

    def dcp(self, dirname: str = "dcp_ckpt") -> Built:
        import torch.distributed.checkpoint as dcp

        m = tiny_model()
        sd = {k: v.clone() for k, v in m.state_dict().items()}
        d = self.p(dirname)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(sd, checkpoint_id=str(d))
        return Built(d, {k: v.clone() for k, v in sd.items()}, m)

    def torchscript(self, name: str = "scripted.pt") -> Built:
        m = tiny_model()
        sm = torch.jit.script(m)
        path = self.p(name)
        sm.save(str(path))
        return Built(path, {k: v.clone() for k, v in m.state_dict().items()}, m)

    def weird_root(self, name: str = "weird_name.pt") -> Built:
        b = self.plain(name)
        names = zipfile.ZipFile(b.path).namelist()
        root = names[0].split("/")[0]
        assert root == Path(name).stem and root != "archive", names
        b.extra["root"] = root
        return b

    def unimportable_args(self, name: str = "args.pt", *, legacy: bool = False) -> Built:
        """``args`` is an instance of ``models.TrainArgs`` from a module that no longer exists."""
        moddir = self.root / "_gone_models_pkg"
        moddir.mkdir(exist_ok=True)
        (moddir / "models.py").write_text(
            "class TrainArgs:\n    def __init__(self, lr, depth):\n        self.lr = lr\n        self.depth = depth\n"
        )
        saved_mod = sys.modules.pop("models", None)
        sys.path.insert(0, str(moddir))
        try:
            import models  # type: ignore[import-not-found]

            m = tiny_model()
            sd = m.state_dict()
            obj = {"state_dict": sd, "args": models.TrainArgs(0.1, 4), "epoch": 2}
            path = self.p(name)
            self._save(obj, path, legacy)
        finally:
            sys.path.remove(str(moddir))
            sys.modules.pop("models", None)
            if saved_mod is not None:
                sys.modules["models"] = saved_mod
        (moddir / "models.py").unlink()
        return Built(path, {k: v.clone() for k, v in sd.items()}, m)

    def evil(self, name: str = "evil.pt", *, mode: str = "zip") -> Built:
        """A checkpoint whose unpickling would run ``touch <marker>``. mode: zip, legacy, pickle."""
        import pickle

        marker = self.root / f"pwned_{Path(name).stem}_{mode}"
        m = tiny_model()
        sd = m.state_dict()
        path = self.p(name)
        obj = {"state_dict": sd, "payload": Evil(str(marker)), "epoch": 1}
        if mode == "zip":
            torch.save(obj, path)
        elif mode == "legacy":
            torch.save(obj, path, _use_new_zipfile_serialization=False)
        elif mode == "pickle":
            with open(path, "wb") as f:
                pickle.dump({"weights": [1.0, 2.0], "payload": Evil(str(marker))}, f, protocol=2)
        else:
            raise ValueError(mode)
        assert not marker.exists()
        return Built(path, {k: v.clone() for k, v in sd.items()}, m, {"marker": marker})


# --------------------------------------------------------------------------- odd files, built by hand


def dp_state_dict() -> dict[str, torch.Tensor]:
    """Six 5x3 float tensors under DataParallel's ``module.`` prefix (seeded, so equal on every call)."""
    torch.manual_seed(0)
    return {f"module.l{i}.weight": torch.randn(5, 3) for i in range(6)}


def leftovers(d: str | os.PathLike) -> list[str]:
    """Hidden or ``.tmp`` files in ``d``: what an interrupted or refused write must not leave behind."""
    return sorted(n for n in os.listdir(d) if n.startswith(".") or n.endswith(".tmp"))


def zip_data_offsets(path: str | os.PathLike) -> dict[str, int]:
    """Each zip member's name -> the file offset where its data starts (after the local header)."""
    out = {}
    with zipfile.ZipFile(path) as zf, open(path, "rb") as f:
        for info in zf.infolist():
            f.seek(info.header_offset + 26)
            n, e = struct.unpack("<HH", f.read(4))
            out[info.filename] = info.header_offset + 30 + n + e
    return out


def rezip(src: str | os.PathLike, dst: str | os.PathLike, compress_for: Any = None, order: Any = None) -> None:
    """Copy zip ``src`` to ``dst`` as Python's zipfile writes it (no 64-byte alignment).

    Args:
        src: a torch zip checkpoint.
        dst: where to write.
        compress_for: member name -> zipfile compression constant (default: stored).
        order: member names -> member names in the order to write them.
    """
    compress = compress_for or (lambda name: zipfile.ZIP_STORED)
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        names = order(zin.namelist()) if order else zin.namelist()
        for n in names:
            zout.writestr(zipfile.ZipInfo(n), zin.read(n), compress_type=compress(n))


def inject_into_data_pkl(src: str | os.PathLike, dst: str | os.PathLike, payload: bytes) -> None:
    """Copy zip checkpoint ``src`` to ``dst`` with ``"evil": <payload>`` added to data.pkl's top-level dict."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for n in zin.namelist():
            data = zin.read(n)
            if n.endswith("data.pkl"):
                assert data.endswith(b".")
                data = data[:-1] + b"X\x04\x00\x00\x00evil" + payload + b"s."
            zout.writestr(zipfile.ZipInfo(n), data)


def write_raw_safetensors(path: Path, header: Any, data: bytes, raw: bytes | None = None) -> None:
    """Write a safetensors file with any header (``raw`` bytes instead of ``json.dumps(header)``), padded to 8."""
    h = raw if raw is not None else json.dumps(header).encode()
    h += b" " * ((-len(h)) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)


# --------------------------------------------------------------------------- golden files

GOLDEN = Path(__file__).parent / "golden"
UPDATE_GOLDEN = os.environ.get("CKPTFIX_UPDATE_GOLDEN") == "1"


def check_golden(path: Path, text: str) -> None:
    """Assert ``text`` equals golden file ``path``; with ``CKPTFIX_UPDATE_GOLDEN=1``, (re)write it instead.

    Args:
        path: the golden file, under tests/golden/.
        text: what the command printed (as a transcript).
    """
    if UPDATE_GOLDEN:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return
    assert path.exists(), f"no {path}: run CKPTFIX_UPDATE_GOLDEN=1 pytest on this test"
    assert text == path.read_text(), f"output differs from {path} (regenerate it if the change is intended)"
