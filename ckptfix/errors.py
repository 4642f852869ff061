"""One error hierarchy for ckptfix.

Every error carries an ``exit_code`` (what the CLI exits with) and a message
that says what went wrong *and how to fix it*.  Each class also subclasses the
matching built-in exception so callers can catch ``FileNotFoundError`` or
``ValueError`` without knowing about ckptfix.

The exit codes are part of the public interface; docs/exit-codes.md is generated from
this module (``docs/gen_exit_codes.py``, checked by tests/test_docs.py).
"""

from __future__ import annotations


class CkptfixError(Exception):
    """Base class: anything ckptfix raises on purpose."""

    exit_code = 1


class CheckpointNotFoundError(CkptfixError, FileNotFoundError):
    """The path does not exist, or a directory holds no checkpoint."""

    exit_code = 3


class CorruptCheckpointError(CkptfixError, ValueError):
    """The file exists but cannot be read as any checkpoint format."""

    exit_code = 4


class UnsafePickleError(CkptfixError, PermissionError):
    """The pickle references globals we refuse to execute."""

    exit_code = 5


class KeyConflictError(CkptfixError, KeyError):
    """A rename would make two keys collide, or a key/prefix is ambiguous."""

    exit_code = 6

    def __str__(self) -> str:  # KeyError quotes its message; we do not want that
        return str(self.args[0]) if self.args else ""


class VerificationError(CkptfixError, ValueError):
    """A written file does not read back identical to its source."""

    exit_code = 7


class UnsupportedError(CkptfixError, NotImplementedError):
    """A format, dtype or tensor kind ckptfix cannot handle for this operation."""

    exit_code = 8


class OutputError(CkptfixError, OSError):
    """The output cannot be written (exists, permission denied, disk full...)."""

    exit_code = 9


class AlignmentError(CkptfixError, ValueError):
    """After alignment the checkpoint still does not match the target exactly."""

    exit_code = 10


class ScanFindingsError(CkptfixError):
    """``scan`` found dangerous or unknown globals."""

    exit_code = 11


class ResourceLimitError(CkptfixError, ValueError):
    """The input would exceed a safety limit (memory, size, expansion, nesting).

    Raised before the limit is reached, so a small hostile file can never take
    GiB of memory or minutes of CPU.  The message names the option (or
    environment variable) that lifts the limit for a file the user trusts.
    """

    exit_code = 12


class NoTensorsError(CkptfixError, LookupError):
    """A valid checkpoint that holds no tensors (``training_args.bin``, a scheduler state).

    Not corruption: ``inspect`` summarises such files; commands that need
    tensors (convert, strip-prefix ...) raise this.
    """

    exit_code = 13


class NoModelWeightsError(CkptfixError, LookupError):
    """A training framework's folder (or file) that holds training state but no model weights.

    A Trainer ``checkpoint-N/`` without ``model.safetensors`` / ``pytorch_model.bin``, or an
    optimizer file given to ``convert`` without ``--include-optimizer``.
    """

    exit_code = 15


class InputChangedError(CkptfixError, RuntimeError):
    """A local input was replaced while it was read (another program saved over it): nothing mixed is used."""

    exit_code = 16


class TorchMissingError(CkptfixError, ImportError):
    """The operation needs torch, which is not installed (``pip install torch``)."""

    exit_code = 14


class PartitionedCheckpointError(UnsupportedError):
    """The parameters are empty placeholders of a partitioned checkpoint (DeepSpeed ZeRO-3 ``param_shapes``).

    The values live in other files (the optimizer partitions); the message names the command that
    consolidates them.  A subclass of :class:`UnsupportedError` with its own code, so scripts can
    tell "consolidate first" from other refusals.
    """

    exit_code = 17


class OptionNotApplicableError(UnsupportedError):
    """An option was given that the operation, or the direction a conversion takes, does not use (nothing written).

    The message names the option and where it applies; drop it, or pick the output it is for.  A
    subclass of :class:`UnsupportedError` with its own code.
    """

    exit_code = 32


class ZeroIncompleteError(CkptfixError, FileNotFoundError):
    """A DeepSpeed ZeRO checkpoint lacks a rank's partition (a rank did not finish saving, or was not copied)."""

    exit_code = 18


