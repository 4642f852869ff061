"""``ckptfix diff A B`` / ``ckptfix.diff`` (issue 35) on real pairs: the trainer's checkpoints and their conversions,
DP vs single, epoch 1 vs 2 (statistics against torch's own), a low-rank-merged model vs its base, a ZeRO folder vs
its consolidated file, fp32 vs bf16, an S3 object vs a local file, missing keys and changed shapes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch as st
import torch
from test_schemas import validate

from ckptfix import diff
from ckptfix.ops.convert import convert_to_safetensors
from ckptfix.ops.diff import _g
from ckptfix.train import TrainConfig, train

from helpers import run_cli

REPO = Path(__file__).resolve().parents[1]
ZERO = REPO / "tests" / "fixtures" / "frameworks" / "deepspeed"
SMALL = dict(train_samples=256, test_samples=64, quiet=True)


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled trainer's checkpoints: single for 2 epochs, DP (``module.``) for 1, same seed (read-only)."""
    out = tmp_path_factory.mktemp("diff-runs")
    train(TrainConfig(out=str(out), epochs=2, **SMALL))
    train(TrainConfig(out=str(out), mode="dp", epochs=1, **SMALL))
    return out


def _sd(path: Path, key: str = "model_state_dict") -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)[key]


def test_trainer_checkpoint_equals_its_convert_output(runs: Path, tmp_path: Path) -> None:
    src = runs / "single_epoch2.pt"
    dst = tmp_path / "model.safetensors"
    convert_to_safetensors(src, dst)
    r = diff(src, dst)
    assert r.equal and not r.only_a and not r.only_b
    assert {t.status for t in r.tensors} == {"identical"}
    assert len(r.tensors) == len(_sd(src))
    assert r.key_a == ["model_state_dict"] and r.mapping == "no change"
    p = run_cli("diff", str(src), str(dst))
    assert p.returncode == 0, p.stderr
    last = p.stdout.strip().splitlines()[-1]
    assert last == f"0 of {len(r.tensors)} tensors differ; 0 missing; 0 extra"
    doc = json.loads(run_cli("diff", str(src), str(dst), "--json").stdout)
    validate(doc, "diff")
    assert doc["equal"] is True and doc["counts"]["identical"] == len(r.tensors)


def test_dp_vs_single_is_equal_after_alignment(runs: Path) -> None:
    single, dp = runs / "single_epoch1.pt", runs / "dp_epoch1.pt"
    assert all(k.startswith("module.") for k in _sd(dp))
    r = diff(dp, single)
    assert r.mapping == "strip 'module.'"
    assert r.equal, r.summary()
    raw = diff(dp, single, align=False)
    assert not raw.equal and len(raw.only_a) == len(raw.only_b) == len(_sd(dp)) and not raw.tensors
    mapped = diff(dp, single, align=False, maps=["module.="])
    assert mapped.equal
    back = diff(single, dp)  # the wrapper on B's side: A's keys gain it
    assert back.equal and back.mapping == "add 'module.'", back.mapping
    both = diff(dp, single, maps=["module.=model."])  # --map first, then the alignment (Lightning's model.)
    assert both.equal and both.mapping.startswith("replace 'module.' with 'model.'; "), both.mapping
    p = run_cli("diff", str(dp), str(single), "--no-align", "-q")
    assert p.returncode == 1 and p.stdout.strip().endswith(f"{len(_sd(dp))} missing; {len(_sd(dp))} extra")


def test_epoch1_vs_epoch2_statistics_are_torchs(runs: Path) -> None:
    e1, e2 = runs / "single_epoch1.pt", runs / "single_epoch2.pt"
    a, b = _sd(e1), _sd(e2)
    r = diff(e1, e2)
    assert not r.equal and r.statistics == "torch"
    rows = {t.name: t for t in r.tensors}
    assert any(t.status == "differ" for t in r.tensors)
    for name, t in rows.items():
        x, y = a[name], b[name]
        if torch.equal(x, y):
            assert t.status == "identical"
            continue
        d = (x - y).abs()
        assert t.max_abs == float(d.max())
        assert t.max_abs_index == int(torch.argmax(d.reshape(-1)))
        rel = torch.where(d == 0, torch.zeros(()), d.double() / y.double().abs())
        assert t.max_rel == float(rel.max())
        assert t.differing == int((~torch.isclose(x, y)).sum())
        assert t.fraction == t.differing / x.numel()
        assert t.nan_mismatch == 0 and t.inf_mismatch == 0
        assert t.first_diff == int((x.reshape(-1).view(torch.int32) != y.reshape(-1).view(torch.int32)).nonzero()[0])
        assert t.status == ("close" if torch.allclose(x, y) else "differ")
    worst = max((t for t in r.tensors if t.max_abs is not None), key=lambda t: t.max_abs)
    assert f"(max abs {_g(worst.max_abs)} at {worst.name})" in r.summary()
    assert any(e.key == "epoch" and (e.a, e.b) == ("1", "2") for e in r.entries)
    doc = json.loads(run_cli("diff", str(e1), str(e2), "--json", "--jobs", "3").stdout)
    validate(doc, "diff")
    assert doc["equal"] is False
    assert {t["name"]: t["max_abs"] for t in doc["tensors"]} == {n: t.max_abs for n, t in rows.items()}
    assert run_cli("diff", str(e1), str(e2), "-q").returncode == 1
    # tolerance: everything within a loose atol is "close", exit 0
    loose = diff(e1, e2, atol=10.0)
    assert loose.equal and {t.status for t in loose.tensors} <= {"identical", "close"}


