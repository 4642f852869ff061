"""Rename the keys of a checkpoint file: strip or add a wrapper prefix, or align it to a target model.

:mod:`ckptfix.ops.prefixes` decides the renaming on key names alone; this module applies it to a file
through :func:`ckptfix.ops.rewrite.rewrite_checkpoint` (tensor bytes copied, never decoded) and holds
the policy the ``strip-prefix``, ``add-prefix`` and ``align`` commands share with library callers:

* ``align`` refuses a target the checkpoint does not fit: when the best renaming matches fewer
  than :data:`MIN_FIT` of the checkpoint's keys, nothing is written (``AlignmentError``);
* and a renaming that renames only part of a group of keys (``module.fc.*`` -> ``fc2.*`` beside an
  unmatched ``module.conv.*``): :func:`ckptfix.ops.prefixes.rename_refusal`, the rule
  ``load_anywhere(model=...)`` follows too;
* two different renamings that fit equally well are ambiguous: nothing is written
  (``KeyConflictError``), the user renames explicitly;
* ``--to`` is another checkpoint file, or a ``package.module:factory`` to import (a class or a
  function returning an ``nn.Module``, or a module instance).

torch is imported only to build a ``module:factory`` target.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptfix.errors import AlignmentError, CheckpointNotFoundError, KeyConflictError
from ckptfix.files.outputs import OutputKeywords, OutputOptions
from ckptfix.ops.prefixes import (
    MIN_FIT,
    AlignmentReport,
    add_prefix,
    align_state_dict,
    rename_refusal,
    strip_prefix_report,
)
from ckptfix.ops.rewrite import RewriteReport, rewrite_checkpoint

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "MIN_FIT",
    "AlignResult",
    "add_prefix_checkpoint",
    "align_checkpoint",
    "load_align_target",
    "strip_prefix_checkpoint",
]


def strip_prefix_checkpoint(
    src: str,
    prefix: str | None = None,
    *,
    partial: bool = False,
    outputs: OutputOptions | None = None,
    **keywords: Unpack[OutputKeywords],
) -> RewriteReport:
    """Strip wrapper prefixes from the state-dict keys of ``src`` (default output ``<stem>.stripped<ext>``).

    Args:
        src: checkpoint file or sharded index (see :func:`ckptfix.ops.rewrite.rewrite_checkpoint`).
        prefix: strip exactly this prefix; ``None`` strips every wrapper layer all keys carry
            (:func:`ckptfix.ops.prefixes.strip_prefix`).
        partial: with ``prefix=None``, also strip wrapper prefixes only some keys carry.
        outputs: where and how to write (:class:`~ckptfix.files.outputs.OutputOptions`), or its fields as
            ``keywords``: ``output`` (default: next to ``src``), ``in_place`` (replace ``src`` atomically,
            keeping ``src.bak`` unless ``backup=False``), ``force``, ``key`` (where the state dict sits, e.g.
            ``"model/state_dict"``), ``map_location``, ``progress``, ``jobs``, ``link`` (for a DCP
            directory, hard-link its data files): see :func:`ckptfix.ops.rewrite.rewrite_checkpoint`.

    Returns:
        The :class:`~ckptfix.ops.rewrite.RewriteReport`; ``detail`` is the
        :class:`~ckptfix.ops.prefixes.StripReport` as a dict (its ``"summary"`` is one line for humans).

    Raises:
        KeyConflictError: an explicit prefix no key carries, or two keys would collide.
        CkptfixError: any error of :func:`ckptfix.ops.rewrite.rewrite_checkpoint` (missing or
            unreadable input, output refused, verification failed ...).
    """
    from ckptfix.formats.hfarch import own_prefixes

    own = own_prefixes(src)  # a Hugging Face model's base-model prefix (config.json beside src) is not a wrapper
    return rewrite_checkpoint(
        src,
        lambda sd: strip_prefix_report(sd, prefix, partial=partial, own=own),
        outputs=OutputOptions.build(outputs, keywords).named("stripped"),
    )


def add_prefix_checkpoint(
    src: str,
    prefix: str,
    *,
    outputs: OutputOptions | None = None,
    **keywords: Unpack[OutputKeywords],
) -> RewriteReport:
    """Put ``prefix`` in front of every state-dict key of ``src`` (default output ``<stem>.prefixed<ext>``).

    Args:
        src: checkpoint file or sharded index (see :func:`ckptfix.ops.rewrite.rewrite_checkpoint`).
        prefix: the prefix, e.g. ``"module."`` (a missing trailing ``"."`` is added).
        outputs: where and how to write, or its fields as ``keywords``: as for :func:`strip_prefix_checkpoint`.

    Returns:
        The :class:`~ckptfix.ops.rewrite.RewriteReport`; ``detail`` holds ``summary``, ``prefix`` and ``keys``.

    Raises:
        KeyConflictError: two keys would collide.
        CkptfixError: any error of :func:`ckptfix.ops.rewrite.rewrite_checkpoint`.
    """

    def transform(sd: Mapping[str, Any]) -> tuple[Mapping[str, Any], dict[str, Any]]:
        new = add_prefix(sd, prefix)
        return new, {"summary": f"added {prefix!r} to {len(new)} keys", "prefix": prefix, "keys": len(new)}

    return rewrite_checkpoint(
        src,
        transform,
        outputs=OutputOptions.build(outputs, keywords).named("prefixed"),
    )


@dataclass(frozen=True)
class AlignResult:
    """What :func:`align_checkpoint` wrote and how the keys line up with the target.

    Attributes:
        rewrite: the file-level report (``output``, ``backup``, ``notes`` ...); its ``detail`` is
            ``alignment.to_dict()``.
        alignment: the key-level report (renaming applied, missing, unexpected, shape mismatches).
    """

    rewrite: RewriteReport
    alignment: AlignmentReport

    @property
    def exact(self) -> bool:
        """True when the written state dict loads into the target with ``strict=True``."""
        return self.alignment.exact

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (the rewrite report, the alignment under ``detail``).

        Returns:
            A dict of plain values.
        """
        return self.rewrite.to_dict()

    def mismatch_error(self) -> AlignmentError | None:
        """The error a strict caller raises when keys still differ after the renaming.

        Returns:
            ``None`` when :attr:`exact`, else an :class:`~ckptfix.errors.AlignmentError` naming
            what remains and the fix.
        """
        r = self.alignment
        if r.exact:
            return None
        return AlignmentError(
            f"{len(r.missing)} missing, {len(r.unexpected)} unexpected, "
            f"{len(r.shape_mismatches)} shape mismatches remain after '{r.rename}'; "
            "load with strict=False or fix the model definition"
        )