class ZeroMismatchError(CkptfixError, ValueError):
    """A DeepSpeed ZeRO folder mixes partitions of different runs (world sizes, stages, groups)."""

    exit_code = 19


class GpuToolingError(CkptfixError, FileNotFoundError):
    """``nvidia-smi`` is missing or cannot be run."""

    exit_code = 20


class NoGpuError(CkptfixError, RuntimeError):
    """No usable NVIDIA GPU: driver not loaded, no devices, version mismatch..."""

    exit_code = 21


class DriverNotLoadedError(NoGpuError):
    """nvidia-smi exists but cannot talk to the driver (kernel module not loaded)."""

    exit_code = 26


class DriverMismatchError(NoGpuError):
    """The NVML library and the loaded kernel driver have different versions."""

    exit_code = 27


class NoGpuFitsError(CkptfixError, RuntimeError):
    """GPUs exist but none satisfies the request."""

    exit_code = 22


class GpuWaitTimeoutError(CkptfixError, TimeoutError):
    """``--wait`` ran out before enough GPUs qualified."""

    exit_code = 23


class CudaAlreadyInitializedError(CkptfixError, RuntimeError):
    """CUDA is initialised in this process, so CUDA_VISIBLE_DEVICES can no longer change."""

    exit_code = 24


class GpuQueryError(CkptfixError, RuntimeError):
    """``nvidia-smi`` ran but failed or printed something unusable."""

    exit_code = 25


class GpuOutputError(GpuQueryError):
    """``nvidia-smi`` printed a GPU row ckptfix cannot read (a column count or unit that does not fit):
    nothing is picked from it."""

    exit_code = 28


class TrainingError(CkptfixError, RuntimeError):
    """The bundled trainer failed."""

    exit_code = 30


class DemoFailedError(CkptfixError, RuntimeError):
    """At least one step of ``ckptfix demo`` did not verify."""

    exit_code = 31


class RemoteNotFoundError(CheckpointNotFoundError):
    """A remote object (``s3://``, ``gs://``, ``https://`` ...) does not exist: a wrong bucket, key or URL.

    A subclass of :class:`CheckpointNotFoundError` (so of ``FileNotFoundError``) with its own code.
    """

    exit_code = 40


class RemoteAccessDeniedError(CkptfixError, PermissionError):
    """The store refused the request (HTTP 401/403, S3 ``AccessDenied``): credentials or permissions."""

    exit_code = 41


class RemoteThrottledError(CkptfixError, ConnectionError):
    """The store kept throttling the requests (HTTP 429, S3 ``SlowDown``) after every retry."""

    exit_code = 42


class RemoteUnavailableError(CkptfixError, ConnectionError):
    """The store could not be reached or kept failing (connection errors, 5xx, short reads) after every retry."""

    exit_code = 43


class RemoteChangedError(CkptfixError, RuntimeError):
    """The remote object changed while it was being read (its ETag or size changed): nothing mixed is used."""

    exit_code = 44


class RemoteDriverMissingError(CkptfixError, ImportError):
    """A URL needs an fsspec driver that is not installed (``pip install fsspec s3fs``, ``pip install gcsfs``)."""

    exit_code = 45


class RemoteWriteError(CkptfixError, OSError):
    """Writing to object storage failed (``-o s3://...``): the upload was aborted, nothing is left under the name."""

    exit_code = 46


class InterruptedByUserError(CkptfixError, KeyboardInterrupt):
    """Interrupted (Ctrl-C, SIGINT): finished outputs are kept, unfinished temp files removed; nothing else written."""

    exit_code = 130


def all_error_classes() -> list[type[CkptfixError]]:
    """Every error class, base first (docs/gen_exit_codes.py and tests/test_docs.py use it).

    Returns:
        :class:`CkptfixError` and all its subclasses, each class before its subclasses.
    """
    out: list[type[CkptfixError]] = [CkptfixError]
    todo = [CkptfixError]
    while todo:
        for sub in todo.pop().__subclasses__():
            out.append(sub)
            todo.append(sub)
    return out
