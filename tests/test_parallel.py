"""ckptfix.files.parallel: the bounded pool behind --jobs, and byte-identical outputs whatever N is."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_dcp import grid, write_dcp

from ckptfix.errors import CorruptCheckpointError, OutputError
from ckptfix.files.parallel import Tally, resolve_jobs, run_tasks
from ckptfix.files.progress import advance, reporting
from ckptfix.ops.convert import convert
from ckptfix.ops.rewrite import rewrite_checkpoint

from helpers import assert_one_line_error, run_cli

# --------------------------------------------------------------------------- the pool


def test_results_in_task_order_and_bounded_concurrency():
    live, peak, lock = [0], [0], threading.Lock()

    def task(i: int) -> int:
        with lock:
            live[0] += 1
            peak[0] = max(peak[0], live[0])
        time.sleep(0.01)
        with lock:
            live[0] -= 1
        return i * i

    assert run_tasks([lambda i=i: task(i) for i in range(20)], jobs=3) == [i * i for i in range(20)]
    assert 1 < peak[0] <= 3


def test_jobs_1_runs_inline_in_order():
    seen: list[tuple[int, str]] = []
    run_tasks([lambda i=i: seen.append((i, threading.current_thread().name)) for i in range(5)], jobs=1)
    assert seen == [(i, threading.main_thread().name) for i in range(5)]


def test_first_error_stops_the_rest_and_keeps_its_type():
    started: list[int] = []

    def task(i: int) -> None:
        started.append(i)
        if i == 2:
            raise CorruptCheckpointError("shard 2 is truncated")
        time.sleep(0.02)

    with pytest.raises(CorruptCheckpointError, match="shard 2 is truncated"):
        run_tasks([lambda i=i: task(i) for i in range(50)], jobs=2)
    assert len(started) < 10  # the tasks after the error were never started


def test_ctrl_c_in_the_caller_starts_nothing_more_and_waits_for_the_running_tasks():
    import signal

    started: list[int] = []
    running = [0]
    lock = threading.Lock()
    cancel = threading.Event()

    def task(i: int) -> None:
        with lock:
            started.append(i)
            running[0] += 1
        if i == 3:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C: the main thread waiting in run_tasks gets it
        time.sleep(0.05)
        with lock:
            running[0] -= 1

    with pytest.raises(KeyboardInterrupt):
        run_tasks([lambda i=i: task(i) for i in range(50)], jobs=2, cancel=cancel)
    assert cancel.is_set() and running[0] == 0  # the running tasks were waited for
    assert len(started) < 12  # the queued ones were not started


def test_resolve_jobs():
    assert resolve_jobs(1) == 1 and resolve_jobs(5) == 5
    assert resolve_jobs(0) >= 1 and resolve_jobs(None) == resolve_jobs(0)
    assert resolve_jobs(10_000) == 64
    with pytest.raises(ValueError):
        resolve_jobs(-1)


def test_progress_from_worker_threads_adds_up():
    calls: list[tuple[int, int]] = []
    with reporting(lambda d, t: calls.append((d, t)), 4000):
        run_tasks([lambda: [advance(1) for _ in range(100)] for _ in range(40)], jobs=4)
    dones = [d for d, _ in calls]
    assert dones == sorted(dones) and calls[-1] == (4000, 4000) and len(calls) == 4001


def test_tally_serializes_the_callback():
    inside, overlap = [0], [False]

    def cb(done: int, total: int) -> None:
        inside[0] += 1
        if inside[0] > 1:
            overlap[0] = True
        inside[0] -= 1

    t = Tally(cb, 1000)
    run_tasks([lambda: [t.add(1) for _ in range(100)] for _ in range(10)], jobs=4)
    assert t.done == 1000 and not overlap[0]


# --------------------------------------------------------------------------- byte-identical outputs


def _dcp(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    ref = {
        f"layers.{i}.w": torch.randn(37, 23, generator=g).to(torch.bfloat16 if i % 2 else torch.float32)
        for i in range(9)
    }
    ref["cols"] = torch.randn(5, 40, generator=g)
    entries = [
        (("model", k), v, grid(tuple(v.shape), {0: [5, 20]} if k != "cols" else {1: [7, 30]})) for k, v in ref.items()
    ]
    return write_dcp(tmp_path / "run.dcp", entries, nranks=4), ref


def test_dcp_consolidation_same_bytes_for_any_jobs(tmp_path, monkeypatch):
    from ckptfix.ops.convert import dcp_in as consolidate

    monkeypatch.setattr(consolidate, "BLOCK_BYTES", 256)  # many blocks per tensor, interleaved between threads
    d, ref = _dcp(tmp_path)
    outs = {}
    for n in (1, 3, 0):
        seen: list[tuple[int, int]] = []
        out = tmp_path / f"j{n}.safetensors"
        r = convert(d, out, jobs=n, progress=lambda a, b, seen=seen: seen.append((a, b)))
        assert r.verified and r.tensors == len(ref)
        assert seen[-1][0] == seen[-1][1] and [a for a, _ in seen] == sorted(a for a, _ in seen)
        outs[n] = out.read_bytes()
    assert outs[1] == outs[3] == outs[0]
    got = load_file(tmp_path / "j3.safetensors")
    assert all(torch.equal(got[k], v) for k, v in ref.items())
    reports = []
    for n in (1, 3):  # sharded output too
        (tmp_path / f"s{n}").mkdir()
        reports.append(convert(d, tmp_path / f"s{n}" / "m.safetensors", max_shard_size=3000, jobs=n))
    a, b = reports
    assert len(a.outputs) == len(b.outputs) > 1
    assert Path(a.index).read_bytes() == Path(b.index).read_bytes()
    for p, q in zip(a.outputs, b.outputs, strict=True):
        assert Path(p).read_bytes() == Path(q).read_bytes()


def _sharded_index(tmp_path: Path, fmt: str = "safetensors") -> tuple[Path, dict[str, torch.Tensor]]:
    d = tmp_path / "hf"
    d.mkdir()
    g = torch.Generator().manual_seed(1)
    ref = {f"module.layer.{i}.weight": torch.randn(16, 8, generator=g) for i in range(12)}
    names = list(ref)
    n = 5
    weight_map = {}
    for s in range(n):
        part = {k: ref[k] for k in names[s::n]}
        fname = f"model-{s + 1:05d}-of-{n:05d}." + ("safetensors" if fmt == "safetensors" else "bin")
        if fmt == "safetensors":
            save_file(part, d / fname, metadata={"format": "pt"})
        else:
            torch.save(part, d / fname)
        weight_map.update(dict.fromkeys(part, fname))
    idx = d / ("model.safetensors.index.json" if fmt == "safetensors" else "pytorch_model.bin.index.json")
    idx.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return idx, ref


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
def test_sharded_strip_prefix_same_bytes_for_any_jobs(tmp_path, fmt):
    idx, ref = _sharded_index(tmp_path, fmt)
    trees = {}
    for n in (1, 3):
        out = tmp_path / f"out{n}"
        from ckptfix.ops.prefixes import strip_prefix_report

        rep = rewrite_checkpoint(str(idx), lambda sd: strip_prefix_report(sd), output=str(out), jobs=n)
        assert rep.output and rep.renamed == len(ref)
        trees[n] = {p.name: p.read_bytes() for p in sorted(out.iterdir())}
    assert trees[1] == trees[3] and len(trees[1]) == 6


def test_sharded_rewrite_failure_removes_everything(tmp_path, monkeypatch):
    import ckptfix.ops.rewrite.sharded as rw

    idx, _ = _sharded_index(tmp_path)
    real = rw.write_file
    calls = [0]

    def flaky(scf, *a, **kw):
        calls[0] += 1
        if os.path.basename(scf.path).startswith("model-00003"):
            raise OutputError("disk full (simulated)")
        return real(scf, *a, **kw)

    monkeypatch.setattr(rw, "write_file", flaky)
    from ckptfix.ops.prefixes import strip_prefix_report

    out = tmp_path / "out"
    with pytest.raises(OutputError, match="simulated"):
        rewrite_checkpoint(str(idx), lambda sd: strip_prefix_report(sd), output=str(out), jobs=3)
    assert not out.exists()


def test_convert_sharded_index_same_bytes_for_any_jobs(tmp_path):
    idx, ref = _sharded_index(tmp_path, "pt")
    a = convert(idx, tmp_path / "a.safetensors", jobs=1)
    b = convert(idx, tmp_path / "b.safetensors", jobs=4)
    assert a.verified and b.verified
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()


def test_cli_jobs_option(tmp_path):
    idx, ref = _sharded_index(tmp_path)
    p = run_cli("strip-prefix", idx, "-o", tmp_path / "o", "--jobs", "0")
    assert p.returncode == 0, p.stderr
    assert set(load_file(tmp_path / "o" / "model-00001-of-00005.safetensors")) <= {k[len("module.") :] for k in ref}
    p = run_cli("convert", idx, "-o", tmp_path / "m.safetensors", "-j", "2", "--json")
    assert p.returncode == 0, p.stderr and json.loads(p.stdout)["verified"]
    p = run_cli("add-prefix", idx, "--prefix", "x.", "--jobs", "-1")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    p = run_cli("convert", tmp_path / "missing.pth", "--jobs", "2")
    assert_one_line_error(p, p.returncode)
