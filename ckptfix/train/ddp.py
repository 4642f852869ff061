"""``ddp`` and ``fsdp`` modes: DistributedDataParallel / FSDP2 under ``torchrun``.

:func:`launch` starts ``python -m torch.distributed.run --standalone
--nproc-per-node N -m ckptfix.train.ddp_worker ...`` (``--standalone`` runs a
local c10d rendezvous on a free port, so parallel runs never collide), streams
the workers' output to stderr and returns rank 0's :class:`TrainResult`.

:func:`run_worker` is what every rank runs: ``init_process_group`` (gloo on
CPU, nccl on CUDA with ``cuda:LOCAL_RANK``), the common :class:`Run` with a
``DistributedSampler`` (``set_epoch`` every epoch), ``SyncBatchNorm`` for
BatchNorm models on CUDA, saving on global rank 0 only (atomically, then a
barrier), DCP shards on every rank.

For multi-node, start the workers with your own torchrun (every node runs the
same command; only ``--node-rank``-free c10d rendezvous is needed)::

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d \\
        --rdzv-endpoint node0.example:29400 --rdzv-id job42 \\
        -m ckptfix train --mode ddp --out /shared/run

``ckptfix train --mode ddp`` notices it is a torchrun worker (``LOCAL_RANK``,
``RANK``, ``WORLD_SIZE`` in the environment) and trains as that rank instead
of launching.  ``--out`` must be on storage every node can see.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ckptfix.errors import TrainingError
from ckptfix.train.config import TrainConfig, TrainResult, process_group_backend

if TYPE_CHECKING:
    import torch


def under_torchrun() -> bool:
    """Whether this process is a worker started by torchrun (or any launcher setting the env:// variables).

    Returns:
        True when ``LOCAL_RANK``, ``RANK`` and ``WORLD_SIZE`` are all set.
    """
    return all(k in os.environ for k in ("LOCAL_RANK", "RANK", "WORLD_SIZE"))


def _package_root() -> str:
    """The folder holding the ``ckptfix`` package (this file is ``ckptfix/train/ddp.py``)."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def default_nproc(device_type: str) -> int:
    """How many workers ``ddp``/``fsdp`` start without ``--nproc``.

    Returns:
        The GPU count on CUDA (at least 1), else 2.
    """
    import torch

    if device_type == "cuda":
        return max(1, torch.cuda.device_count())
    return 2


PROGRESS_MARK = "\x1eckptfix\x1e "  # rank 0's progress lines carry this; the launcher shows only them
STARTED_MARK = "\x1eckptfix-started\x1e"  # rank 0 prints it once the process group is up

# Lines that name the cause of a failed torchrun job, most specific first.
_CAUSE_PATTERNS = (
    re.compile(r"\[rank \d+\] Error: .*"),
    re.compile(r"^\s*(?:[\w.]+\.)?\w*(?:Error|Exception|Interrupt)\b: .+"),
    re.compile(r"(?:Address already in use|Connection refused|timed out|Killed|Signal \d+).*", re.I),
)


def failure_cause(lines: list[str]) -> str:
    """The line of a torchrun log that best says why it failed (the last match of the most specific pattern).

    Returns:
        That line, stripped (the last non-empty line when no pattern matches; ``"no output"``).
    """
    for pat in _CAUSE_PATTERNS:
        hits = [ln.strip() for ln in lines if pat.search(ln) and "ChildFailedError" not in ln]
        if hits:
            return hits[-1]
    tail = [ln.strip() for ln in lines if ln.strip()]
    return tail[-1] if tail else "no output"


def preflight(cfg: TrainConfig) -> None:
    """Check in this process what the workers would otherwise find out only inside torchrun.

    The options (:meth:`TrainConfig.validate`), the ``--data`` file, and a ``--resume``
    checkpoint: readable, fits the model, has fewer epochs than ``--epochs``.

    Raises:
        TrainingError: as the workers would raise it, before anything is launched.
        CkptfixError: the ``--data`` or ``--resume`` file cannot be read (its own class).
    """
    cfg.validate()
    if cfg.data and cfg.data != "digits":
        from ckptfix.train.data import load_dataset

        load_dataset(cfg.data)
    if cfg.resume:
        from ckptfix.train.models import build_model
        from ckptfix.train.resume import load_resume

        load_resume(cfg, build_model(cfg.model, cfg.seed))


def _run_torchrun(
    cmd: list[str], env: dict[str, str], log_path: str, *, quiet: bool, timeout: float | None
) -> tuple[int, list[str], bool]:
    """Run torchrun, all output to ``log_path``; returns (exit status, last lines, whether rank 0 reported progress)."""
    lines: list[str] = []
    started = False
    with open(log_path, "w", encoding="utf-8", errors="replace") as log:
        try:
            proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, bufsize=1, errors="replace"
            )
        except OSError as e:
            raise TrainingError(f"cannot start torchrun ({sys.executable} -m torch.distributed.run): {e}") from e
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(STARTED_MARK):
                started = True
                continue
            if line.startswith(PROGRESS_MARK):
                started = True
                line = line[len(PROGRESS_MARK) :]
                if not quiet:
                    sys.stderr.write(line)
                    sys.stderr.flush()
            log.write(line)
            lines.append(line.rstrip("\n"))
            if len(lines) > 2000:
                del lines[:1000]
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise TrainingError(f"torchrun did not finish within {timeout}s (full log: {log_path})") from None
    return rc, lines, started


