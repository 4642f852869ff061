"""Make a checkpoint loadable with ``torch.load(weights_only=True)``, without torch.

Since torch 2.6 ``torch.load`` defaults to ``weights_only=True``, and many real
checkpoints fail it because of what sits *beside* the weights: an
``argparse.Namespace`` of hyper-parameters, numpy arrays and scalars, omegaconf
containers, a Lightning ``AttributeDict``, a class reference such as
``{"dtype": int}``.  :func:`sanitize_checkpoint` rewrites such a file so that
every object outside torch's weights-only allowlist becomes plain data:

==========================================  ===============================================
found                                       written as
==========================================  ===============================================
``argparse.Namespace``                      ``dict`` of its fields
numpy array (numeric, bool, complex)        tensor (a new storage record, same bytes)
numpy array (strings, objects, other)       ``list`` / ``{"__class__": "numpy.ndarray", ...}``
numpy scalar / ``numpy.dtype``              Python number / dtype name (``"float32"``)
omegaconf ``DictConfig`` / ``ListConfig``   ``dict`` / ``list`` (interpolations kept as strings)
Lightning ``AttributeDict``, ``defaultdict``  ``dict`` (a ``deque``: ``list``)
``frozenset`` / ``range``, ``slice``        ``set`` / ``{"__class__": "builtins.range", ...}``
a user tensor subclass                      the plain tensor it wraps (same storage)
any other instance                          ``dict`` of its state plus ``"__class__": "module.Name"``
a class or function reference               its name as a string (``"builtins.int"``)
==========================================  ===============================================

Tensors and storage sharing are unchanged: the pickle (``data.pkl``) is
rewritten and every storage record is copied by byte range into a new zip
archive (a legacy input becomes a zip).  The reading side is the same
restricted reader as everywhere in ckptfix: nothing from the file runs, and
torch is not imported.  A file whose globals are all allowed is still rewritten
when its pickle uses opcodes torch's weights-only unpickler cannot read
(``pickle_protocol`` 3 or newer); the output is always protocol 2.  Before the output is renamed into place it is read
back and must name only globals in torch's weights-only allowlist
(:func:`ckptfix.ops.rewrite.check_written`).

:class:`~ckptfix.ops.plaindata.Plainer` (:mod:`ckptfix.ops.plaindata`, re-exported here) is the converter
itself; ``convert`` uses it (with arrays as lists) for the non-tensor entries it keeps as JSON metadata.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable

import ckptfix.formats.layouts  # noqa: F401  (registers checkpoint-N/ sub-folders for sniff's folder message)
from ckptfix.errors import UnsupportedError
from ckptfix.files import pins
from ckptfix.files.outputs import OutputKeywords, OutputOptions
from ckptfix.files.progress import reporting
from ckptfix.files.source import in_session
from ckptfix.formats.base import Format, ZipDetails
from ckptfix.formats.registry import dispatch
from ckptfix.ops.plaindata import Change, Plainer, normalise_global, opcodes_weights_only_cannot_read
from ckptfix.ops.rewrite.remote import is_remote, rewrite_remote
from ckptfix.pickles.policy import classify_global

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ckptfix.formats import CheckpointFile

__all__ = ["sanitize_checkpoint", "SanitizeReport", "Plainer", "normalise_global", "Change"]


@dataclass
class SanitizeReport:
    """What :func:`sanitize_checkpoint` did.  ``to_dict()`` is the ``--json`` document."""

    source: str
    output: str | None
    format_in: str
    format_out: str = "torch-zip"
    changed: bool = False
    changes: list[Change] = field(default_factory=list)
    new_tensors: int = 0
    tensors: int = 0
    globals_before: list[str] = field(default_factory=list)
    globals_after: list[str] = field(default_factory=list)
    backup: str | None = None
    verified: bool = False
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """One line for the terminal.

        Returns:
            What was made plain data and what is left, or that nothing needed a change.
        """
        if not self.changed:
            return f"{self.source}: already loadable with weights_only=True; nothing to change"
        return (
            f"{len(self.changes)} object(s) made plain data ({self.new_tensors} numpy array(s) became "
            f"tensors); {len(self.globals_after)} global(s) left, all in torch's weights-only allowlist"
        )

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` document.

        Returns:
            Every field, the changes as dicts, and ``summary``.
        """
        d = dict(self.__dict__)
        d["changes"] = [c.to_dict() for c in self.changes]
        d["summary"] = self.summary()
        return d


