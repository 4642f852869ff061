#!/usr/bin/env python3
"""Benchmark DeepSpeed ZeRO consolidation: ``ckptfix convert`` against DeepSpeed's ``zero_to_fp32.py``.

Usage::

    python benchmarks/bench_zero.py                                  # 0.2 GB, stages 2 and 3, 2 and 4 ranks
    python benchmarks/bench_zero.py --sizes 0.2GB,1GB,2GB --ranks 2,4 --stages 1,2,3 --repeat 3 --json
    python benchmarks/bench_zero.py --verify-generator               # the generator against real DeepSpeed files

The reference needs deepspeed (``zero_to_fp32`` imports it): ``--ds-python`` names an interpreter that has it
(default ``/tmp/venv-zero/bin/python`` when it exists; see tests/fixtures/frameworks/make_deepspeed.py).  Both
tools run under that interpreter, so they get the same Python, torch and numpy.

Checkpoints are synthetic, written with ``torch.save`` in DeepSpeed's save layout (what
``engine.save_checkpoint`` writes for ZeRO 1/2/3; ``--verify-generator`` checks the partitioning against the
real DeepSpeed fixtures bit for bit): a GPT-like stack of odd-sized weights in two param groups, each rank's
``*_optim_states.pt`` with its fp32 master partition and Adam ``exp_avg``/``exp_avg_sq``, the model states
with 16-bit weights (stage 1/2) or 0-element placeholders (stage 3).  ``--sizes`` is the fp32 model size;
the checkpoint on disk is about 3.5x that (the Adam states).

Side by side (interleaved; the order of the two tools alternates round by round; best and median wall time,
peak RSS from ``wait4``):

* ``ckptfix convert DIR -o model.safetensors --quiet`` (streaming, verified);
* ``python -c "zero_to_fp32.convert_zero_checkpoint_to_state_dict(DIR, OUT, safe_serialization=True)"``;
* ``python -c "import deepspeed.utils.zero_to_fp32"`` (the reference's import alone, reported so the ratio
  can also be read without it).

Both outputs are then compared tensor by tensor (ties resolved through ckptfix's aliases).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _measure import ROOT, child_env, measure

sys.path.insert(0, ROOT)
from ckptfix.text import parse_size

DEFAULT_DS_PYTHON = "/tmp/venv-zero/bin/python"

# The synthetic save layout.  partition() is DeepSpeed's partitioning (stage_1_and_2.py:
# flatten_dense_tensors_aligned to 2 * world, equal slices; stage3.py: each parameter padded to a multiple of
# the world size, rank r's slice of each, concatenated); --verify-generator checks it against real files.
GEN = r'''
import math, os, sys, collections, torch

def partition(groups, world, stage):
    """groups: [[(name, fp32 tensor)]] -> per rank, the list of flat fp32 groups DeepSpeed saves.

    Stage 1/2: a group's parameters flattened, padded to a multiple of 2 * world and cut in equal
    partitions, saved without the padding.  Stage 3: per group, each parameter padded to a multiple of
    world and cut in equal slices; rank r's flat group is its slices, concatenated.
    """
    out = [[] for _ in range(world)]
    for params in groups:
        if stage <= 2:
            flat = torch.cat([p.reshape(-1) for _, p in params])
            align = 2 * world
            pad = (-flat.numel()) % align
            flat = torch.cat([flat, torch.zeros(pad)])
            k = flat.numel() // world
            for r in range(world):  # saved without the padding (_get_groups_without_padding): the last rank's
                end = (r + 1) * k - (pad if r == world - 1 else 0)  # partition is shorter by it
                out[r].append(flat[r * k:end].clone())
        else:
            per_rank = [[] for _ in range(world)]
            for _, p in params:
                n = p.numel()
                k = math.ceil(n / world)
                padded = torch.cat([p.reshape(-1), torch.zeros(k * world - n)])
                for r in range(world):
                    per_rank[r].append(padded[r * k:(r + 1) * k])
            for r in range(world):
                out[r].append(torch.cat(per_rank[r]).clone())
    return out


def save(out_dir, groups, buffers, world, stage, tag="global_step1", dtype=torch.bfloat16, adam=True):
    os.makedirs(os.path.join(out_dir, tag), exist_ok=True)
    with open(os.path.join(out_dir, "latest"), "w") as f:
        f.write(tag)
    d = os.path.join(out_dir, tag)
    parts = partition(groups, world, stage)
    shapes = [collections.OrderedDict((n, torch.Size(p.shape)) for n, p in g) for g in groups]
    module = collections.OrderedDict()
    for g in groups:
        for n, p in g:
            module[n] = p.to(dtype) if stage <= 2 else torch.empty(0, dtype=dtype)
    module.update(buffers)
    model = {
        "module": module, "buffer_names": list(buffers), "optimizer": None, "param_shapes": shapes,
        "frozen_param_shapes": None, "shared_params": {}, "frozen_param_fragments": None, "lr_scheduler": None,
        "global_steps": 1, "dp_world_size": world, "mp_world_size": 1, "ds_version": "0.19.8",
        "ds_config": {"zero_optimization": {"stage": stage}, "bf16": {"enabled": dtype == torch.bfloat16}},
    }
    key = "single_partition_of_fp32_groups" if stage <= 2 else "fp32_flat_groups"
    for r in range(world):
        if stage <= 2 and r == 0:
            torch.save(model, os.path.join(d, "mp_rank_00_model_states.pt"))
        if stage == 3:
            torch.save(model, os.path.join(d, f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"))
        flats = parts[r]
        state = {i: {"step": torch.tensor(1.0), "exp_avg": f * 0.5, "exp_avg_sq": f * f} for i, f in enumerate(flats)}
        osd = {
            "loss_scaler": None, "dynamic_loss_scale": False, "overflow": False, "clip_grad": 1.0,
            "base_optimizer_state": {"state": state if adam else {}, "param_groups": [{"lr": 1e-3}] * len(flats)},
            key: flats, "zero_stage": stage,
            "group_paddings": [(sum(p.numel() for _, p in g) * -1) % (2 * world) if r == world - 1 else 0
                               for g in groups],
            "partition_count": [world] * len(flats) if stage <= 2 else world, "ds_version": "0.19.8",
        }
        if stage <= 2:
            osd["param_alignment_paddings"] = [[0] * len(g) for g in groups]
        torch.save({"optimizer_state_dict": osd, "ds_config": model["ds_config"], "ds_version": "0.19.8"},
                   os.path.join(d, f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))


def model_groups(total_bytes, seed=0):
    """A GPT-like stack of odd-sized layers adding up to ~total_bytes of fp32, in two param groups."""
    g = torch.Generator().manual_seed(seed)
    hidden, vocab = 1023, 5001
    per_layer = (4 * hidden * hidden + 2 * hidden * 4 * hidden) * 4
    n_layers = max(1, (total_bytes - vocab * hidden * 4) // per_layer)
    decay, no_decay = [("embed.weight", torch.randn(vocab, hidden, generator=g))], []
    for i in range(n_layers):
        decay += [(f"h.{i}.attn.weight", torch.randn(3 * hidden, hidden, generator=g)),
                  (f"h.{i}.proj.weight", torch.randn(hidden, hidden, generator=g)),
                  (f"h.{i}.fc.weight", torch.randn(4 * hidden, hidden, generator=g)),
                  (f"h.{i}.out.weight", torch.randn(hidden, 4 * hidden, generator=g))]
        no_decay += [(f"h.{i}.attn.bias", torch.randn(3 * hidden, generator=g)),
                     (f"h.{i}.ln.weight", torch.randn(hidden, generator=g))]
    return [decay, no_decay], {"h.pos": torch.arange(7, dtype=torch.int64), "h.scale": torch.rand(hidden)}


if __name__ == "__main__":
    out, size, world, stage = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    groups, buffers = model_groups(size)
    save(out, groups, buffers, world, stage)
'''

VERIFY = r"""
import os, sys, torch
sys.path.insert(0, sys.argv[1])
ns = {}
exec(open(sys.argv[2]).read().split("if __name__")[0], ns)
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
fix = os.path.join(sys.argv[1], "tests", "fixtures", "frameworks", "deepspeed")
for case in sorted(os.listdir(fix)):
    d = os.path.join(fix, case)
    if not os.path.isdir(d):
        continue
    tag = open(os.path.join(d, "latest")).read().strip()
    g = os.path.join(d, tag)
    stage = int(case[4])
    model = [f for f in sorted(os.listdir(g)) if f.endswith("_model_states.pt")][0]
    shapes = torch.load(os.path.join(g, model), weights_only=False)["param_shapes"]
    sd = get_fp32_state_dict_from_zero_checkpoint(d)
    groups = [[(n, sd[n]) for n in grp] for grp in shapes]
    mine = ns["partition"](groups, 2, stage)
    # padding elements are whatever memory held (ZeRO-3 pads with torch.empty): compare the parameters' elements
    real_mask = ns["partition"]([[(n, torch.ones_like(p)) for n, p in grp] for grp in groups], 2, stage)
    key = "single_partition_of_fp32_groups" if stage <= 2 else "fp32_flat_groups"
    optim = sorted(f for f in os.listdir(g) if f.endswith("_optim_states.pt"))
    for r, f in enumerate(optim):
        real = torch.load(os.path.join(g, f), weights_only=False)["optimizer_state_dict"][key]
        mine_r = mine[r]
        assert len(real) == len(mine_r), (case, len(real), len(mine_r))
        for a, b, m in zip(real, mine_r, real_mask[r]):
            m = m.bool()
            assert a.shape == b.shape and torch.equal(a[m], b[m]), (case, r, a.shape, b.shape)
    print(f"{case}: generator partitions == DeepSpeed's ({len(optim)} ranks, shapes and every parameter element)")