def launch(cfg: TrainConfig, *, timeout: float | None = None) -> TrainResult:
    """Run ``cfg`` (mode ddp or fsdp) through torchrun with ``cfg.nproc`` local workers; return rank 0's result.

    The configuration is checked first (:func:`preflight`).  The workers' output goes to a log
    file; only rank 0's progress lines are shown.  On failure the error is one line: the
    worker's own ckptfix error, or the log line naming the cause, plus the log's path (kept).
    A job that dies before any rank started training (rendezvous, process-group start-up)
    is retried once.

    Args:
        cfg: The configuration (mode ddp or fsdp).
        timeout: Seconds torchrun may run (None: no limit).

    Returns:
        Rank 0's result.

    Raises:
        TrainingError: the configuration is invalid, torchrun cannot start, a worker failed,
            or the job ran past ``timeout``.
    """
    import torch

    from ckptfix.train.devices import resolve_device

    device_type = resolve_device(cfg.device)
    nproc = cfg.nproc or default_nproc(device_type)
    if device_type == "cuda" and nproc > torch.cuda.device_count():
        raise TrainingError(
            f"--nproc {nproc} with --device cuda needs {nproc} GPUs, but {torch.cuda.device_count()} are visible "
            "(each rank uses its own GPU); lower --nproc or use --device cpu"
        )
    preflight(cfg)
    os.makedirs(cfg.out, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"ckptfix-{cfg.mode}-") as tmp:
        cfg_path = os.path.join(tmp, "config.json")
        res_path = os.path.join(tmp, "result.json")
        with open(cfg_path, "w", encoding="utf-8") as f:
            f.write(_worker_config(cfg, device_type).to_json())
        cmd = _torchrun_command(nproc, cfg_path, res_path)
        env = _torchrun_env()
        if not cfg.quiet:
            print(
                f"[{cfg.mode}] launching: torchrun --standalone --nproc-per-node {nproc} -m ckptfix.train.ddp_worker",
                file=sys.stderr,
                flush=True,
            )
        fd, log_path = tempfile.mkstemp(prefix=f"ckptfix-{cfg.mode}-", suffix=".log")
        os.close(fd)
        try:
            rc, lines = _attempts(cfg, cmd, env, tmp, log_path, timeout)
        except KeyboardInterrupt:
            note_kept(cfg)  # the workers wrote them: name them in the interrupted command's message
            raise
        return _outcome(res_path, rc, lines, log_path)


