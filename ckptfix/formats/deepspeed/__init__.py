"""DeepSpeed ZeRO checkpoints (stage 1, 2 and 3): the fp32 model, torch-free, as byte ranges.

What ``deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint`` rebuilds, without torch
and without holding a partition in memory.  A ZeRO checkpoint folder (``ckpt_dir/`` with a ``latest``
file naming ``global_stepN/``, or ``global_stepN/`` itself) holds per data-parallel rank:

* ``*_model_states.pt``: ``module`` (buffers; 16-bit or 0-element placeholder weights), ``param_shapes``
  (one ordered ``{name: torch.Size}`` per param group), ``buffer_names``, ``shared_params``
  (``{tied name: name stored}``), frozen parameters;
* ``*_optim_states.pt``: ``optimizer_state_dict`` with ``zero_stage``, ``partition_count`` and this rank's
  fp32 master weights: ``single_partition_of_fp32_groups`` (stage 1/2: one flat partition per group)
  or ``fp32_flat_groups`` (stage 3).

The layout, as zero_to_fp32.py reads it:

* stage 1/2: per group, the ranks' partitions concatenated make the group's flat vector; the group's
  parameters follow each other in it in ``param_shapes`` order, each followed by its
  ``param_alignment_paddings`` entry when the checkpoint has one; the vector ends padded to a multiple
  of ``2 * world_size``;
* stage 3: every parameter is partitioned on its own: rank ``r`` holds elements
  ``[r * ceil(n / world), (r + 1) * ceil(n / world))`` of it (the last rank padded), the parameters
  following each other in every rank's concatenated flat groups.

Each output tensor is thus a list of byte ranges (:class:`Piece`) of the partition files, located with
ckptfix's zip reader; :func:`ckptfix.ops.convert.zero.convert_zero` copies them straight into a safetensors
file (memory: one 8 MiB buffer) and :func:`zero_state_dict` reads them into torch tensors for
``load_anywhere``.  This package is the reader: :mod:`~ckptfix.formats.deepspeed.layout` (finding the folder;
the types), :mod:`~ckptfix.formats.deepspeed.reader` (the partitions' pickles -> byte ranges),
:mod:`~ckptfix.formats.deepspeed.tensors` (the bytes, torch tensors, ``inspect``'s lines) and
:mod:`~ckptfix.formats.deepspeed.rounding` (the dtype rounding both outputs share); consolidating into
safetensors is an operation, in :mod:`ckptfix.ops.convert.zero`.
"""

from __future__ import annotations

from ckptfix.formats.deepspeed.layout import Piece, ZeroCheckpoint, ZeroTensor, find_zero_checkpoint
from ckptfix.formats.deepspeed.reader import read_zero_checkpoint
from ckptfix.formats.deepspeed.rounding import OUTPUT_DTYPES, convert_bytes, output_dtype
from ckptfix.formats.deepspeed.tensors import describe, read_pieces, summary, zero_state_dict

__all__ = [
    "Piece",
    "ZeroTensor",
    "ZeroCheckpoint",
    "find_zero_checkpoint",
    "read_zero_checkpoint",
    "describe",
    "summary",
    "read_pieces",
    "output_dtype",
    "convert_bytes",
    "zero_state_dict",
    "OUTPUT_DTYPES",
]
