"""One options object for every writer (files.outputs.OutputOptions, ops.convert.options.ConvertOptions).

An option the operation or the direction a conversion takes does not use is refused (exit 32, one
``Error:`` line naming it and where it applies, nothing written) instead of ignored; the keyword API
library callers use keeps working and builds the same objects.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ckptfix.errors import OptionNotApplicableError, UnsupportedError
from ckptfix.files.outputs import OutputOptions
from ckptfix.ops.convert import ConvertOptions, convert, convert_from_safetensors, convert_to_safetensors
from ckptfix.ops.convert.dcp_out import convert_to_dcp
from ckptfix.ops.convert.options import DIRECTIONS, OUTPUT_APPLIES, keywords_of, options_of
from ckptfix.ops.rewrite import rewrite_checkpoint
from ckptfix.ops.rewrite.keys import add_prefix_checkpoint, strip_prefix_checkpoint
from ckptfix.ops.sanitize import sanitize_checkpoint

from helpers import assert_one_line_error, run_cli

FIX = Path(__file__).parent / "fixtures" / "frameworks" / "deepspeed"


@pytest.fixture
def pth(tmp_path: Path) -> Path:
    p = tmp_path / "m.pth"
    torch.save({"module.w": torch.ones(2, 3), "module.b": torch.zeros(3)}, p)
    return p


@pytest.fixture
def st(tmp_path: Path) -> Path:
    p = tmp_path / "m.safetensors"
    save_file({"w": torch.ones(2, 3)}, p)
    return p


def _files(d: Path) -> list[str]:
    return sorted(os.listdir(d))


# --------------------------------------------------------------------------- the objects


def test_output_options_is_frozen_and_built_from_keywords() -> None:
    o = OutputOptions.build(None, {"output": Path("x.pt"), "force": True, "jobs": 2})
    assert o == OutputOptions(output="x.pt", force=True, jobs=2)  # a path-like output becomes a str
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.force = False  # type: ignore[misc]
    assert o.given() == ["output", "force", "jobs"]
    assert OutputOptions(progress=lambda d, t: None).given() == []  # a callback changes no output
    assert o.named("stripped").suffix == "stripped" and o.named("a").named("b").suffix == "a"
    assert OutputOptions.build(o, {"force": False}).force is False and o.force  # a copy, the original kept
    with pytest.raises(TypeError, match="prefix"):
        OutputOptions.build(None, {"prefix": "module."})


def test_every_convert_option_says_where_it_applies_and_how_it_is_spelled() -> None:
    for f in dataclasses.fields(ConvertOptions):
        assert f.metadata["flag"] and f.metadata["applies"] <= set(DIRECTIONS), f.name
    assert set(OUTPUT_APPLIES) <= {f.name for f in dataclasses.fields(OutputOptions)}


def test_keywords_and_objects_build_the_same_options() -> None:
    o, c = options_of("out.safetensors", None, None, {"force": True, "drop": ("x*",), "jobs": 3})
    assert o == OutputOptions(output="out.safetensors", force=True, jobs=3) and c == ConvertOptions(drop=("x*",))
    o2, c2 = options_of(None, o, c, {"keep": ("a",)})  # keywords replace fields of the objects given
    assert o2 == o and c2 == ConvertOptions(drop=("x*",), keep=("a",))
    assert keywords_of(o2, c2) == {"force": True, "jobs": 3, "drop": ("x*",), "keep": ("a",)}
    with pytest.raises(TypeError):
        options_of(None, None, None, {"restore": True})


def test_the_keyword_api_and_the_object_api_write_the_same_bytes(pth: Path, tmp_path: Path) -> None:
    a = convert_to_safetensors(pth, tmp_path / "a.safetensors", strip_prefix=True, jobs=2)
    b = convert_to_safetensors(
        pth,
        outputs=OutputOptions(output=str(tmp_path / "b.safetensors"), jobs=2),
        options=ConvertOptions(strip_prefix=True),
    )
    assert a.renamed == b.renamed == 2
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    strip_prefix_checkpoint(str(pth), output=str(tmp_path / "s1.pt"))
    strip_prefix_checkpoint(str(pth), outputs=OutputOptions(output=str(tmp_path / "s2.pt")))
    assert (tmp_path / "s1.pt").read_bytes() == (tmp_path / "s2.pt").read_bytes()
    rep = add_prefix_checkpoint(str(tmp_path / "s1.pt"), "x.")
    assert rep.output is not None and rep.output.endswith("s1.prefixed.pt")  # each operation's own default name


# --------------------------------------------------------------------------- refused, not ignored


def test_options_of_another_direction_are_refused_with_exit_32(pth: Path, st: Path, tmp_path: Path) -> None:
    before = _files(tmp_path)
    with pytest.raises(OptionNotApplicableError, match=r"--restore-wrapper applies to conversion back to torch"):
        convert(pth, restore_wrapper=True)
    with pytest.raises(OptionNotApplicableError, match=r"--strip-prefix applies to conversion to safetensors"):
        convert(st, tmp_path / "m.pth", strip_prefix=True)
    with pytest.raises(OptionNotApplicableError, match=r"--key applies to conversion to safetensors"):
        convert(st, tmp_path / "m.dcp", key="model")
    with pytest.raises(OptionNotApplicableError, match=r"--in-place does not apply .* never replacing its input"):
        convert(pth, in_place=True)
    with pytest.raises(OptionNotApplicableError, match=r"--shards"):  # the typed entry points refuse them too
        convert_to_safetensors(pth, shards=2)
    with pytest.raises(OptionNotApplicableError, match=r"--drop"):
        convert_from_safetensors(st, drop=("w",))
    with pytest.raises(OptionNotApplicableError, match=r"--include-optimizer"):
        convert_to_dcp(st, include_optimizer=True)
    assert issubclass(OptionNotApplicableError, UnsupportedError) and OptionNotApplicableError.exit_code == 32
    assert _files(tmp_path) == before  # nothing written


def test_a_deepspeed_folder_refuses_what_its_consolidation_does_not_use(tmp_path: Path) -> None:
    for kw in ({"strip_prefix": True}, {"trust": True}, {"key": "module"}, {"to": "pt"}):
        with pytest.raises(OptionNotApplicableError):
            convert(FIX / "zero1_fp32", tmp_path / "x.safetensors", **kw)  # type: ignore[arg-type]
    with pytest.raises(OptionNotApplicableError, match="consolidated to safetensors"):
        convert(FIX / "zero1_fp32", tmp_path / "x.dcp")
    with pytest.raises(OptionNotApplicableError, match="--tag applies to DeepSpeed ZeRO"):
        convert(FIX / "zero1_fp32" / "expected.safetensors", tmp_path / "x.pth", tag="global_step2")
    assert _files(tmp_path) == []


def test_rewrites_and_sanitize_refuse_what_they_do_not_use(pth: Path, tmp_path: Path) -> None:
    with pytest.raises(OptionNotApplicableError, match=r"--no-verify does not apply to renaming keys"):
        strip_prefix_checkpoint(str(pth), verify=False)
    with pytest.raises(OptionNotApplicableError, match=r"--no-verify"):
        rewrite_checkpoint(str(pth), lambda sd: (sd, {}), verify=False)
    with pytest.raises(OptionNotApplicableError, match=r"--jobs and --key do not apply to sanitize"):
        sanitize_checkpoint(pth, jobs=2, key="model")
    assert _files(tmp_path) == ["m.pth"]


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--restore-wrapper"], "--restore-wrapper applies to conversion back to torch"),
        (["-o", "{d}/x.pth", "--strip-prefix"], "--strip-prefix applies to conversion to safetensors"),
        (["-o", "{d}/x.safetensors", "--shards", "2"], "--shards applies to DCP output"),
        (["--to", "pt", "--keep", "w", "-o", "{d}/y.pth"], "--keep applies to conversion to safetensors"),
    ],
)
def test_the_cli_refuses_an_option_of_another_direction(st: Path, pth: Path, argv: list[str], says: str) -> None:
    src = pth if "--restore-wrapper" in argv else st
    d = st.parent
    before = _files(d)
    p = run_cli("convert", str(src), *[a.format(d=d) for a in argv])
    assert_one_line_error(p, 32)
    assert says in p.stderr and "drop it" in p.stderr
    assert _files(d) == before