def align_checkpoint(
    src: str,
    target: Any,
    *,
    outputs: OutputOptions | None = None,
    **keywords: Unpack[OutputKeywords],
) -> AlignResult:
    """Rename the state-dict keys of ``src`` to match ``target`` (default output ``<stem>.aligned<ext>``).

    The renaming is :func:`ckptfix.ops.prefixes.align_state_dict`'s best one.  Nothing is written when it
    fits badly (fewer than :data:`MIN_FIT` of the checkpoint's keys match) or is ambiguous.  A file
    is written when the fit is good but not exact (some keys missing or unexpected): the result says
    so (:attr:`AlignResult.exact`, :meth:`AlignResult.mismatch_error`).

    Args:
        src: checkpoint file or sharded index (see :func:`ckptfix.ops.rewrite.rewrite_checkpoint`).
        target: a spec for :func:`load_align_target` (a checkpoint path or ``"package.module:factory"``),
            or what :func:`~ckptfix.ops.prefixes.align_state_dict` takes (a module, a state dict, key names).
        outputs: where and how to write, or its fields as ``keywords``: as for :func:`strip_prefix_checkpoint`.

    Returns:
        An :class:`AlignResult`.

    Raises:
        AlignmentError: the checkpoint does not fit the target (nothing written).
        KeyConflictError: several renamings fit equally well (nothing written).
        CheckpointNotFoundError: a ``target`` spec that is neither a file nor importable.
        TorchMissingError: a ``module:factory`` target needs torch, which is not installed.
        CkptfixError: any error of :func:`ckptfix.ops.rewrite.rewrite_checkpoint`.
    """
    tgt = load_align_target(target) if isinstance(target, str) else target
    reports: list[AlignmentReport] = []

    def transform(sd: Mapping[str, Any]) -> tuple[Mapping[str, Any], AlignmentReport]:
        new, report = align_state_dict(sd, tgt)
        reports.append(report)
        _check_fit(sd, report)
        return new, report

    rep = rewrite_checkpoint(
        src,
        transform,
        outputs=OutputOptions.build(outputs, keywords).named("aligned"),
    )
    return AlignResult(rep, reports[-1])


def _check_fit(sd: Mapping[str, Any], report: AlignmentReport) -> None:
    """Refuse a renaming that fits badly, splits a group of keys, or is ambiguous (before anything is written)."""
    err = rename_refusal(report, len(sd), renamed_only=False)
    if err is not None:
        raise err
    if report.ambiguous:
        raise KeyConflictError(f"{report.summary()}; rename explicitly with strip-prefix --prefix or add-prefix")


def load_align_target(spec: str) -> object:
    """What ``align --to SPEC`` aligns to: another checkpoint's state dict, or a model built by a factory.

    Args:
        spec: a checkpoint path (any format ckptfix reads), or ``"package.module:factory"`` where
            ``factory`` is a class or function returning an ``nn.Module`` (called with no arguments)
            or a module instance.

    Returns:
        A state dict (from a file) or an ``nn.Module``.

    Raises:
        CheckpointNotFoundError: no such file, and not an importable ``module:factory`` spec.
        TorchMissingError: importing the factory needs torch, which is not installed.
        CkptfixError: the file cannot be read (see :func:`ckptfix.formats.read_checkpoint`).
    """
    if os.path.exists(spec):
        from ckptfix.formats import read_checkpoint

        return read_checkpoint(spec).state_dict()[1]
    if ":" in spec:
        mod, _, attr = spec.partition(":")
        try:
            m = importlib.import_module(mod)
            factory = getattr(m, attr)
        except (ImportError, AttributeError) as e:
            from ckptfix._torch import is_torch_missing, missing_error

            if is_torch_missing(e):
                raise missing_error("align --to module:factory") from None
            raise CheckpointNotFoundError(
                f"--to {spec}: cannot import it ({e}); check the module path and that it is importable (PYTHONPATH)"
            ) from None
        is_instance = hasattr(factory, "state_dict") and not isinstance(factory, type)
        return factory if is_instance else factory()
    raise CheckpointNotFoundError(f"--to {spec}: no such file, and not a 'package.module:factory' spec")
