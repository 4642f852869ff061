"""Ask nvidia-smi about the machine: :func:`query` runs the calls (through :mod:`ckptfix.gpu.runner`) and
assembles the parsed answers (:mod:`ckptfix.gpu.parse`) into one :class:`SmiSnapshot`.

Nothing here imports torch.  A *runner* (``argv, timeout -> RunResult``) can replace the subprocess.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Mapping, Sequence

from ckptfix.errors import GpuQueryError, NoGpuError
from ckptfix.gpu.parse import (
    APP_FIELDS,
    BASIC_GPU_FIELDS,
    GPU_FIELDS,
    classify_failure,
    first_lines,
    parse_apps_csv,
    parse_gpu_csv,
    parse_list,
)
from ckptfix.gpu.records import GpuProcess, MigDevice, SmiGpu, SmiSnapshot
from ckptfix.gpu.runner import Runner, RunResult, find_nvidia_smi, run_parallel

__all__ = ["query"]


def _gpu_argv(smi: str, fields: Sequence[str]) -> list[str]:
    return [smi, f"--query-gpu={','.join(fields)}", "--format=csv,nounits"]


def _apps_argv(smi: str) -> list[str]:
    return [smi, f"--query-compute-apps={','.join(APP_FIELDS)}", "--format=csv,nounits"]


class _Calls:
    """Runs nvidia-smi commands (in parallel, or one by one through an injected runner) and counts them.

    (A plain class, as :class:`_Assembly`: both are private to :func:`query`, and a dataclass costs start-up.)
    """

    def __init__(self, runner: Runner | None, timeout: float) -> None:
        self.runner = runner
        self.timeout = timeout
        self.count = 0

    def run(self, cmds: list[list[str]], optional: frozenset[int] = frozenset()) -> list[RunResult]:
        self.count += len(cmds)
        if self.runner is None:
            return run_parallel(cmds, self.timeout, optional)
        out: list[RunResult] = []
        for i, c in enumerate(cmds):
            try:
                out.append(self.runner(c, self.timeout))
            except GpuQueryError:  # a runner's timeout
                if i not in optional:
                    raise
                out.append(RunResult(-1, "", "", timed_out=True))
        return out


class _Assembly:
    """What :func:`query` has learned so far."""

    def __init__(self, gpus: list[SmiGpu], warnings: list[str]) -> None:
        self.gpus = gpus
        self.warnings = warnings
        self.processes_known = False
        self.by_uuid: dict[str, list[GpuProcess]] = {}
        self.mig_devices: dict[str, list[MigDevice]] = {}
        self.mig_listed = False


def _rejected_field(said: str, fields: Sequence[str]) -> str | None:
    """The field nvidia-smi names in ``Field "mig.mode.current" is not a valid field to query.``, if one we asked."""
    for part in said.split('"')[1::2]:
        if part.strip().lower() in fields:
            return part.strip().lower()
    return None


def _older_driver_retry(calls: _Calls, smi: str, gres: RunResult) -> tuple[RunResult, tuple[str, ...]]:
    """Ask again without each field the driver rejects ("Field "X" is not a valid field to query"), one at a
    time: an R418 driver lacks ``mig.mode.current`` and ``compute_cap`` but answers temperature and power."""
    fields: tuple[str, ...] = GPU_FIELDS
    for _ in range(len(GPU_FIELDS)):
        if gres.returncode == 0 or fields == BASIC_GPU_FIELDS:
            break
        said = (gres.stdout + gres.stderr).lower()
        if "not a valid field" not in said:
            break
        bad = _rejected_field(said, fields)
        if bad is None or bad in BASIC_GPU_FIELDS:  # not named (or a field every driver has): the safe minimum
            fields = BASIC_GPU_FIELDS
        else:
            fields = tuple(f for f in fields if f != bad)
        gres = calls.run([_gpu_argv(smi, fields)])[0]
    return gres, fields


def _gpus_or_raise(gres: RunResult, fields: Sequence[str]) -> _Assembly:
    """Parse the ``--query-gpu`` answer; raise the error a user should see when it lists no GPU."""
    gpus, junk = parse_gpu_csv(gres.stdout, fields)
    if not gpus:
        err = classify_failure(gres.returncode, gres.stdout, gres.stderr)
        if err is not None:
            raise err
        if gres.returncode == 0 and not (gres.stdout + gres.stderr).strip():
            raise NoGpuError("nvidia-smi lists no GPU: there is no usable NVIDIA GPU here; run on CPU")
        raise GpuQueryError(
            f"nvidia-smi exited with code {gres.returncode} and printed nothing usable: "
            f"{first_lines(gres.stdout + chr(10) + gres.stderr) or '(no output)'}; run `nvidia-smi` to see why"
        )
    out = _Assembly(gpus, [f"nvidia-smi: {j}" for j in junk])
    if gres.returncode != 0:
        out.warnings.append(f"nvidia-smi exited with code {gres.returncode} but printed usable output")
    for line in gres.stderr.splitlines():
        if line.strip() and f"nvidia-smi: {line.strip()}" not in out.warnings:
            out.warnings.append(f"nvidia-smi: {line.strip()}")
    return out


def _add_processes(got: _Assembly, ares: RunResult, timeout: float) -> None:
    """File the ``--query-compute-apps`` rows by GPU UUID, or warn that process counts are unknown."""
    procs, _ = parse_apps_csv(ares.stdout)
    if not ares.timed_out and (ares.returncode == 0 or procs):
        got.processes_known = True
        for p in procs:
            got.by_uuid.setdefault(p.gpu_uuid or "", []).append(p)
        return
    if ares.timed_out:
        why = f"did not answer within {timeout:g}s"
    else:
        said = first_lines(ares.stdout + "\n" + ares.stderr, 1)
        why = f"failed (code {ares.returncode}{': ' + said if said else ''})"
    got.warnings.append(
        f"nvidia-smi --query-compute-apps {why}: process counts unknown (? in the table, null in --json); "
        "pick-gpu --max-procs rejects every GPU until it answers; check `nvidia-smi` and `dmesg`, or retry"
    )


def _add_mig_devices(got: _Assembly, lres: RunResult) -> None:
    """File the MIG devices of ``nvidia-smi -L`` by parent UUID."""
    _, migs, _ = parse_list(lres.stdout)
    got.mig_listed = lres.returncode == 0 or bool(migs)
    for m in migs:
        got.mig_devices.setdefault(m.parent_uuid or "", []).append(m)


def _warn_unlisted_processes(got: _Assembly) -> None:
    listed = {g.uuid for g in got.gpus if g.uuid}
    for u, plist in sorted(got.by_uuid.items()):
        if u not in listed:
            pids = ", ".join(str(p.pid) for p in plist[:5]) + (", ..." if len(plist) > 5 else "")
            got.warnings.append(
                f"nvidia-smi lists {len(plist)} compute process(es) (pid {pids}) on {u or 'a GPU without UUID'}, "
                "which --query-gpu did not list (a GPU it could not read?): they are not counted; check "
                "`nvidia-smi` and `dmesg`"
            )


def _snapshot(got: _Assembly, calls: int) -> SmiSnapshot:
    out: list[SmiGpu] = []
    for g in got.gpus:
        procs_here: tuple[GpuProcess, ...] | None = None
        if got.processes_known:
            procs_here = tuple(got.by_uuid.get(g.uuid or "\0", ())) if g.uuid else None
        migs_here = tuple(got.mig_devices.get(g.uuid or "\0", ()))
        out.append(replace(g, processes=procs_here, mig_devices=migs_here))
    return SmiSnapshot(
        gpus=tuple(out),
        driver_version=next((g.driver_version for g in out if g.driver_version), None),
        warnings=tuple(got.warnings),
        calls=calls,
        processes_known=got.processes_known,
        mig_listed=got.mig_listed,
    )


def query(
    *,
    runner: Runner | None = None,
    timeout: float = 10.0,
    processes: bool = True,
    mig: bool | None = None,
    env: Mapping[str, str] | None = None,
) -> SmiSnapshot:
    """Ask nvidia-smi about the machine: one ``--query-gpu`` call, plus ``--query-compute-apps`` (run
    concurrently) when ``processes``, plus ``-L`` only when a GPU has MIG enabled (or ``mig=True``).

    Args:
        runner: runs one command (default: the real nvidia-smi, several calls in parallel).
        timeout: seconds to wait for nvidia-smi.
        processes: also list the compute processes.
        mig: ``True`` lists MIG devices up front, ``None`` only when a GPU has MIG enabled, ``False`` never.
        env: the environment (``$CKPTFIX_NVIDIA_SMI``, ``PATH``; default ``os.environ``).

    Returns:
        The :class:`SmiSnapshot`: every GPU (with its processes and MIG devices), driver, warnings.

    Raises:
        GpuToolingError: nvidia-smi is missing or cannot be run (exit 20).
        NoGpuError: no devices (21); DriverNotLoadedError (26); DriverMismatchError (27).
        GpuQueryError: nvidia-smi failed otherwise or timed out (25).  Only the ``--query-gpu``
            call raises: a failed or hung ``--query-compute-apps`` leaves every process count
            unknown (``None``, ``processes_known=False``) with a warning saying why.
    """
    smi = find_nvidia_smi(os.environ if env is None else env) if runner is None else "nvidia-smi"
    calls = _Calls(runner, timeout)
    cmds = [_gpu_argv(smi, GPU_FIELDS)] + ([_apps_argv(smi)] if processes else [])
    if mig:  # known up front (CUDA_VISIBLE_DEVICES names MIG devices): list them in the same round
        cmds.append([smi, "-L"])
    # the process list is optional: if it hangs or fails, process counts become unknown (a warning)
    results = calls.run(cmds, frozenset({1}) if processes else frozenset())
    gres, fields = _older_driver_retry(calls, smi, results[0])
    got = _gpus_or_raise(gres, fields)
    if processes:
        _add_processes(got, results[1], timeout)
    if mig or (mig is None and any(g.mig_enabled for g in got.gpus)):
        _add_mig_devices(got, results[-1] if mig else calls.run([[smi, "-L"]])[0])
    _warn_unlisted_processes(got)
    return _snapshot(got, calls.count)
