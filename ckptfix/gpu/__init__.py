"""GPUs without torch: what CUDA will see, and which GPU to use.

>>> from ckptfix.gpu import visible_gpus, pick_gpu      # doctest: +SKIP
>>> for d in visible_gpus().devices:                      # doctest: +SKIP
...     print(f"cuda:{d.cuda_index} = nvidia-smi {d.smi_index} {d.uuid} {d.name}")
>>> pick_gpu(n=1, min_free="20GiB")                       # doctest: +SKIP
>>> import torch; torch.zeros(1, device="cuda")           # doctest: +SKIP  (lands on the picked GPU)

Nothing in this package imports torch; ``ckptfix.gpu.doctor`` imports it lazily.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, MutableMapping

from ckptfix.gpu.smi import (
    DriverMismatchError,
    DriverNotLoadedError,
    GpuProcess,
    MigDevice,
    Runner,
    SmiGpu,
    SmiSnapshot,
    query,
)
from ckptfix.gpu.visible import (GpuView, Problem, VisibleGpu, build_view, cuda_init_route, cuda_initialized,
                                 parse_visible_devices)

if TYPE_CHECKING:
    from ckptfix.gpu.pick import PickResult

# ckptfix.gpu.pick is imported on first use: `ckptfix gpus` does not need it
_FROM_PICK = {"DEFAULT_LEASE_SECONDS", "Criteria", "Lease", "PickResult", "Ranked", "Rejected", "parse_size_mib", "rank_gpus"}


def __getattr__(name: str) -> Any:
    if name in _FROM_PICK:
        from ckptfix.gpu import pick as _pick

        return getattr(_pick, name)
    raise AttributeError(f"module 'ckptfix.gpu' has no attribute {name!r}")

__all__ = [
    "visible_gpus",
    "pick_gpu",
    "GpuView",
    "VisibleGpu",
    "SmiGpu",
    "SmiSnapshot",
    "GpuProcess",
    "MigDevice",
    "Problem",
    "PickResult",
    "Ranked",
    "Rejected",
    "Lease",
    "Criteria",
    "DriverNotLoadedError",
    "DriverMismatchError",
    "parse_visible_devices",
    "parse_size_mib",
    "rank_gpus",
    "cuda_initialized",
    "cuda_init_route",
    "DEFAULT_LEASE_SECONDS",
]


def visible_gpus(
    *,
    env: Mapping[str, str] | None = None,
    runner: Runner | None = None,
    timeout: float = 10.0,
    processes: bool = True,
) -> GpuView:
    """The GPUs a CUDA process with ``env`` (default: this process's) sees, as ``cuda:0``, ``cuda:1``...

    Runs nvidia-smi once or twice (never imports torch) and applies the driver's
    ``CUDA_VISIBLE_DEVICES`` / ``CUDA_DEVICE_ORDER`` rules.

    Returns:
        A :class:`GpuView`: ``devices`` in CUDA order (each a :class:`VisibleGpu`
        with ``cuda_index``, ``smi_index``, ``uuid``, memory, utilization,
        ``process_count``), ``physical`` (every GPU nvidia-smi lists),
        ``order_certain``, ``warnings`` and ``problems``.

    Raises:
        GpuToolingError: nvidia-smi missing (exit code 20).
        NoGpuError: no GPU (21), driver not loaded (26), driver/library mismatch (27).
        GpuQueryError: nvidia-smi failed otherwise (25).
    """
    env = os.environ if env is None else env
    wants_mig = (env.get("CUDA_VISIBLE_DEVICES") or "").startswith("MIG-") or None
    snap = query(runner=runner, timeout=timeout, processes=processes, mig=wants_mig, env=dict(env))
    return build_view(snap, env, cuda_is_initialized=cuda_initialized())


def pick_gpu(
    n: int = 1,
    *,
    min_free: str | int | None = None,
    max_util: int | None = None,
    max_procs: int | None = None,
    wait: float = 0.0,
    interval: float = 10.0,
    lease: float | bool = True,
    by: str = "uuid",
    set_env: bool = True,
    environ: MutableMapping[str, str] | None = None,
    runner: Runner | None = None,
    on_wait: Callable[[str], None] | None = None,
) -> PickResult:
    """Choose the ``n`` freest GPUs visible to this process and (by default) make them CUDA's devices.

    Call it before anything touches CUDA: it sets ``CUDA_VISIBLE_DEVICES`` (UUIDs)
    and ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` in ``os.environ``.  "Touches CUDA" includes
    ``torch.cuda.is_available()`` and ``device_count()`` on CUDA builds (they run ``cuInit``) and any
    other CUDA library; every such route is detected (:func:`ckptfix.gpu.visible.cuda_init_route`)
    and refused rather than silently ignored.

    Calling it again in the same process may choose GPUs this process already holds
    (``lease=True``): they are this process's, not "leased by another job", so they are
    ranked like any other candidate and the held lease is reused (e.g. re-running a notebook cell,
    where the first call already narrowed ``CUDA_VISIBLE_DEVICES`` to them, returns
    the same GPUs).  To get several *different* GPUs, ask for ``n`` of them in one call.

    Args:
        n: how many GPUs.
        min_free: minimum free memory, e.g. ``"10GiB"`` (a bare number is GiB).
        max_util: maximum utilization in percent.
        max_procs: maximum number of compute processes (memory used by invisible
            processes counts as one).
        wait: seconds to keep retrying until enough GPUs qualify (0: fail at once).
        interval: seconds between retries.
        lease: ``True`` holds a lease on the chosen GPUs for the life of this
            process, a number leases them for that many seconds, ``False``/``0`` takes none.
        by: ``"uuid"`` (default) or ``"index"`` ids in ``CUDA_VISIBLE_DEVICES``.
        set_env: write the choice into ``environ`` (default ``os.environ``).

    Returns:
        :class:`PickResult` with ``chosen`` (ranked, each with the reason), ``env``, ``leases``.

    Raises:
        CudaAlreadyInitializedError: CUDA is already initialised here, by any route (24).
        NoGpuError / GpuToolingError: no GPU or no driver (20, 21, 26, 27): fall back to CPU.
        NoGpuFitsError: too few GPUs qualify (22).  GpuWaitTimeoutError: ``wait`` ran out (23).
        OutputError: the lease directory (``$CKPTFIX_LEASE_DIR``...) is unusable or unsafe (9).
    """
    from ckptfix.gpu.pick import Criteria, check_cuda_not_initialized, hold_for_process, lease_dir, parse_size_mib, pick

    environ = os.environ if environ is None else environ
    if set_env:
        check_cuda_not_initialized()
    crit = Criteria(
        n=n,
        min_free_mib=None if min_free is None else parse_size_mib(min_free),
        max_util=max_util,
        max_procs=max_procs,
    )
    lease_seconds: float | None
    if lease is True:
        lease_seconds = None  # held until this process exits
    elif lease is False:
        lease_seconds = 0.0
    else:
        lease_seconds = float(lease)
    directory: Path = lease_dir(environ)
    result = pick(
        lambda: visible_gpus(env=environ, runner=runner),
        crit,
        lease_seconds=lease_seconds,
        directory=directory,
        wait=wait,
        interval=interval,
        by=by,
        on_wait=on_wait,
    )
    hold_for_process(result.leases)
    if set_env:
        environ.update(result.env)
    return result
