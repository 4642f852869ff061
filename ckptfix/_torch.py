"""torch on demand: the one place that decides what a missing torch means.

torch is an optional dependency (the ``torch`` extra: ``pip install ".[torch]"`` in a clone).  The
checkpoint reader, scan, prefix surgery, conversion of files to safetensors and
the GPU half never need it; loading tensors (``load_anywhere``, ``--trust``),
``align --to module:factory``, ``train`` and ``demo`` do.  Those call
:func:`require_torch`, which turns a missing torch into a
:class:`~ckptfix.errors.TorchMissingError` (exit code 14) whose message carries
the install command.

>>> INSTALL_COMMAND
'pip install torch'
>>> is_torch_missing(ModuleNotFoundError("No module named 'torch'", name="torch"))
True
>>> is_torch_missing(ModuleNotFoundError("No module named 'numpy'", name="numpy"))
False
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ckptfix.errors import TorchMissingError

#: works however ckptfix itself was installed (from a clone, a git URL; it is not on PyPI yet)
INSTALL_COMMAND = "pip install torch"


#: the warning torch prints on import when numpy is absent; the trainer and loader need no numpy
NUMPY_WARNING = r"Failed to initialize NumPy"


def silence_numpy_warning() -> None:
    """Hide torch's import-time ``UserWarning: Failed to initialize NumPy`` (and only that warning).

    ``ckptfix[torch]`` does not depend on numpy and nothing ckptfix does with torch needs it, so on
    a machine without numpy the warning is noise on every torch-importing command.  Installed
    when ckptfix is imported (so also in torchrun workers), before any of its modules imports torch.
    """
    import warnings

    warnings.filterwarnings("ignore", message=NUMPY_WARNING, category=UserWarning)


def is_torch_missing(exc: BaseException) -> bool:
    """Whether ``exc`` says that torch (or one of its submodules) is not installed.

    Returns:
        True for a ``ModuleNotFoundError`` naming ``torch`` or ``torch.*``.
    """
    if not isinstance(exc, ModuleNotFoundError):
        return False
    name = exc.name or ""
    return name == "torch" or name.startswith("torch.")


def missing_error(feature: str) -> TorchMissingError:
    """The error to raise when ``feature`` needs torch and it is not installed.

    Args:
        feature: what the user asked for, e.g. ``"load_anywhere"`` or ``"ckptfix train"``.

    Returns:
        A :class:`TorchMissingError` whose one-line message names the install command.
    """
    return TorchMissingError(f"{feature} needs torch, which is not installed here; install it with: {INSTALL_COMMAND}")


def require_torch(feature: str) -> ModuleType:
    """Import torch for ``feature``, or raise a one-line error with the install command.

    Args:
        feature: what needs torch, named as the user wrote it (``"load_anywhere"``,
            ``"--trust"``, ``"ckptfix train"``...).

    Raises:
        TorchMissingError: torch is not installed, or is installed but cannot be imported
            (a broken build: missing shared library, ABI mismatch).
    """
    try:
        return importlib.import_module("torch")
    except ModuleNotFoundError as e:
        if is_torch_missing(e):
            raise missing_error(feature) from None
        raise TorchMissingError(
            f"{feature} needs torch, but importing it failed ({e}); reinstall it with: {INSTALL_COMMAND}"
        ) from None
    except (ImportError, OSError) as e:
        raise TorchMissingError(
            f"{feature} needs torch, but importing it failed ({type(e).__name__}: {e}); "
            f"reinstall it with: {INSTALL_COMMAND}"
        ) from None
