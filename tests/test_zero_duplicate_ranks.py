"""A DeepSpeed folder with two optimizer (or ZeRO-3 model) files of one rank (``zero_pp_rank_0_...`` beside
``bf16_zero_pp_rank_0_...`` or ``zero_pp_rank_00_...``): the rank count still matches the world size, so the
merge used rank 0 twice and exited 0 "verified" with overlapping data; it is a typed refusal now."""

from __future__ import annotations

from collections import OrderedDict

import pytest

torch = pytest.importorskip("torch")

from helpers import run_cli  # noqa: E402


def _model_states(path, shapes):
    torch.save(
        {
            "module": OrderedDict(),
            "buffer_names": [],
            "param_shapes": [shapes],
            "frozen_param_shapes": {},
            "shared_params": {},
            "ds_version": "0.14.0",
        },
        path,
    )


def _optim(path, stage, flat):
    osd = {"zero_stage": stage, "partition_count": 2}
    if stage == 3:
        osd["fp32_flat_groups"] = [flat]
    else:
        osd["single_partition_of_fp32_groups"] = [flat]
    torch.save({"optimizer_state_dict": osd}, path)


SECOND = ["bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_00_mp_rank_00_optim_states.pt"]


@pytest.mark.parametrize("second", SECOND)
def test_two_files_of_one_rank_are_refused_zero_2(tmp_path, second):
    d = tmp_path / "ds"
    tag = d / "global_step1"
    tag.mkdir(parents=True)
    (d / "latest").write_text("global_step1")
    shapes = OrderedDict(a=torch.Size([4]), b=torch.Size([4]))
    _model_states(tag / "mp_rank_00_model_states.pt", shapes)
    _optim(tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt", 2, torch.arange(4.0) + 1)
    _optim(tag / second, 2, torch.arange(4.0) + 1)
    r = run_cli("convert", str(d), "-o", str(tmp_path / "x.safetensors"))
    assert r.rc == 19, r.err
    assert "both rank 0's optimizer partition" in r.err and len(r.err.strip().splitlines()) == 1
    assert not (tmp_path / "x.safetensors").exists()