def test_low_rank_merge_differs_only_in_target_modules(tmp_path: Path) -> None:
    """A LoRA merge (W + B @ A * scale on chosen modules, as peft's merge_and_unload does) vs its base."""
    torch.manual_seed(0)
    base = {
        f"layers.{i}.{m}.weight": torch.randn(48, 48)
        for i in range(3)
        for m in ("q_proj", "k_proj", "v_proj", "o_proj")
    }
    base["embed.weight"] = torch.randn(100, 48)
    base["lm_head.weight"] = base["embed.weight"]  # tied
    targets = [k for k in base if k.endswith(("q_proj.weight", "v_proj.weight"))]
    merged = {k: v.clone() for k, v in base.items()}
    merged["lm_head.weight"] = merged["embed.weight"]
    for k in targets:
        lora_a, lora_b = torch.randn(4, 48) * 0.01, torch.randn(48, 4) * 0.01
        merged[k] += (lora_b @ lora_a) * 2.0
    torch.save(base, tmp_path / "base.pt")
    torch.save(merged, tmp_path / "merged.pt")
    r = diff(tmp_path / "base.pt", tmp_path / "merged.pt")
    assert sorted(t.name for t in r.tensors if t.status != "identical") == sorted(targets)
    tied = [t for t in r.tensors if t.tied_with]
    assert [(t.name, t.tied_with) for t in tied] == [("lm_head.weight", "embed.weight")]


@pytest.mark.parametrize("name", ["zero2_fp32", "zero3_fp32", "zero2_frozen"])
def test_zero_folder_vs_its_consolidated_safetensors(name: str) -> None:
    folder = ZERO / name
    r = diff(folder, folder / "expected.safetensors")
    assert r.format_a.startswith("deepspeed-zero")
    assert r.equal, r.summary()
    assert not r.only_a and not r.only_b and {t.status for t in r.tensors} == {"identical"}


def test_fp32_vs_bf16_with_dtype_cast(tmp_path: Path) -> None:
    torch.manual_seed(1)
    sd = {"w": torch.randn(300, 70), "b": torch.randn(70), "steps": torch.arange(5)}
    st.save_file(sd, tmp_path / "fp32.safetensors")
    low = {k: (v.bfloat16() if v.is_floating_point() else v) for k, v in sd.items()}
    st.save_file(low, tmp_path / "bf16.safetensors")
    r = diff(tmp_path / "fp32.safetensors", tmp_path / "bf16.safetensors")
    assert sorted(t.name for t in r.of("dtype")) == ["b", "w"] and not r.equal
    assert r.summary() == "2 of 3 tensors differ; 2 in dtype (--dtype-cast compares them); 0 missing; 0 extra"
    c = diff(tmp_path / "fp32.safetensors", tmp_path / "bf16.safetensors", dtype_cast=True)
    rows = {t.name: t for t in c.tensors}
    for k in ("w", "b"):
        err = (sd[k] - low[k].float()).abs()
        assert rows[k].max_abs == float(err.max()) and rows[k].status == "differ"
    assert rows["steps"].status == "identical"
    loose = diff(tmp_path / "fp32.safetensors", tmp_path / "bf16.safetensors", dtype_cast=True, rtol=1e-2, atol=1e-6)
    assert loose.equal, loose.summary()
    p = run_cli("diff", str(tmp_path / "fp32.safetensors"), str(tmp_path / "bf16.safetensors"), "--dtype-cast",
                "--rtol", "1e-2", "--atol", "1e-6")  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr


def test_missing_keys_changed_shapes_and_keys_only(tmp_path: Path) -> None:
    torch.manual_seed(2)
    a = {"enc.weight": torch.randn(8, 4), "enc.bias": torch.randn(8), "head.weight": torch.randn(3, 8)}
    b = {"enc.weight": a["enc.weight"].clone(), "head.weight": torch.randn(5, 8), "extra.weight": torch.randn(2)}
    torch.save({"model": a, "epoch": 3}, tmp_path / "a.pt")
    st.save_file(b, tmp_path / "b.safetensors")
    r = diff(tmp_path / "a.pt", tmp_path / "b.safetensors")
    assert r.only_a == ["enc.bias"] and r.only_b == ["extra.weight"]
    assert [(t.name, t.shape_a, t.shape_b) for t in r.of("shape")] == [("head.weight", [3, 8], [5, 8])]
    assert [t.name for t in r.of("identical")] == ["enc.weight"]
    assert r.summary() == "1 of 2 tensors differ; 1 in shape; 1 missing; 1 extra"
    p = run_cli("diff", str(tmp_path / "a.pt"), str(tmp_path / "b.safetensors"))
    assert p.returncode == 1
    text = p.stdout
    order = [text.index(s) for s in ("only in A", "only in B", "shape mismatch", "bit-identical", "epoch: 3")]
    assert order == sorted(order)
    k = run_cli("diff", str(tmp_path / "a.pt"), str(tmp_path / "b.safetensors"), "--keys-only", "--json")
    doc = json.loads(k.stdout)
    validate(doc, "diff")
    assert doc["counts"]["unchecked"] == 1 and doc["counts"]["shape"] == 1 and k.returncode == 1