def note_kept(cfg: TrainConfig) -> None:
    """Record (:func:`ckptfix.files.atomic.note_finished`) the files of run ``cfg`` its manifest lists and exist."""
    from ckptfix.files.atomic import note_finished
    from ckptfix.train.manifest import MANIFEST, read_manifest

    out = os.path.abspath(cfg.out)
    try:
        entries = read_manifest(out).get("checkpoints", [])
    except (OSError, ValueError):
        return
    name = cfg.run_name()
    for e in entries:
        if not isinstance(e, dict) or e.get("run") != name:
            continue
        probe = e.get("probe")
        for rel in (e.get("path"), probe.get("file") if isinstance(probe, dict) else None):
            if isinstance(rel, str) and os.path.lexists(os.path.join(out, rel)):
                note_finished(os.path.join(out, rel))
    if os.path.exists(os.path.join(out, MANIFEST)):
        note_finished(os.path.join(out, MANIFEST))


def _attempts(
    cfg: TrainConfig, cmd: list[str], env: dict[str, str], tmp: str, log_path: str, timeout: float | None
) -> tuple[int, list[str]]:
    """Run torchrun; once more when the first try died before any rank trained.  Returns (status, last lines)."""
    for attempt in (1, 2):
        rc, lines, started = _run_torchrun(cmd, env, log_path, quiet=cfg.quiet, timeout=timeout)
        failed_early = rc != 0 and not started and not any(p.startswith("result.json") for p in os.listdir(tmp))
        if not (failed_early and attempt == 1):
            break
        # The job died before any rank trained (rendezvous / process-group start-up on a loaded
        # machine): nothing was written, so one more try is safe.  The first log is kept.
        os.replace(log_path, log_path + ".attempt1")
        print(
            f"[{cfg.mode}] torchrun failed while starting ({failure_cause(lines)}); retrying once "
            f"(log: {log_path}.attempt1)",
            file=sys.stderr,
            flush=True,
        )
    return rc, lines


def _worker_config(cfg: TrainConfig, device_type: str) -> TrainConfig:
    """The configuration the workers read: absolute paths, the resolved device type."""
    wcfg = TrainConfig.from_dict(cfg.to_dict())
    wcfg.out = os.path.abspath(cfg.out)
    wcfg.device = device_type
    if wcfg.resume:
        wcfg.resume = os.path.abspath(wcfg.resume)
    if wcfg.data and wcfg.data != "digits":
        wcfg.data = os.path.abspath(wcfg.data)
    return wcfg


def _torchrun_command(nproc: int, cfg_path: str, res_path: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--local-addr",
        "127.0.0.1",  # MASTER_ADDR without a hostname lookup (single node)
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(nproc),
        "-m",
        "ckptfix.train.ddp_worker",
        "--config",
        cfg_path,
        "--result",
        res_path,
    ]


def _torchrun_env() -> dict[str, str]:
    """This process's environment for torchrun, without the variables of an enclosing torchrun job."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # N workers share the cores; torchrun would set 1 and warn
    env["CKPTFIX_PROGRESS_MARK"] = "1"
    root = _package_root()
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    for k in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(k, None)
    return env


def _outcome(res_path: str, rc: int, lines: list[str], log_path: str) -> TrainResult:
    """Rank 0's result, or the error: a worker's own (``result.json.errN``) or the log's cause line."""
    tmp = os.path.dirname(res_path)
    errors = sorted(p for p in os.listdir(tmp) if p.startswith(os.path.basename(res_path) + ".err"))
    if errors:
        with open(os.path.join(tmp, errors[0]), encoding="utf-8") as f:
            err = json.load(f)
        if err.get("type") == "internal":
            raise TrainingError(f"{err['message']} (full log: {log_path})")
        os.remove(log_path)
        raise TrainingError(err["message"])
    if rc != 0 or not os.path.exists(res_path):
        raise TrainingError(f"torchrun exited with status {rc}: {failure_cause(lines)} (full log: {log_path})")
    os.remove(log_path)
    with open(res_path, encoding="utf-8") as f:
        return TrainResult.from_dict(json.load(f))


