"""Detect, strip, add and align the key prefixes that model wrappers leave in state dicts.

Wrappers rename every key of the model they wrap:

========================================  ==========================================
wrapper                                   key of ``conv1.weight`` becomes
========================================  ==========================================
``nn.DataParallel`` / DDP                 ``module.conv1.weight``
``torch.compile``                         ``_orig_mod.conv1.weight``
Lightning ``self.model = net``            ``model.conv1.weight``
Lightning Fabric / strategies             ``_forward_module.conv1.weight``
FSDP / activation checkpointing           ``layer1._fsdp_wrapped_module.conv1.weight``
(saved from ``named_parameters()``)       ``layer1._checkpoint_wrapped_module.conv1.weight``
stacked                                   ``module._orig_mod.conv1.weight`` ...
========================================  ==========================================

Everything here is a pure function: no I/O, inputs are never mutated, values
are never looked at (except ``.shape`` in :func:`align_state_dict`) and the
result is a new mapping of the same type (``OrderedDict`` stays ``OrderedDict``)
whose hidden ``_metadata`` (module path -> ``{"version": ...}``, what
``load_state_dict`` reads) is re-keyed the same way as the keys, like
``torch.nn.modules.utils.consume_prefix_in_state_dict_if_present`` does, but
on a copy.  This module never imports torch.

Choices worth knowing:

* A leading wrapper prefix (:data:`KNOWN_PREFIXES`) is stripped by default only
  when *every* key carries it.  ``partial=True`` also strips ``module.``,
  ``_orig_mod.`` and ``_forward_module.`` from the keys that carry them in a
  mixed checkpoint; ``model.`` is a common real submodule name (a Hugging Face
  ``LlamaForCausalLM`` has ``model.layers...`` next to ``lm_head``), so it is
  only stripped when every key carries it, or when asked for explicitly.
* Inner wrapper segments (:data:`INNER_WRAPPER_SEGMENTS`) come from wrapping
  single submodules, so they are removed wherever they appear (except as the
  last segment, which is a parameter name), whether or not every key has them.
  ``_orig_mod`` counts as inner only below the first segment (a compiled
  submodule); as the first segment it is a leading prefix like the others.
  ``module.`` is never removed from the middle of a key: it is too often a
  genuine submodule name (and DDP wraps whole models, not submodules).

>>> sd = {"module._orig_mod.conv.weight": 1, "module._orig_mod.conv.bias": 2}
>>> strip_prefix(sd)
{'conv.weight': 1, 'conv.bias': 2}
>>> add_prefix({"fc.weight": 1}, "module")
{'module.fc.weight': 1}

Modules: :mod:`~ckptfix.ops.prefixes.rename` (detect, strip, add, rename) and
:mod:`~ckptfix.ops.prefixes.align` (fit another checkpoint's or a model's keys); every name is
re-exported here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckptfix.ops.prefixes.rename import (
    INNER_WRAPPER_SEGMENTS,
    KNOWN_PREFIXES,
    PrefixReport,
    StripReport,
    add_prefix,
    detect_prefixes,
    rename_keys,
    strip_prefix,
    strip_prefix_report,
)

if TYPE_CHECKING:
    from ckptfix.ops.prefixes.align import (
        MIN_FIT,
        AlignmentCandidate,
        AlignmentReport,
        ShapeMismatch,
        align_state_dict,
        rename_refusal,
    )

#: the names of :mod:`~ckptfix.ops.prefixes.align`, imported on first use (``inspect`` only detects prefixes: start-up)
_ALIGN = frozenset(
    {"MIN_FIT", "AlignmentCandidate", "AlignmentReport", "ShapeMismatch", "align_state_dict", "rename_refusal"}
)

__all__ = [
    "INNER_WRAPPER_SEGMENTS",
    "KNOWN_PREFIXES",
    "AlignmentCandidate",
    "AlignmentReport",
    "PrefixReport",
    "ShapeMismatch",
    "StripReport",
    "add_prefix",
    "align_state_dict",
    "rename_refusal",
    "MIN_FIT",
    "detect_prefixes",
    "rename_keys",
    "strip_prefix",
    "strip_prefix_report",
]


def __getattr__(name: str) -> Any:
    if name in _ALIGN:
        from ckptfix.ops.prefixes import align

        value = getattr(align, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ckptfix.ops.prefixes' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _ALIGN)