def _unsafe_globals(names: Iterable[str]) -> list[str]:
    return sorted(g for g in names if classify_global(g) != "safe")


@in_session
def sanitize_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike | None = None,
    *,
    outputs: OutputOptions | None = None,
    **keywords: Unpack[OutputKeywords],
) -> SanitizeReport:
    """Rewrite ``src`` so that plain ``torch.load(path, weights_only=True)`` loads it.

    Args:
        src: a torch checkpoint (zip or legacy format; Lightning ``.ckpt``, ``training_args.bin`` ...).
        dst: where to write (default ``<stem>.sanitized<ext>`` next to ``src``); overrides ``outputs.output``.
        outputs: where and how to write (:class:`~ckptfix.files.outputs.OutputOptions`), or its fields as
            ``keywords``; sanitize uses ``output``, ``in_place`` (replace ``src`` itself: temp file,
            fsync, rename, keeping ``src.bak`` unless ``backup=False``), ``backup``, ``force`` (overwrite
            an existing output), ``fsync`` and ``progress`` (``progress(done_bytes, total_bytes)``,
            called once the storages are copied).

    Returns:
        SanitizeReport: every object that became plain data (path, what it was, what it is now);
        ``output`` is None when the file needed no change.

    Raises:
        UnsupportedError: not a torch pickle checkpoint (safetensors needs no sanitizing; a sharded
            index, DCP or TorchScript cannot be handled here).
        OutputError: ``dst`` exists without ``force``, is the input, or cannot be written.
        VerificationError: the written file names a global outside the allowlist or does not read
            back; nothing is replaced.
        OptionNotApplicableError: an option sanitize does not use (``key``, ``jobs`` ...).
    """
    o = OutputOptions.build(outputs, keywords).with_output(dst).named("sanitized")
    o.refuse(SANITIZE_USES, "sanitize (it rewrites one whole torch.save file and always reads it back)")
    if is_remote(src, o.output):  # a URL in or out: staged locally (ckptfix.ops.rewrite.remote)
        return rewrite_remote(os.fspath(src), o, lambda s, oo: sanitize_checkpoint(s, outputs=oo))
    size = pins.fstat(src).st_size if os.path.isfile(src) else 0
    with reporting(o.progress, size):
        return _sanitize(src, o)


def refuse_safetensors(cf: CheckpointFile, src: str, outputs: OutputOptions) -> SanitizeReport:
    """The ``sanitize`` entry of safetensors: it holds no pickle, or it is a polyglot torch.load would run."""
    from ckptfix.ops.inspect import scan_unsafe

    other = scan_unsafe(cf.input)  # what was read, not sniffed again
    if other:
        raise UnsupportedError(
            f"{src}: a safetensors file that is also a pickle naming {', '.join(other[:3])} (a polyglot): "
            "torch.load would run it; read it only with safetensors.torch.load_file, or `ckptfix convert` it"
        )
    raise UnsupportedError(f"{src}: a safetensors file holds no pickle; it already loads without weights_only concerns")


def _storage_key_allocator(cf: CheckpointFile) -> Callable[[], str]:
    """A function returning the next storage key the archive does not use (referenced or not)."""
    used = set(cf.storages)
    if isinstance(cf.details, ZipDetails):  # also members nothing refers to: never a name twice
        data_dir = f"{cf.details.root}data/"
        used.update(n[len(data_dir) :] for n in cf.details.members if n.startswith(data_dir))
    counter = [len(used)]

    def new_key() -> str:  # the next free integer, as torch numbers its storages
        while str(counter[0]) in used:
            counter[0] += 1
        used.add(str(counter[0]))
        return str(counter[0])

    return new_key


