"""One containment rule for every framework layout (issue 33 §5b first bullet, issue 39 §6 first item).

DeepSpeed's own ZeRO folder and Lightning's own DCP folder (tests/fixtures/frameworks), copied and then pointed
outside themselves at test time: ``latest`` naming an absolute path or ``../``, a symlinked tag folder, symlinked
partition files, a symlinked ``meta.pt``.  ``convert``, ``inspect`` and ``load_anywhere`` refuse each (exit 8, one
line), as sharded indexes and DCP directories already did; nothing outside the folder is read into an output.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

import pytest

from ckptfix.errors import UnsupportedError

from helpers import run_cli

FIX = Path(__file__).parent / "fixtures" / "frameworks"


def _zero_latest_absolute(root: Path) -> Path:
    d, outside = root / "ck", root / "elsewhere"
    shutil.copytree(FIX / "deepspeed" / "zero2_fp32", d)
    shutil.move(str(d / "global_step2"), str(outside))
    (d / "latest").write_text(str(outside))
    return d


def _zero_latest_dotdot(root: Path) -> Path:
    d = root / "ck"
    shutil.copytree(FIX / "deepspeed" / "zero2_fp32", d)
    (root / "other").mkdir()
    shutil.move(str(d / "global_step2"), str(root / "other" / "global_step2"))
    (d / "latest").write_text("../other/global_step2")
    return d


def _zero_tag_link(root: Path) -> Path:
    d = root / "ck"
    shutil.copytree(FIX / "deepspeed" / "zero2_fp32", d)
    shutil.move(str(d / "global_step2"), str(root / "elsewhere"))
    os.symlink(root / "elsewhere", d / "global_step2")
    return d


def _zero_partition_link(root: Path) -> Path:
    d = root / "ck"
    shutil.copytree(FIX / "deepspeed" / "zero2_fp32", d)
    f = d / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shutil.move(str(f), str(root / "secret.pt"))
    os.symlink(root / "secret.pt", f)
    return d


def _zero_model_link(root: Path) -> Path:
    d = root / "ck"
    shutil.copytree(FIX / "deepspeed" / "zero2_fp32", d)
    f = d / "global_step2" / "mp_rank_00_model_states.pt"
    shutil.move(str(f), str(root / "secret.pt"))
    os.symlink(root / "secret.pt", f)
    return d


def _zero_latest_link(root: Path) -> Path:
    """'latest' a link to a file outside that names the real tag: read, its contents printed, and used (exit 0)."""
    d = root / "ck"
    shutil.copytree(FIX / "deepspeed" / "zero2_fp32", d)
    (root / "outside_latest").write_text((d / "latest").read_text())
    (d / "latest").unlink()
    os.symlink(root / "outside_latest", d / "latest")
    return d


def _lightning_meta_link(root: Path) -> Path:
    d = root / "ck"
    shutil.copytree(FIX / "lightning_dcp", d)
    shutil.move(str(d / "meta.pt"), str(root / "secret.pt"))
    os.symlink(root / "secret.pt", d / "meta.pt")
    return d


CASES: dict[str, Callable[[Path], Path]] = {
    "zero-latest-absolute": _zero_latest_absolute,
    "zero-latest-dotdot": _zero_latest_dotdot,
    "zero-tag-folder-link": _zero_tag_link,
    "zero-partition-link": _zero_partition_link,
    "zero-model-states-link": _zero_model_link,
    "zero-latest-link": _zero_latest_link,
    "lightning-meta-link": _lightning_meta_link,
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_layout_pointing_outside_its_folder_is_refused(tmp_path: Path, case: str) -> None:
    d = CASES[case](tmp_path)
    out = tmp_path / "out.safetensors"
    for args in (("convert", str(d), "-o", str(out)), ("inspect", str(d))):
        r = run_cli(*args)
        assert r.returncode == UnsupportedError.exit_code, (case, args, r.returncode, r.stdout, r.stderr)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("Error: "), r.stderr
        assert "outside" in lines[0] or "refused" in lines[0], lines[0]
    assert not out.exists()
    pytest.importorskip("torch")
    from ckptfix import load_anywhere

    with pytest.raises(UnsupportedError):
        load_anywhere(str(d))


def test_the_folders_as_written_still_read(tmp_path: Path) -> None:
    for src in (FIX / "deepspeed" / "zero2_fp32", FIX / "lightning_dcp"):
        r = run_cli("convert", str(src), "-o", str(tmp_path / f"{src.name}.safetensors"))
        assert r.returncode == 0, r.stderr
        assert run_cli("inspect", str(src)).returncode == 0


def test_convert_to_pt_of_zero_size_tensors_of_two_dtypes(tmp_path: Path) -> None:
    """Issue 39 §6: zero-size tensors read by safetensors share a null data pointer; torch.save refused two dtypes
    of it (an internal RuntimeError, exit 1)."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    sd = {"a": torch.zeros(0, 3), "b": torch.zeros(0, dtype=torch.int64), "c": torch.ones(2, dtype=torch.bfloat16)}
    src = tmp_path / "z.safetensors"
    save_file(sd, str(src))
    r = run_cli("convert", str(src), "-o", str(tmp_path / "z.pt"))
    assert r.returncode == 0, r.stderr
    got = torch.load(tmp_path / "z.pt", weights_only=True)
    assert {k: (v.dtype, tuple(v.shape)) for k, v in got.items()} == {
        k: (v.dtype, tuple(v.shape)) for k, v in sd.items()
    }
    assert torch.equal(got["c"], sd["c"])


@pytest.mark.parametrize("layout", ["hf-model", "peft-adapter"])
def test_weights_linked_outside_the_folder_are_read_by_no_command(tmp_path: Path, layout: str) -> None:
    """A model folder whose weights file links out of it: inspect and diff refuse as convert and load do (no
    tensor name or value of the outside file shown), scan leaves it unread and says unknown, never safe."""
    import torch
    from safetensors.torch import save_file

    (tmp_path / "outside").mkdir()
    secret = tmp_path / "outside" / "private.safetensors"
    save_file({"secret.weight": torch.full((3,), 7.0)}, str(secret))
    save_file({"secret.weight": torch.zeros(3)}, str(tmp_path / "zero.safetensors"))
    d = tmp_path / "m"
    d.mkdir()
    if layout == "hf-model":
        (d / "config.json").write_text('{"architectures": ["BertModel"], "model_type": "bert"}')
        os.symlink("../outside/private.safetensors", d / "model.safetensors")
    else:
        (d / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8, "base_model_name_or_path": "x"}')
        os.symlink(secret, d / "adapter_model.safetensors")
    for args in (["inspect", str(d), "--json"], ["diff", str(d), str(tmp_path / "zero.safetensors")]):
        r = run_cli(*args)
        assert r.returncode == UnsupportedError.exit_code, (args, r.stdout, r.stderr)
        assert "secret" not in r.stdout and "outside the folder" in r.stderr
    r = run_cli("scan", str(d))
    assert r.returncode != 0 and "safe (" not in r.stdout.splitlines()[0]
    assert "outside the folder; not read" in r.stdout