"""

REFERENCE = (
    "import sys; from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_state_dict as c; "
    "c(sys.argv[1], sys.argv[2], safe_serialization=True, max_shard_size='100GB')"
)

COMPARE = r"""
import json, os, sys, torch
from safetensors import safe_open
from safetensors.torch import load_file
mine = sys.argv[1]; ref_dir = sys.argv[2]
ref_files = [os.path.join(ref_dir, f) for f in os.listdir(ref_dir) if f.endswith(".safetensors")]
ref = {}
for f in ref_files:
    ref.update(load_file(f))
got = load_file(mine)
with safe_open(mine, "np") as f:
    aliases = json.loads(f.metadata().get("ckptfix.aliases", "{}"))
ok = set(got) | set(aliases) == set(ref) and all(
    torch.equal(got[aliases.get(k, k)].view(-1).view(torch.uint8), ref[k].view(-1).view(torch.uint8))
    and got[aliases.get(k, k)].dtype == ref[k].dtype for k in ref)
print(json.dumps(ok))
"""


def _rm(*paths: str):
    def go() -> None:
        for p in paths:
            if os.path.isdir(p):
                shutil.rmtree(p, ignore_errors=True)
            elif os.path.exists(p):
                os.unlink(p)

    return go


def _du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def bench(workdir: str, size: int, ranks: int, stage: int, repeat: int, ds_python: str) -> dict:
    src = os.path.join(workdir, f"zero{stage}_{ranks}r")
    gen = os.path.join(workdir, "gen.py")
    t0 = time.perf_counter()
    subprocess.run([ds_python, gen, src, str(size), str(ranks), str(stage)], check=True, env=child_env())
    gen_s = time.perf_counter() - t0
    total = _du(src)
    buf = bytearray(1 << 20)  # warm the page cache alike for both, through a small buffer
    for d, _, fs in os.walk(src):
        for n in fs:
            with open(os.path.join(d, n), "rb") as f:
                while f.readinto(buf):
                    pass
    out = os.path.join(workdir, "model.safetensors")
    ref_out = os.path.join(workdir, "ref")
    cases = {
        "ckptfix": ([ds_python, "-m", "ckptfix", "convert", src, "-o", out, "--quiet"], _rm(out)),
        "zero_to_fp32": ([ds_python, "-c", REFERENCE, src, ref_out], _rm(ref_out)),
        "import only": ([ds_python, "-c", "import deepspeed.utils.zero_to_fp32"], None),
    }
    env = child_env({"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "2"})
    walls: dict[str, list[float]] = {k: [] for k in cases}
    rss: dict[str, float] = dict.fromkeys(cases, 0.0)
    names = list(cases)
    for i in range(repeat):
        for name in names if i % 2 == 0 else names[::-1]:  # alternate who goes first
            argv, before = cases[name]
            if before is not None:
                before()
            os.sync()
            t, r = measure(argv, env)
            walls[name].append(t)
            rss[name] = max(rss[name], r)
    same = subprocess.run([ds_python, "-c", COMPARE, out, ref_out], capture_output=True, text=True, env=env)
    identical = same.stdout.strip() == "true"
    _rm(src, out, ref_out)()
    best = {k: min(v) for k, v in walls.items()}
    med = {k: statistics.median(v) for k, v in walls.items()}
    return {
        "stage": stage,
        "ranks": ranks,
        "model_fp32_bytes": size,
        "checkpoint_bytes": total,
        "generate_s": round(gen_s, 1),
        "ckptfix_best_s": round(best["ckptfix"], 3),
        "ckptfix_median_s": round(med["ckptfix"], 3),
        "ckptfix_rss_mib": round(rss["ckptfix"], 1),
        "zero_to_fp32_best_s": round(best["zero_to_fp32"], 3),
        "zero_to_fp32_median_s": round(med["zero_to_fp32"], 3),
        "zero_to_fp32_rss_mib": round(rss["zero_to_fp32"], 1),
        "zero_to_fp32_import_s": round(best["import only"], 3),
        "time_ratio_best": round(best["ckptfix"] / best["zero_to_fp32"], 2),
        "time_ratio_minus_import": round(best["ckptfix"] / max(1e-3, best["zero_to_fp32"] - best["import only"]), 2),
        "time_ratio_median": round(med["ckptfix"] / med["zero_to_fp32"], 2),
        "rss_ratio": round(rss["ckptfix"] / rss["zero_to_fp32"], 3),
        "identical": identical,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="0.2GB", help="comma-separated fp32 model sizes")
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--stages", default="2,3")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--ds-python", default=DEFAULT_DS_PYTHON if os.path.exists(DEFAULT_DS_PYTHON) else sys.executable)
    ap.add_argument("--verify-generator", action="store_true", help="check the generator against the fixtures")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--dir", default=None, help="work directory (default: a temp dir, removed afterwards)")
    a = ap.parse_args()
    workdir = a.dir or tempfile.mkdtemp(prefix="bench-zero-")
    os.makedirs(workdir, exist_ok=True)
    try:
        with open(os.path.join(workdir, "gen.py"), "w") as f:
            f.write(GEN)
        if a.verify_generator:
            env = child_env({"DS_ACCELERATOR": "cpu"})
            p = subprocess.run(
                [a.ds_python, "-c", VERIFY, ROOT, os.path.join(workdir, "gen.py")],
                env=env,
                capture_output=True,
                text=True,
            )
            print(p.stdout, end="")
            if p.returncode:
                sys.exit(p.stderr[-3000:])
            return
        rows = []
        for s in a.sizes.split(","):
            for st in map(int, a.stages.split(",")):
                for rk in map(int, a.ranks.split(",")):
                    row = bench(workdir, parse_size(s), rk, st, a.repeat, a.ds_python)
                    rows.append(row)
                    if not a.json:
                        print(
                            f"zero{st} {rk} ranks, model {row['model_fp32_bytes'] / 1e9:.2f} GB "
                            f"(ckpt {row['checkpoint_bytes'] / 1e9:.2f} GB): ckptfix {row['ckptfix_best_s']:.2f} s "
                            f"(median {row['ckptfix_median_s']:.2f}) {row['ckptfix_rss_mib']:.0f} MiB | zero_to_fp32 "
                            f"{row['zero_to_fp32_best_s']:.2f} s (median {row['zero_to_fp32_median_s']:.2f}) "
                            f"{row['zero_to_fp32_rss_mib']:.0f} MiB | time x{row['time_ratio_best']} "
                            f"rss x{row['rss_ratio']} identical={row['identical']} | deepspeed import alone "
                            f"{row['zero_to_fp32_import_s']:.2f} s: time x{row['time_ratio_minus_import']} without it",
                            flush=True,
                        )
        if a.json:
            print(json.dumps(rows, indent=1))
    finally:
        if not a.dir:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
