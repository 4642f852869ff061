"""One frozen options object for everything that writes an output (layer 0, torch-free).

``convert``, ``strip-prefix``, ``add-prefix``, ``align``, ``rekey`` and ``sanitize`` all write a new
file (or directory) next to their input, or replace it: where, whether to overwrite, to flush, to
verify, how many threads, where the state dict sits ... are the same choices everywhere, so they are
one :class:`OutputOptions`, passed down whole instead of retyped as keyword ladders.  Each operation
says which of its fields it uses (:meth:`OutputOptions.refuse`); one set that it does not use is
refused with :class:`~ckptfix.errors.OptionNotApplicableError` (exit 32) rather than ignored.

Library callers may keep passing keywords (``strip_prefix_checkpoint(p, output="o.pt", force=True)``):
:meth:`OutputOptions.build` makes the object from them; :class:`OutputKeywords` types them.

A field's ``metadata["flag"]`` is the command-line spelling the refusal names.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Collection, Iterable, Mapping, TypedDict

from ckptfix.errors import OptionNotApplicableError, OutputError
from ckptfix.files.progress import Progress

__all__ = [
    "OutputOptions",
    "OutputKeywords",
    "flag_of",
    "given_fields",
    "named_kind",
    "refuse_given",
    "refuse_misnamed",
]


def _flag(default: Any, flag: str) -> Any:
    return field(default=default, metadata={"flag": flag})


@dataclass(frozen=True)
class OutputOptions:
    """Where and how an operation writes its output.

    Attributes:
        output: where to write; None: the operation's default next to the input.
        in_place: replace the input itself (temp file, fsync, rename); rewrites and sanitize.
        backup: with ``in_place``, keep the original as ``<input>.bak``.
        force: overwrite an existing output.
        fsync: flush files and directory before returning; None: the operation's default (on for
            ``in_place``, off otherwise).
        verify: read the written output back and compare it with the source before it is kept
            (rewrites always do).
        suffix: the word in the default output's name (``<stem>.<suffix><ext>``); empty: the operation's own.
        jobs: tensors, shards or writer threads at a time (``0``: one per CPU); the output is the same
            bytes for any number.
        progress: ``progress(done_bytes, total_bytes)`` while writing.
        key: where the state dict sits in the input (``"model/state_dict"``); None: found automatically.
        map_location: rewrite storage device tags (``"cpu"``, ``"cuda:7=cuda:0,..."``); rewrites only.
        link: a DCP directory's rewrite hard-links the input's data files instead of copying them.
    """

    output: str | None = _flag(None, "-o/--output")
    in_place: bool = _flag(False, "--in-place")
    backup: bool = _flag(True, "--no-backup")
    force: bool = _flag(False, "--force")
    fsync: bool | None = _flag(None, "--fsync")
    verify: bool = _flag(True, "--no-verify")
    suffix: str = _flag("", "suffix=")
    jobs: int = _flag(1, "--jobs")
    progress: Progress | None = field(default=None, compare=False, metadata={"flag": "progress="})
    key: str | None = _flag(None, "--key")
    map_location: str | None = _flag(None, "--map-location")
    link: bool = _flag(False, "--link")

    @classmethod
    def build(cls, options: OutputOptions | None = None, keywords: Mapping[str, Any] | None = None) -> OutputOptions:
        """``options`` (default: all defaults) with the fields ``keywords`` name replaced.

        Args:
            options: a starting object, or None.
            keywords: field name -> value (a path-like ``output`` becomes a ``str``).

        Raises:
            TypeError: a keyword that is not a field (as a function call with an unknown keyword does).
        """
        base = options if options is not None else cls()
        if not keywords:
            return base
        unknown = sorted(set(keywords) - _FIELDS)
        if unknown:
            raise TypeError(f"unexpected keyword argument(s) {unknown}; OutputOptions has {sorted(_FIELDS)}")
        kw = dict(keywords)
        if kw.get("output") is not None:
            kw["output"] = _fspath(kw["output"])
        return dataclasses.replace(base, **kw)

    def with_output(self, output: object) -> OutputOptions:
        """This object with ``output`` replaced when ``output`` is given (a positional ``dst``).

        Args:
            output: a path, path-like, or None (keeps the current one).
        """
        return self if output is None else dataclasses.replace(self, output=_fspath(output))

    def named(self, suffix: str) -> OutputOptions:
        """This object with ``suffix`` as the default output's word unless one was chosen.

        Args:
            suffix: the operation's own word (``"stripped"``, ``"sanitized"`` ...).
        """
        return self if self.suffix else dataclasses.replace(self, suffix=suffix)

    def given(self) -> list[str]:
        """The fields set away from their defaults (``progress`` never counts: it changes no output)."""
        return given_fields(self, skip=("progress",))

    def keywords(self) -> dict[str, Any]:
        """The fields set away from their defaults, and ``progress``, as keywords (for code that takes ``**kw``)."""
        out = {n: getattr(self, n) for n in self.given()}
        if self.progress is not None:
            out["progress"] = self.progress
        return out

    def refuse(self, uses: Collection[str], what: str) -> None:
        """Refuse the fields set here that the operation does not use.

        Raises:
            OptionNotApplicableError: naming each unused field's flag.
        """
        refuse_given(self, [n for n in self.given() if n not in uses], what)


_FIELDS = frozenset(f.name for f in dataclasses.fields(OutputOptions))


class OutputKeywords(TypedDict, total=False):
    """The keywords that build an :class:`OutputOptions` (for typing ``**keywords``)."""

    output: str | None
    in_place: bool
    backup: bool
    force: bool
    fsync: bool | None
    verify: bool
    suffix: str
    jobs: int
    progress: Progress | None
    key: str | None
    map_location: str | None
    link: bool


def _fspath(p: object) -> str:
    import os

    return os.fspath(p)  # type: ignore[call-overload]  # str or os.PathLike; anything else raises TypeError


def given_fields(obj: Any, skip: Iterable[str] = ()) -> list[str]:
    """The fields of the dataclass instance ``obj`` whose value differs from the field's default.

    Args:
        obj: a dataclass instance whose fields all have defaults.
        skip: field names never counted.
    """
    out = []
    for f in dataclasses.fields(obj):
        if f.name in skip:
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        value = getattr(obj, f.name)
        if value != default and not (isinstance(default, tuple) and not value):
            out.append(f.name)
    return out


def flag_of(obj: Any, name: str) -> str:
    """The command-line spelling of a field (``--max-shard-size``); ``name=`` for one the CLI does not offer."""
    flag = next((f.metadata.get("flag", "") for f in dataclasses.fields(obj) if f.name == name), "")
    return flag or f"{name}="


def refuse_given(obj: Any, names: Iterable[str], what: str, where: str = "", why: str = "") -> None:
    """Raise one :class:`OptionNotApplicableError` for the fields ``names`` of ``obj`` (none: return).

    The message: ``--shards applies to DCP output ..., not to conversion to safetensors; drop it
    (keyword shards=)``, or without ``where``: ``--link does not apply to sanitize; drop it ...``.

    Raises:
        OptionNotApplicableError: when ``names`` is not empty.
    """
    names = list(names)
    if not names:
        return
    one = len(names) == 1
    flags = [flag_of(obj, n) for n in names]
    keywords = [f"{n}=" for n, f in zip(names, flags, strict=True) if f != f"{n}="]
    head = " and ".join(flags)
    if where:
        head += f" {'applies' if one else 'apply'} to {where}, not to {what}"
    else:
        head += f" {'does' if one else 'do'} not apply to {what}"
    tail = f" (keyword{'' if len(keywords) == 1 else 's'} {', '.join(keywords)})" if keywords else ""
    raise OptionNotApplicableError(f"{head}{': ' + why if why else ''}; drop {'it' if one else 'them'}{tail}")


#: names torch's own loaders (``torch.load``, ``from_pretrained``'s ``.bin``) are given
TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".tar")
_KINDS = {"safetensors": "safetensors bytes", "torch": "a torch.save file", "directory": "a directory"}


def named_kind(path: str) -> str | None:
    """What an output's name promises: ``"safetensors"``, ``"torch"``, or None (no checkpoint extension)."""
    name = path.rstrip("/").lower()
    if name.endswith(".safetensors"):
        return "safetensors"
    if name.endswith(TORCH_SUFFIXES):
        return "torch"
    return None


def refuse_misnamed(output: str | None, writes: str, fix: str) -> None:
    """Refuse an output whose name promises another format than the bytes written (the output is what its name
    says: ``torch.load`` of safetensors bytes fails "invalid load key").

    Args:
        output: the output path given (None: the default name, which always fits).
        writes: ``"safetensors"``, ``"torch"`` or ``"directory"``: what would be written.
        fix: the message's end: the name or command that does what was asked.

    Raises:
        OutputError: the name says another format (exit 9; nothing was read or written).
    """
    if output is None:
        return
    named = named_kind(output)
    if named is None or named == writes:
        return
    ext = "." + output.rstrip("/").rsplit(".", 1)[-1]
    raise OutputError(f"{output}: this would write {_KINDS[writes]} under a {ext} name; {fix}")
