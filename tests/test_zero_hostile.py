"""ZeRO metadata taken from the files is validated before use (issue 39 §3).

The folders are DeepSpeed's own (tests/fixtures/frameworks/deepspeed), with one field of the optimizer partitions
rewritten at test time: ``partition_count`` of 2**40 (a 4 KB folder that claimed a trillion ranks: a set of
``range(world)`` was built, 30-68 s and gigabytes, then MemoryError), a negative ``param_alignment_paddings`` entry
(parameters overlapped: ``b.weight`` held elements of ``a.weight``, exit 0), a padding ``"x"`` (an internal
ValueError).  Each is a typed one-line error, before any output is written.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Callable

import pytest

from ckptfix.errors import CorruptCheckpointError, ZeroIncompleteError
from ckptfix.formats.deepspeed import find_zero_checkpoint, read_zero_checkpoint

from helpers import run_cli

FIX = Path(__file__).parent / "fixtures" / "frameworks" / "deepspeed"


def _edit(folder: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Rewrite every optimizer partition of ``folder`` with ``change`` applied to its optimizer_state_dict."""
    from ckptfix.formats import read_checkpoint
    from ckptfix.formats.zipfmt import rewrite_zip
    from ckptfix.pickles import dumps

    for f in sorted(folder.glob("global_step*/*_optim_states.pt")):
        cf = read_checkpoint(str(f))
        change(cf.obj["optimizer_state_dict"])
        tmp = f.with_suffix(".tmp")
        with open(tmp, "wb") as fp:
            rewrite_zip(cf, dumps(cf.obj), fp)
        tmp.replace(f)


def _fails(d: Path, tmp_path: Path, code: int) -> str:
    out = tmp_path / "out.safetensors"
    for args in (("convert", str(d), "-o", str(out)), ("inspect", str(d))):
        r = run_cli(*args)
        assert r.returncode == code, (args, r.returncode, r.stderr)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("Error: ") and "internal error" not in lines[0], r.stderr
    assert not out.exists()
    return lines[0]


def test_a_huge_partition_count_is_an_incomplete_folder_at_once(tmp_path: Path) -> None:
    d = tmp_path / "z"
    shutil.copytree(FIX / "zero2_fp32", d)
    _edit(d, lambda o: o.__setitem__("partition_count", [2**40, 2**40]))
    with pytest.raises(
        ZeroIncompleteError, match=r"2 of 1099511627776 optimizer partitions; rank\(s\) 2, 3, 4, 5, 6 \.\.\. missing"
    ):
        read_zero_checkpoint(find_zero_checkpoint(d))
    _fails(d, tmp_path, ZeroIncompleteError.exit_code)


@pytest.mark.parametrize("pad", [-4, "x", 2**62, True, 1.5])
def test_a_bad_alignment_padding_is_corrupt(tmp_path: Path, pad: Any) -> None:
    d = tmp_path / "z"
    shutil.copytree(FIX / "zero2_fp32", d)

    def change(o: dict[str, Any]) -> None:
        pads = o["param_alignment_paddings"]
        pads[0] = [pad] + list(pads[0][1:])

    _edit(d, change)
    with pytest.raises(CorruptCheckpointError, match="alignment padding"):
        read_zero_checkpoint(find_zero_checkpoint(d))
    _fails(d, tmp_path, CorruptCheckpointError.exit_code)


def test_paddings_that_are_not_a_list_are_corrupt(tmp_path: Path) -> None:
    d = tmp_path / "z"
    shutil.copytree(FIX / "zero1_fp32", d)
    _edit(d, lambda o: o.__setitem__("param_alignment_paddings", "x"))
    with pytest.raises(CorruptCheckpointError, match="param_alignment_paddings"):
        read_zero_checkpoint(find_zero_checkpoint(d))