def test_summary_counts_missing_from_b_and_extra_in_b(tmp_path: Path) -> None:
    """``diff ORIGINAL CONVERTED``: names the conversion dropped are missing, names it added extra."""
    a = {"x": torch.zeros(2), "y": torch.zeros(2), "z": torch.zeros(2)}
    b = {"x": torch.zeros(2), "w": torch.zeros(2)}
    st.save_file(a, tmp_path / "a.safetensors")
    st.save_file(b, tmp_path / "b.safetensors")
    r = diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    assert r.summary() == "0 of 1 tensors differ; 2 missing; 1 extra"
    p = run_cli("diff", str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors"))
    assert "only in A (missing from B) (2):" in p.stdout and "only in B (extra) (1):" in p.stdout


def test_compared_in_the_order_they_lie_in_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """safetensors lays out F64 before I8 whatever the names: the comparisons follow the bytes, not the names."""
    from ckptfix.ops import diff as diffmod

    sd = {"a_small": torch.ones(3, dtype=torch.int8), "b_wide": torch.ones(3, dtype=torch.float64),
          "c_mid": torch.ones(3, dtype=torch.float32)}  # fmt: skip
    st.save_file(sd, tmp_path / "m.safetensors")
    seen: list[str] = []
    real = diffmod._compare

    def spy(ta, *args):  # type: ignore[no-untyped-def]
        seen.append(ta.name)
        return real(ta, *args)

    monkeypatch.setattr(diffmod, "_compare", spy)
    assert diff(tmp_path / "m.safetensors", tmp_path / "m.safetensors").equal
    assert seen == ["b_wide", "c_mid", "a_small"]


def test_numbers_read_as_the_issue_writes_them() -> None:
    assert [_g(x) for x in (3.1e-2, 0.25, 1.0, 2.5e-7, 4050.0, 12345.0, 0.0, float("inf"), None)] == [
        "3.1e-2", "0.25", "1", "2.5e-7", "4.05e3", "1.23e4", "0", "inf", "-",
    ]  # fmt: skip


def test_key_a_and_key_b_pick_another_entry(tmp_path: Path) -> None:
    torch.manual_seed(4)
    sd = {"w": torch.randn(4, 4)}
    ema = {"w": sd["w"] * 0.5}
    torch.save({"state_dict": sd, "state_dict_ema": ema, "step": 7}, tmp_path / "a.pt")
    torch.save({"model": ema}, tmp_path / "ema.pt")
    assert not diff(tmp_path / "a.pt", tmp_path / "ema.pt").equal
    r = diff(tmp_path / "a.pt", tmp_path / "ema.pt", key_a="state_dict_ema")
    assert r.equal and r.key_a == ["state_dict_ema"] and r.key_b == ["model"]
    p = run_cli("diff", str(tmp_path / "ema.pt"), str(tmp_path / "a.pt"), "--key-b", "state_dict_ema", "-q")
    assert p.returncode == 0, p.stdout + p.stderr


def test_strided_views_and_nan_inf(tmp_path: Path) -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    a = {"t": base.t(), "n": torch.tensor([1.0, float("nan"), float("inf"), 4.0, float("nan")])}
    b = {"t": base.t().contiguous(), "n": torch.tensor([1.0, 2.0, float("-inf"), 4.0, float("nan")])}
    torch.save(a, tmp_path / "a.pt")
    torch.save(b, tmp_path / "b.pt")
    r = diff(tmp_path / "a.pt", tmp_path / "b.pt")
    rows = {t.name: t for t in r.tensors}
    assert rows["t"].status == "identical"  # a transposed view vs its contiguous copy: same values
    n = rows["n"]
    assert n.status == "differ" and n.nan_mismatch == 1 and n.inf_mismatch == 1 and n.differing == 2
    assert n.max_abs == 0.0 and n.first_diff == 1


def test_s3_object_vs_local(s3_server, runs: Path, tmp_path: Path) -> None:
    src = runs / "single_epoch2.pt"
    dst = tmp_path / "model.safetensors"
    convert_to_safetensors(src, dst)
    url = s3_server.upload(str(dst), f"{s3_server.prefix()}/model.safetensors")
    r = diff(url, src)
    assert r.equal and len(r.tensors) == len(_sd(src))
    other = diff(url, runs / "single_epoch1.pt")
    assert not other.equal and other.of("differ")
    p = run_cli("diff", url, str(src), "-q")
    assert p.returncode == 0, p.stderr


def test_bad_input_is_one_line_error(tmp_path: Path) -> None:
    (tmp_path / "text.pt").write_text("hello")
    ok = tmp_path / "ok.safetensors"
    st.save_file({"x": torch.zeros(2)}, ok)
    p = run_cli("diff", str(tmp_path / "missing.pt"), str(ok))
    assert p.returncode == 3 and p.stderr.startswith("Error: ") and p.stderr.count("\n") == 1
    p = run_cli("diff", str(tmp_path / "text.pt"), str(ok))
    assert p.returncode == 4 and "Traceback" not in p.stderr
    p = run_cli("diff", str(ok), str(ok), "--map", "nope")
    assert p.returncode == 8 and "A_PREFIX=B_PREFIX" in p.stderr
    p = run_cli("diff", str(ok), str(ok), "--key-a", "nope")
    assert p.returncode == 6


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="reads and resets VmHWM")
def test_memory_stays_flat(tmp_path: Path) -> None:
    """The memory a diff of two differing ~40 MB files takes vs ~160 MB files: the same, far below the inputs.

    Measured in a child, as the peak RSS (VmHWM) above the RSS before the diff, after a warm-up diff of two 16 MB
    files (torch's first large operations set up its thread pool and allocator: tens of MiB, once) and a reset of
    the peak (``/proc/self/clear_refs``).  What stays is the pieces and torch's temporaries: a diff that held a
    tensor would take 320 MB more for the big pair."""
    script = (
        "import sys, torch; from ckptfix import diff\n"
        "def kib(k): return int([ln.split()[1] for ln in open('/proc/self/status') if ln.startswith(k)][0])\n"
        "diff(sys.argv[3], sys.argv[4]); open('/proc/self/clear_refs', 'w').write('5')\n"
        "base = kib('VmRSS:'); r = diff(sys.argv[1], sys.argv[2]); print(kib('VmHWM:') - base, r.equal)"
    )
    for side, bump in (("wa", 0.0), ("wb", 1.0)):
        st.save_file({"w": torch.ones(4 << 20) + bump}, tmp_path / f"{side}.safetensors")

    def grew(n: int) -> int:
        for side, bump in (("a", 0.0), ("b", 1e-3)):
            t = torch.ones(n // 4) + bump
            st.save_file({"w": t, "v": t[:1000].clone()}, tmp_path / f"{side}.safetensors")
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        files = [str(tmp_path / f"{x}.safetensors") for x in ("a", "b", "wa", "wb")]
        args = [sys.executable, "-c", script, *files]
        out = subprocess.run(args, env=env, capture_output=True, text=True, check=True)
        kb, equal = out.stdout.split()
        assert equal == "False"
        return int(kb)

    small, big = grew(40 << 20), grew(160 << 20)
    shutil.rmtree(tmp_path)
    assert big < 96 << 10, (small, big)  # KiB: two 160 MB inputs, under 96 MiB (measured 31-49 MiB)
    assert big - small < 32 << 10, (small, big)  # 240 MB more input, not 32 MiB more memory (run-to-run: ~17)


FW = REPO / "tests" / "fixtures" / "frameworks"
CK = REPO / "tests" / "fixtures" / "ckpt"
# a side as each framework saves it vs the framework's own loader's state dict (tests/fixtures/frameworks/make*.py)
SIDES = {
    "trainer/checkpoint-2": FW / "trainer.expected.safetensors",  # GPT-2: lm_head.weight stored once, re-tied
    "hf_gpt2_sharded": FW / "hf_gpt2_sharded.expected.safetensors",
    "hf_gpt2_sharded/model.safetensors.index.json": FW / "hf_gpt2_sharded.expected.safetensors",
    "hf_llama_bin": FW / "hf_llama_bin.expected.safetensors",
    "accelerate": FW / "accelerate.expected.safetensors",
    "lightning.ckpt": FW / "lightning.ckpt.expected.safetensors",
    "lightning_dcp": FW / "lightning_dcp.expected.safetensors",
    "hfstorage/run": FW / "hfstorage" / "expected" / "model-00001-of-00001.safetensors",
    "deepspeed/zero1_bf16": FW / "deepspeed" / "zero1_bf16" / "expected.safetensors",
    "deepspeed/zero3_frozen": FW / "deepspeed" / "zero3_frozen" / "expected.safetensors",
    "../ckpt/legacy.pth": CK / "model.safetensors",
    "../ckpt/ddp.pth": CK / "model.safetensors",
    "../ckpt/sharded": CK / "model.safetensors",
}


@pytest.mark.parametrize("name", sorted(SIDES))
def test_every_container_vs_its_loaders_state_dict_and_its_convert_output(name: str, tmp_path: Path) -> None:
    from ckptfix.ops.convert import convert

    out = tmp_path / "out.safetensors"
    convert(FW / name, out)
    c = diff(FW / name, out)
    assert c.equal and {t.status for t in c.tensors} == {"identical"}, (c.summary(), c.only_a, c.only_b)
    r = diff(FW / name, SIDES[name])
    assert r.equal, (r.summary(), r.only_a, r.only_b)
    assert not r.only_a and not r.only_b and {t.status for t in r.tensors} == {"identical"}
    assert diff(SIDES[name], FW / name).equal  # either way round
    if name == "trainer/checkpoint-2":
        head = next(t for t in r.tensors if t.name == "lm_head.weight")
        assert head.status == "identical"
        assert any("lm_head.weight = transformer.wte.weight" in n for n in r.notes)
    if name == "hfstorage/run":
        assert r.format_a == "hf-storage-dcp"


def test_hf_storage_chunks_assembled_window_by_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """The path for chunks that do not tile a tensor end to end: the same bytes as the ranges."""
    from ckptfix.ops import diffsides

    monkeypatch.setattr(diffsides._HfStorageItem, "ranges", lambda self: None)
    r = diff(FW / "hfstorage" / "run", SIDES["hfstorage/run"])
    assert r.equal and {t.status for t in r.tensors} == {"identical"} and len(r.tensors) == 7


def test_http_sides_read_only_the_ranges_they_need(tmp_path: Path) -> None:
    """A URL side: --keys-only reads the header, a full diff each tensor's bytes once (ETag-pinned requests)."""
    from rangeserver import serving

    torch.manual_seed(3)
    sd = {"big": torch.randn(1 << 20), "small": torch.randn(10)}
    st.save_file(sd, tmp_path / "a.safetensors")
    sd["small"][3] += 1
    st.save_file(sd, tmp_path / "b.safetensors")
    size = os.path.getsize(tmp_path / "a.safetensors")
    with serving(str(tmp_path)) as srv:
        url = f"{srv.url}/a.safetensors"
        k = diff(url, tmp_path / "b.safetensors", keys_only=True)
        assert k.equal and srv.sent() <= 256 << 10  # the header block, of a 4 MiB file
        srv.reset()
        r = diff(url, tmp_path / "b.safetensors")
        assert [t.name for t in r.of("differ")] == ["small"] and r.of("differ")[0].first_diff == 3
        assert size <= srv.sent() <= size + (256 << 10)
        srv.reset()
        p = run_cli("diff", url, f"{srv.url}/b.safetensors", "-q")
        assert p.returncode == 1 and p.stdout.startswith("1 of 2 tensors differ (max abs")
        # the object replaced while it is read: the reads are pinned to the ETag its first request saw
        srv.reset()
        srv.fault("change", "a.safetensors", method="GET", count=1)
        p = run_cli("diff", url, str(tmp_path / "b.safetensors"))
        assert p.returncode == 44 and p.stderr.startswith("Error: ") and "changed while it was read" in p.stderr
        assert p.stdout == "" and p.stderr.count("\n") == 1
