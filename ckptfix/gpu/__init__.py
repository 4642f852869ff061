"""GPUs without torch: what CUDA will see, and which GPU to use.

>>> from ckptfix.gpu import visible_gpus, pick_gpu      # doctest: +SKIP
>>> for d in visible_gpus().devices:                      # doctest: +SKIP
...     print(f"cuda:{d.cuda_index} = nvidia-smi {d.smi_index} {d.uuid} {d.name}")
>>> pick_gpu(n=1, min_free="20GiB")                       # doctest: +SKIP
>>> import torch; torch.zeros(1, device="cuda")           # on the picked GPU  # doctest: +SKIP

Nothing in this package imports torch; ``ckptfix.gpu.doctor`` imports it lazily.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable, MutableMapping, Sequence

from ckptfix.errors import DriverMismatchError, DriverNotLoadedError
from ckptfix.gpu.cudainit import cuda_init_route, cuda_initialized
from ckptfix.gpu.cvd import parse_visible_devices
from ckptfix.gpu.records import GpuProcess, MigDevice, Problem, SmiGpu, SmiSnapshot, VisibleGpu
from ckptfix.gpu.runner import Runner
from ckptfix.gpu.visible import GpuView, build_view, visible_gpus

if TYPE_CHECKING:  # what type checkers see; the same names as _FROM_PICK and _FROM_LEASES (tests/test_public_api.py)
    from ckptfix.gpu.leases import Lease
    from ckptfix.gpu.pick import (
        DEFAULT_LEASE_SECONDS,
        Criteria,
        PickResult,
        Ranked,
        Rejected,
        choose_gpus,
        parse_size_mib,
        rank_gpus,
    )

# ckptfix.gpu.pick (and ckptfix.gpu.leases) are imported on first use: `ckptfix gpus` does not need them
_FROM_PICK = {
    "DEFAULT_LEASE_SECONDS",
    "Criteria",
    "PickResult",
    "Ranked",
    "Rejected",
    "choose_gpus",
    "parse_size_mib",
    "rank_gpus",
}
_FROM_LEASES = {"Lease"}


def __getattr__(name: str) -> Any:
    if name in _FROM_PICK:
        from ckptfix.gpu import pick as _pick

        return getattr(_pick, name)
    if name in _FROM_LEASES:
        from ckptfix.gpu import leases as _leases

        return getattr(_leases, name)
    raise AttributeError(f"module 'ckptfix.gpu' has no attribute {name!r}")


__all__ = [
    "visible_gpus",
    "pick_gpu",
    "choose_gpus",
    "build_view",
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


def pick_gpu(
    n: int = 1,
    *,
    min_free: str | int | None = None,
    max_util: int | None = None,
    max_procs: int | None = None,
    exclude: Sequence[str] = (),
    max_temp: float | None = None,
    max_power: float | None = None,
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
    other CUDA library; every such route is detected (:func:`ckptfix.gpu.cudainit.cuda_init_route`)
    and refused rather than silently ignored.  The choice itself is :func:`ckptfix.gpu.pick.choose_gpus`;
    this function adds the check, keeps held leases for the life of the process and applies the environment.

    Calling it again in the same process may choose GPUs this process already holds
    (``lease=True``): they are this process's, not "leased by another job", so they are
    ranked like any other candidate and the held lease is reused (e.g. re-running a notebook cell,
    where the first call already narrowed ``CUDA_VISIBLE_DEVICES`` to them, returns
    the same GPUs).  To get several *different* GPUs, ask for ``n`` of them in one call.

    Args:
        n: how many GPUs.
        min_free: minimum free memory, e.g. ``"10GiB"`` (:func:`~ckptfix.text.parse_size`; a bare number is GiB).
        max_util: maximum utilization in percent.
        max_procs: maximum number of compute processes (memory used by invisible
            processes counts as one).
        exclude: GPUs never to pick: nvidia-smi indices, GPU/MIG UUIDs (or unique prefixes), PCI bus ids.
        max_temp: maximum temperature in degrees C.
        max_power: maximum power draw in watts.
        wait: seconds to keep retrying until enough GPUs qualify (0: fail at once).
        interval: seconds between retries.
        lease: ``True`` holds a lease on the chosen GPUs for the life of this
            process, a number leases them for that many seconds, ``False``/``0`` takes none.
        by: ``"uuid"`` (default) or ``"index"`` ids in ``CUDA_VISIBLE_DEVICES``.
        set_env: write the choice into ``environ`` (default ``os.environ``).
        environ: the environment to read and (with ``set_env``) write.
        runner: runs one nvidia-smi command (tests).
        on_wait: called with a progress line before each wait.

    Returns:
        :class:`PickResult` with ``chosen`` (ranked, each with the reason), ``env``, ``leases``.

    Raises:
        ValueError: ``min_free`` is not a size.
        CudaAlreadyInitializedError: CUDA is already initialised here, by any route (24).
        NoGpuError / GpuToolingError: no GPU or no driver (20, 21, 26, 27): fall back to CPU.
        NoGpuFitsError: too few GPUs qualify (22).  GpuWaitTimeoutError: ``wait`` ran out (23).
        OutputError: the lease directory (``$CKPTFIX_LEASE_DIR``...) is unusable or unsafe (9).
    """
    from ckptfix.gpu.leases import hold_for_process
    from ckptfix.gpu.pick import check_cuda_not_initialized, choose_gpus

    environ = os.environ if environ is None else environ
    if set_env:
        check_cuda_not_initialized()
    result = choose_gpus(
        n,
        min_free=min_free,
        max_util=max_util,
        max_procs=max_procs,
        exclude=exclude,
        max_temp=max_temp,
        max_power=max_power,
        wait=wait,
        interval=interval,
        lease=lease,
        by=by,
        token="",
        env=environ,
        runner=runner,
        on_wait=on_wait,
    )
    hold_for_process(result.leases)
    if set_env:
        environ.update(result.env)
    return result


def __dir__() -> list[str]:
    return sorted(set(globals()) | _FROM_PICK | _FROM_LEASES)