#: the :class:`~ckptfix.files.outputs.OutputOptions` fields sanitize uses
SANITIZE_USES = frozenset(("output", "in_place", "backup", "force", "fsync", "suffix", "progress"))


#: a format's ``sanitize`` entry in the format registry: ``(checkpoint read, src, outputs) -> report``
Sanitize = Callable[["CheckpointFile", str, OutputOptions], "SanitizeReport"]


def _sanitize(given: str | os.PathLike, outputs: OutputOptions) -> SanitizeReport:
    from ckptfix.formats import read_checkpoint

    src = os.fspath(given)
    cf = read_checkpoint(given)  # the one sniff (none for an Input)
    sanitize: Sanitize = dispatch(cf.format, "sanitize", src)  # the format registry's entry, or its refusal
    return sanitize(cf, src, outputs)


def sanitize_file(cf: CheckpointFile, src: str, outputs: OutputOptions) -> SanitizeReport:
    """The ``sanitize`` entry of a torch.save file (zip or legacy): its pickle rewritten as plain data."""
    from ckptfix.formats import iter_tensors
    from ckptfix.ops.rewrite.output import prepare_output, write_atomic
    from ckptfix.ops.rewrite.verify import check_written
    from ckptfix.ops.rewrite.writers import write_checkpoint_zip

    before = _unsafe_globals(cf.globals_seen)
    rep = SanitizeReport(source=src, output=None, format_in=cf.format, globals_before=before)
    rep.tensors = sum(1 for _ in iter_tensors(cf.obj, depth=64))
    if not before:  # the state dict's pickle is clean: the file's other pickles (a legacy stream's header ...)?
        from ckptfix.ops.inspect import scan_unsafe

        if other := scan_unsafe(cf.input):
            before = other
            rep.globals_before = before
            rep.notes.append(
                f"the file's other pickles name {', '.join(other[:3])}: the output holds the checkpoint without them"
            )
    bad_ops = [] if before else opcodes_weights_only_cannot_read(src, cf.format)
    if not before and not bad_ops:  # torch.load(weights_only=True) reads legacy files too
        rep.notes.append("nothing to change; no file written")
        return rep
    if bad_ops:
        rep.notes.append(
            f"the pickle uses opcodes torch's weights-only loader cannot read ({', '.join(bad_ops)}: "
            "pickle protocol 3 or newer, or the text opcodes Python 2 wrote); written at protocol 2"
        )
    pl = Plainer(arrays="tensor", storage_key=_storage_key_allocator(cf))
    if isinstance(cf.details, ZipDetails) and cf.details.byteorder == "big":
        pl.byteorder = "big"
    obj = pl.convert(cf.obj)
    rep.changes = pl.changes
    rep.new_tensors = len(pl.new_storages)
    rep.changed = True
    if cf.format == Format.TORCH_LEGACY:
        rep.notes.append("the legacy (pre-1.6) input was written in the zip format torch uses since 1.6")
    from ckptfix.ops.rewrite.location import kept_device_note

    kept = kept_device_note([cf], hint="torch.load needs map_location='cpu' where that device is missing")
    if kept:
        rep.notes.append(kept)
    in_place, backup = outputs.in_place, outputs.backup
    dst_path, fsync = prepare_output(src, outputs, fmt_out="torch-zip", notes=rep.notes)

    def write(f: Any) -> None:
        write_checkpoint_zip(cf, obj, f, new_storages=pl.new_storages)

    def check(tmp: str) -> None:
        after = check_written(
            tmp, cf, expect_obj=obj, weights_only=True, new_storages=pl.new_storages, what=src if in_place else dst_path
        )
        rep.globals_after = sorted(after)

    rep.backup = write_atomic(dst_path, write, check, fsync=fsync, backup_of=dst_path if in_place and backup else None)
    rep.verified = True
    rep.output = src if in_place else dst_path
    return rep
