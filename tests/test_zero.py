"""DeepSpeed ZeRO consolidation (ckptfix.formats.deepspeed) against what DeepSpeed's own zero_to_fp32 returned.

The fixtures under tests/fixtures/frameworks/deepspeed/ were written by deepspeed 0.19.8 on CPU (2 gloo ranks,
ZeRO 1/2/3, fp32 and bf16, and 2/3 with a frozen weight; tests/fixtures/frameworks/make_deepspeed.py);
``expected.safetensors`` beside each is what ``get_fp32_state_dict_from_zero_checkpoint`` returned.
deepspeed is not needed here.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from safetensors import safe_open

from ckptfix.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UnsupportedError,
    ZeroIncompleteError,
    ZeroMismatchError,
)
from ckptfix.formats.deepspeed import (
    convert_bytes,
    describe,
    find_zero_checkpoint,
    read_zero_checkpoint,
    summary,
)
from ckptfix.ops.convert.zero import convert_zero

from helpers import run_cli

FIX = Path(__file__).parent / "fixtures" / "frameworks" / "deepspeed"
CASES = [
    "zero1_fp32",
    "zero1_bf16",
    "zero2_fp32",
    "zero2_bf16",
    "zero3_fp32",
    "zero3_bf16",
    "zero2_frozen",
    "zero3_frozen",
]


def _expected(case: str) -> tuple[dict, dict]:
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    del torch
    return load_file(str(FIX / case / "expected.safetensors")), json.loads((FIX / case / "expected.json").read_text())


def _same(a, b) -> bool:
    import torch

    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))
    )


@pytest.mark.parametrize("case", CASES)
def test_load_anywhere_equals_zero_to_fp32(case: str) -> None:
    from ckptfix import load_anywhere

    exp, meta = _expected(case)
    sd = load_anywhere(FIX / case)
    assert list(sd) == meta["keys"]
    for k in meta["keys"]:
        assert _same(sd[k], exp[k]), k
    for alias, target in meta["shared_params"]:
        assert sd[alias] is sd[target]


@pytest.mark.parametrize("case", CASES)
def test_convert_is_bit_identical_and_keeps_ties(case: str, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from ckptfix.formats.stmeta import aliases

    exp, meta = _expected(case)
    out = tmp_path / "model.safetensors"
    r = convert_zero(find_zero_checkpoint(FIX / case), out)
    assert r.verified and r.source_format == f"deepspeed-zero{case[4]}"
    got = load_file(str(out))
    with safe_open(str(out), "np") as f:
        md = f.metadata()
    al = aliases(md, got)
    assert al == {a: t for a, t in meta["shared_params"]}
    assert set(got) | set(al) == set(meta["keys"])
    for k in meta["keys"]:
        assert _same(got[al.get(k, k)], exp[k]), k
    assert json.loads(md["ckptfix.order"]) == meta["keys"]


@pytest.mark.parametrize("case", ["zero1_fp32", "zero3_bf16"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_dtype_half_as_zero_to_fp32(case: str, dtype: str, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    from ckptfix.ops.load import load_anywhere  # noqa: F401 - torch present

    exp, meta = _expected(case)
    tdt = torch.bfloat16 if dtype == "bf16" else torch.float16
    out = tmp_path / "half.safetensors"
    convert_zero(find_zero_checkpoint(FIX / case), out, dtype=dtype)
    got = load_file(str(out))
    for k, v in got.items():
        want = exp[k].to(tdt) if exp[k].is_floating_point() else exp[k]  # zero_to_fp32's to_torch_tensor(dtype=)
        assert _same(v, want), k


def test_half_rounding_matches_torch() -> None:
    torch = pytest.importorskip("torch")
    vals = torch.tensor(
        [0.0, -0.0, 1.0, 1.00390625, 1.005859375, 3.0e38, -3.0e38, 7e4, 1e-8, 65504.0, 65520.0]
        + [float("inf"), float("-inf"), float("nan")],
        dtype=torch.float32,
    )
    vals = torch.cat([vals, torch.randn(4096) * 1000])
    raw = vals.numpy().tobytes()
    for name, tdt in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        got = convert_bytes(raw, "float32", name)
        want = vals.to(tdt).view(torch.int16).numpy().tobytes()
        assert bytes(got) == want, name
        # and back, exactly
        assert bytes(convert_bytes(got, name, "float32")) == vals.to(tdt).float().numpy().tobytes()


def test_pure_python_conversion_matches_numpy() -> None:
    import struct

    from ckptfix.formats.deepspeed.rounding import _convert_np, _convert_py

    np = pytest.importorskip("numpy")
    vals = [0.0, -0.0, 1.0, 1.00390625, 3.0e38, -3.0e38, 7e4, 65520.0, 1e-8, float("inf"), float("nan"), -2.5]
    raw = struct.pack(f"<{len(vals)}f", *vals)
    for dst in ("bfloat16", "float16"):
        assert _convert_py(raw, "float32", dst) == _convert_np(np, raw, "float32", dst), dst


def test_cli_convert_is_torch_free_and_picks_latest(tmp_path: Path) -> None:
    out = tmp_path / "m.safetensors"
    r = run_cli("convert", str(FIX / "zero3_fp32"), "-o", str(out), isolated=True)
    assert r.rc == 0, r.err
    assert r.torch_imported is False
    assert "deepspeed-zero3" in r.err and "head.weight -> embed.weight" in r.err
    assert out.exists()


def test_tag_and_tag_dir(tmp_path: Path) -> None:
    a = find_zero_checkpoint(FIX / "zero2_fp32", tag="global_step2")
    b = find_zero_checkpoint(FIX / "zero2_fp32" / "global_step2")
    assert a is not None and b is not None and a.tag_dir == b.tag_dir.rstrip("/")
    assert find_zero_checkpoint(FIX) is None
    assert find_zero_checkpoint(FIX / "zero2_fp32" / "latest") is None
    with pytest.raises(CheckpointNotFoundError):
        find_zero_checkpoint(FIX / "zero2_fp32", tag="global_step9")


def test_describe_and_summary() -> None:
    zc = find_zero_checkpoint(FIX / "zero3_bf16")
    s = summary(zc)
    assert s["stage"] == 3 and s["world_size"] == 2 and s["train_dtype"] == "bfloat16"
    assert s["params"] == 6 and s["param_values"] == 171 and s["param_bytes"] == 684 and s["buffers"] == 2
    lines = dict(describe(zc))
    assert "ZeRO stage 3" in lines["framework"] and lines["shared"] == "head.weight -> embed.weight"


@pytest.mark.parametrize("case", ["zero2_frozen", "zero3_frozen"])
def test_frozen_weights_come_from_the_model_states(case: str) -> None:
    zc = read_zero_checkpoint(find_zero_checkpoint(FIX / case))
    kinds = {t.name: t.kind for t in zc.tensors}
    assert kinds["back.weight"] == "frozen" and summary(zc)["frozen"] == 1
    assert all(p.path.endswith("_model_states.pt") for t in zc.tensors if t.kind == "frozen" for p in t.pieces)


def test_stage12_params_span_ranks() -> None:
    zc = read_zero_checkpoint(find_zero_checkpoint(FIX / "zero2_fp32"))
    spans = {t.name: {os.path.basename(p.path) for p in t.pieces} for t in zc.tensors}
    assert len(spans["proj.weight"]) == 2  # elements 66..108 of a group split at 76


# --------------------------------------------------------------------------- bad inputs


def _copy(case: str, tmp_path: Path) -> Path:
    d = tmp_path / case
    shutil.copytree(FIX / case, d)
    return d


def _cli_fails(d: Path, tmp_path: Path, code: int, *extra: str) -> str:
    out = tmp_path / "out.safetensors"
    r = run_cli("convert", str(d), "-o", str(out), *extra)
    assert r.rc == code, (r.rc, r.err)
    lines = [ln for ln in r.err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), r.err
    assert "Traceback" not in r.err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]
    return lines[0]


def test_missing_rank_partition(tmp_path: Path) -> None:
    d = _copy("zero2_fp32", tmp_path)
    (d / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(ZeroIncompleteError):
        read_zero_checkpoint(find_zero_checkpoint(d))
    msg = _cli_fails(d, tmp_path, ZeroIncompleteError.exit_code)
    assert "rank(s) 1 missing" in msg


def _with_partition_count(src: Path, dst: Path, n: int) -> None:
    from ckptfix.formats import read_checkpoint
    from ckptfix.formats.zipfmt import rewrite_zip
    from ckptfix.pickles import dumps

    cf = read_checkpoint(str(src))
    cf.obj["optimizer_state_dict"]["partition_count"] = [n, n]
    with open(dst, "wb") as fp:
        rewrite_zip(cf, dumps(cf.obj), fp)


def test_partitions_of_different_world_sizes(tmp_path: Path) -> None:
    d = _copy("zero2_fp32", tmp_path)
    g = d / "global_step2"
    # an old 4-rank run's ranks 2 and 3 left beside a new 2-rank run's files
    for r in (2, 3):
        _with_partition_count(
            g / "zero_pp_rank_1_mp_rank_00_optim_states.pt", g / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt", 4
        )
    with pytest.raises(ZeroMismatchError):
        read_zero_checkpoint(find_zero_checkpoint(d))
    msg = _cli_fails(d, tmp_path, ZeroMismatchError.exit_code)
    assert "different world sizes" in msg


def test_extra_rank_of_same_world_size(tmp_path: Path) -> None:
    d = _copy("zero1_fp32", tmp_path)
    g = d / "global_step2"
    shutil.copy(g / "zero_pp_rank_1_mp_rank_00_optim_states.pt", g / "zero_pp_rank_2_mp_rank_00_optim_states.pt")
    _cli_fails(d, tmp_path, ZeroMismatchError.exit_code)


def test_truncated_partition(tmp_path: Path) -> None:
    d = _copy("zero3_fp32", tmp_path)
    f = d / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CorruptCheckpointError):
        read_zero_checkpoint(find_zero_checkpoint(d))
    msg = _cli_fails(d, tmp_path, CorruptCheckpointError.exit_code)
    assert "zero_pp_rank_1" in msg and "truncated" in msg


def test_latest_names_missing_tag(tmp_path: Path) -> None:
    d = _copy("zero1_bf16", tmp_path)
    (d / "latest").write_text("global_step7")
    msg = _cli_fails(d, tmp_path, CheckpointNotFoundError.exit_code)
    assert "global_step7" in msg and "global_step2" in msg  # names what is there


def test_no_latest(tmp_path: Path) -> None:
    d = _copy("zero2_fp32", tmp_path)
    (d / "latest").unlink()
    zc = find_zero_checkpoint(d)
    assert zc is not None and zc.tag == "global_step2"
    shutil.copytree(d / "global_step2", d / "global_step4")
    with pytest.raises(CheckpointNotFoundError, match="--tag"):
        find_zero_checkpoint(d)
    assert find_zero_checkpoint(d, tag="global_step4").tag == "global_step4"


def test_tag_dtype_refused_elsewhere(tmp_path: Path) -> None:
    from ckptfix.ops.convert import convert

    with pytest.raises(UnsupportedError):
        convert(FIX / "zero1_fp32" / "expected.safetensors", tmp_path / "x.pth", tag="global_step2")
    with pytest.raises(UnsupportedError):
        convert(FIX / "zero1_fp32", tmp_path / "x.safetensors", key="module")
    with pytest.raises(UnsupportedError):
        convert_zero(find_zero_checkpoint(FIX / "zero1_fp32"), tmp_path / "x.safetensors", dtype="fp8")
    assert not list(tmp_path.iterdir())


def test_inputs_never_modified(tmp_path: Path) -> None:
    d = _copy("zero3_bf16", tmp_path)
    before = {p: p.read_bytes() for p in d.rglob("*") if p.is_file()}
    convert_zero(find_zero_checkpoint(d), tmp_path / "o.safetensors", dtype="bf16")
    assert before == {p: p.read_bytes() for p in d.rglob("*") if p.is_file()}


# --------------------------------------------------------------------------- memory


def _synthetic(out: Path, fp32_bytes: int, world: int, stage: int) -> None:
    """A checkpoint in DeepSpeed's layout from benchmarks/bench_zero.py's generator (checked against the fixtures)."""
    pytest.importorskip("torch")
    src = (Path(__file__).parents[1] / "benchmarks" / "bench_zero.py").read_text()
    gen = src.split("GEN = r'''", 1)[1].split("'''", 1)[0].split("if __name__")[0]
    ns: dict = {}
    exec(gen, ns)
    ns["model_groups"].__globals__["torch"].manual_seed(0)
    groups, buffers = ns["model_groups"](fp32_bytes)
    ns["save"](str(out), groups, buffers, world, stage, adam=False)


@pytest.mark.parametrize("stage,world", [(2, 4), (3, 2)])
def test_peak_rss_is_flat(stage: int, world: int, tmp_path: Path) -> None:
    """A ~120 MB model: the conversion's peak RSS stays under 100 MiB (no partition is read whole).

    Measured as the child's VmHWM (per address space, so not inherited from this process as ru_maxrss is).
    """
    import subprocess
    import sys

    if not os.path.exists("/proc/self/status"):
        pytest.skip("needs /proc")
    src = tmp_path / "ckpt"
    _synthetic(src, 160 << 20, world, stage)
    out = tmp_path / "m.safetensors"
    code = (
        "import sys; from ckptfix.cli import main\n"
        "assert main(sys.argv[1:]) == 0\n"
        "print([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1])"
    )
    p = subprocess.run(
        [sys.executable, "-c", code, "convert", str(src), "-o", str(out), "--quiet"],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    assert out.stat().st_size > 100 << 20
    assert int(p.stdout.split()[-1]) / 1024 < 100, p.stdout


def test_convert_json_matches_schema(tmp_path: Path) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((Path(__file__).parents[1] / "docs" / "schemas" / "convert.schema.json").read_text())
    r = run_cli("convert", str(FIX / "zero1_bf16"), "-o", str(tmp_path / "m.safetensors"), "--json", "--dtype", "bf16")
    assert r.rc == 0, r.err
    doc = json.loads(r.out)
    jsonschema.Draft202012Validator(schema).validate(doc)
    assert doc["source_format"] == "deepspeed-zero1" and doc["aliases"] == {"head.weight": "embed.weight"}


@pytest.mark.parametrize("case", ["zero2_fp32", "zero3_fp32"])
def test_shapes_larger_than_the_partitions_are_refused(case: str, tmp_path: Path) -> None:
    """A hostile param_shapes (10^18 elements) fails on the layout check, before any allocation or write."""
    from ckptfix.formats import read_checkpoint
    from ckptfix.formats.zipfmt import rewrite_zip
    from ckptfix.pickles import dumps

    d = _copy(case, tmp_path)
    g = d / "global_step2"
    for f in sorted(g.glob("*model_states.pt")):
        cf = read_checkpoint(str(f))
        cf.obj["param_shapes"][0]["embed.weight"] = (10**9, 10**9)
        tmp = f.with_suffix(".new")
        with open(tmp, "wb") as fp:
            rewrite_zip(cf, dumps(cf.obj), fp)
        tmp.replace(f)
    with pytest.raises(CorruptCheckpointError, match="embed.weight"):
        read_zero_checkpoint(find_zero_checkpoint(d))
    _cli_fails(d, tmp_path, CorruptCheckpointError.exit_code)


def test_sharded_output(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    exp, meta = _expected("zero3_bf16")
    out = tmp_path / "model.safetensors"
    r = convert_zero(find_zero_checkpoint(FIX / "zero3_bf16"), out, max_shard_size=200)
    assert r.index and len(r.outputs) > 1
    got: dict = {}
    for f in r.outputs:
        got.update(load_file(f))
    assert set(got) == set(meta["keys"]) - {"head.weight"}
    for k, v in got.items():
        assert _same(v, exp[k]), k