def numpy_free_object_collectives() -> bool:
    """Make torch's object collectives work without numpy; returns True when it had to.

    ``all_gather_object`` / ``broadcast_object_list`` / ``gather_object`` (used by the trainer and
    by DCP's distributed save and load planners) turn the received bytes back into objects with
    ``tensor.numpy().tobytes()`` in torch 2.x, so without numpy every distributed DCP save fails
    with "Numpy is not available".  When numpy cannot be imported, the private helper that does
    this (``distributed_c10d._tensor_to_object``) is replaced with the same code reading the
    tensor's bytes through :func:`ckptfix.train.probe.tensor_bytes`.  With numpy nothing changes.

    Returns:
        True when the helper was replaced (numpy is missing), False when numpy is there.

    Raises:
        TrainingError: numpy is missing and this torch has no such helper to replace.
    """
    try:  # numpy is optional: the trainer must work without it (only torch's helper needs it)
        import numpy  # noqa: F401
    except ImportError:
        pass
    else:
        return False
    import io

    import torch.distributed.distributed_c10d as c10d

    from ckptfix.train.probe import tensor_bytes

    if not hasattr(c10d, "_tensor_to_object") or not hasattr(c10d, "_unpickler"):
        raise TrainingError(
            "this torch's object collectives need numpy and ckptfix cannot work around it here; pip install numpy"
        )

    def _tensor_to_object(tensor: torch.Tensor, tensor_size: Any, group: Any) -> Any:
        buf = tensor_bytes(tensor.cpu())[: int(tensor_size)]
        return c10d._unpickler(io.BytesIO(buf)).load()

    c10d._tensor_to_object = _tensor_to_object
    return True


def _progress_line(msg: str) -> None:
    print(PROGRESS_MARK + msg, file=sys.stderr, flush=True)


def run_worker(cfg: TrainConfig, result_path: str | None = None) -> TrainResult:
    """Train as one rank of a torchrun job (the process group is created and destroyed here).

    Args:
        cfg: The configuration (mode ddp or fsdp).
        result_path: Where rank 0 writes its :class:`TrainResult` as JSON (atomically), or None.

    Returns:
        This rank's result (only rank 0's lists the checkpoints).

    Raises:
        TrainingError: ``LOCAL_RANK`` names a GPU that is not there, or the run fails.
    """
    import torch
    import torch.distributed as dist

    from ckptfix.files.atomic import atomic_output
    from ckptfix.train.devices import Dist, resolve_device
    from ckptfix.train.run import Run

    device_type = resolve_device(cfg.device)
    local_rank = int(os.environ["LOCAL_RANK"])
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    kwargs: dict[str, Any] = {}
    if device_type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise TrainingError(
                f"rank {rank}: LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPU(s) visible on this node"
            )
        torch.cuda.set_device(local_rank)
        kwargs["device_id"] = torch.device("cuda", local_rank)
    numpy_free_object_collectives()
    dist.init_process_group(process_group_backend(device_type), timeout=timedelta(minutes=10), **kwargs)
    if rank == 0 and os.environ.get("CKPTFIX_PROGRESS_MARK") == "1":
        print(STARTED_MARK, file=sys.stderr, flush=True)
    try:
        cfg = TrainConfig.from_dict(cfg.to_dict())
        cfg.device = device_type
        log = _progress_line if os.environ.get("CKPTFIX_PROGRESS_MARK") == "1" else None
        res = Run(cfg, Dist(rank=rank, local_rank=local_rank, world_size=world), log=log).run()
        if rank == 0 and result_path:
            with atomic_output(result_path) as f:
                f.write(json.dumps(res.to_dict()).encode("utf-8"))
        return res
    finally:
        dist.destroy_process_group()
