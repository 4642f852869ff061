"""Ranking, leases and waiting (pure or in-process), and the Python pick_gpu() API."""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

import pytest

if not any(Path(p, "ckptfix", "__init__.py").exists() for p in sys.path if p):  # a checkout, not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckptfix.errors import CudaAlreadyInitializedError, GpuWaitTimeoutError, NoGpuError, NoGpuFitsError
from ckptfix.gpu import pick_gpu, visible_gpus
from ckptfix.gpu.leases import try_lease
from ckptfix.gpu.pick import Criteria, parse_size_mib, pick, rank_gpus, selection_env
from ckptfix.gpu.records import GpuProcess, SmiGpu, VisibleGpu

from fakesmi import scenario_runner

SCENARIOS = Path(__file__).parent / "fixtures" / "nvidia-smi" / "scenarios"


def gpu(i, free, util=0, procs=0, total=100_000, hidden=None, **smi):
    """cuda:i = nvidia-smi GPU i; ``smi`` overrides fields of its :class:`SmiGpu`."""
    uuid = f"GPU-{i:08d}"
    processes = None if procs is None else tuple(GpuProcess(uuid, 1000 + k, "python", 0) for k in range(procs))
    fields = dict(
        index=i,
        uuid=uuid,
        name="H200",
        memory_total_mib=total,
        memory_used_mib=total - free,
        memory_free_mib=free,
        utilization_pct=util,
        processes=processes,
    )
    fields.update(smi)
    return VisibleGpu(cuda_index=i, gpu=SmiGpu(**fields), hidden_used_mib=hidden)


# ----------------------------------------------------------------------------- sizes and ranking


@pytest.mark.parametrize(
    "text, mib",
    [
        ("10GiB", 10240),
        ("512MiB", 512),
        ("1.5 GiB", 1536),
        ("1TiB", 1048576),
        ("10GB", 10**10 >> 20),  # decimal, as convert --max-shard-size reads it
        ("10G", 10**10 >> 20),
        ("24", 24576),  # a bare number is GiB
        (24, 24576),
    ],
)
def test_parse_size(text, mib):
    assert parse_size_mib(text) == mib


def test_pick_gpu_and_convert_read_a_size_alike():
    from ckptfix.text import parse_size

    for text in ("5GB", "5GiB", "512MiB", "1.5TB", "7K"):
        assert parse_size_mib(text) == parse_size(text) >> 20


@pytest.mark.parametrize("bad", ["", "ten", "10 parsecs", "-1G"])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError, match="cannot read size"):
        parse_size_mib(bad)


def test_rank_by_free_then_util_then_procs_then_index():
    devs = [
        gpu(0, 50_000),
        gpu(1, 90_150, util=50),
        gpu(2, 90_500, util=10),
        gpu(3, 90_200, util=10, procs=1),
        gpu(4, 90_300, util=10),
    ]
    ranked, rejected = rank_gpus(devs, Criteria())
    assert [r.gpu.smi_index for r in ranked] == [2, 4, 3, 1, 0]
    assert rejected == []
    assert (
        "fewer processes" not in ranked[0].reason
        and "same utilization and processes; lower nvidia-smi index" in ranked[0].reason
    )
    assert "fewer processes (0 vs 1)" in ranked[1].reason
    assert "lower utilization (10% vs 50%)" in ranked[2].reason
    assert "more free memory than the next candidate GPU 0" in ranked[3].reason
    assert ranked[4].reason.endswith("the only candidate left")


def test_filters_and_skips():
    devs = [
        gpu(0, 90_000, util=90),
        gpu(1, 1_000),
        gpu(2, 90_000, procs=2),
        gpu(3, 90_000, mig_enabled=True),
        gpu(4, 0, memory_free_mib=None, unavailable=(("memory.free", "Insufficient Permissions"),)),
        gpu(5, 80_000, hidden=30_000),  # used memory, no visible process
        gpu(6, 60_000),
    ]
    ranked, rejected = rank_gpus(devs, Criteria(min_free_mib=10_240, max_util=20, max_procs=0))
    assert [r.gpu.smi_index for r in ranked] == [6]
    why = {r.gpu.smi_index: r.reason for r in rejected}
    assert why[0] == "90% utilization > --max-util 20"
    assert why[1] == "1.0 GiB free < --min-free 10.0 GiB"
    assert why[2] == "2 process(es) > --max-procs 0"
    assert why[3].startswith("MIG is enabled")
    assert why[4] == "memory is unavailable ([Insufficient Permissions])"
    assert "used with no visible process" in why[5]


def test_max_procs_rejects_unknown_process_counts():
    # --query-compute-apps failed: process_count is None, which must not pass as "0 processes"
    devs = [gpu(0, 90_000, procs=None), gpu(1, 50_000)]
    ranked, rejected = rank_gpus(devs, Criteria(max_procs=0))
    assert [r.gpu.smi_index for r in ranked] == [1]
    assert rejected[0].reason.startswith("process count unavailable")
    ranked, _ = rank_gpus(devs, Criteria())  # without --max-procs it still ranks
    assert [r.gpu.smi_index for r in ranked] == [0, 1]


def test_hidden_usage_ranks_below_an_idle_twin():
    ranked, _ = rank_gpus([gpu(0, 90_000, hidden=5_000), gpu(1, 90_000)], Criteria())
    assert [r.gpu.smi_index for r in ranked] == [1, 0]
    assert "used by processes not visible here" in ranked[1].reason


def test_selection_env_uuid_and_index():
    devs = [gpu(3, 1), gpu(1, 1)]
    assert selection_env(devs) == {
        "CUDA_VISIBLE_DEVICES": "GPU-00000003,GPU-00000001",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    }
    assert selection_env(devs, by="index")["CUDA_VISIBLE_DEVICES"] == "3,1"
    assert selection_env([gpu(2, 1, uuid=None)])["CUDA_VISIBLE_DEVICES"] == "2"


# ----------------------------------------------------------------------------- leases


def test_timed_lease_blocks_until_expiry(tmp_path):
    lease, _ = try_lease(tmp_path, "GPU-1", 60, now=1000.0)
    assert lease is not None and lease.fd is None and lease.expires == 1060.0
    info = json.loads((tmp_path / "GPU-1.lease").read_text())
    assert info["pid"] == os.getpid() and info["expires"] == 1060.0
    # another process sees it as taken; simulate by rewriting the pid
    info["pid"] = 1
    (tmp_path / "GPU-1.lease").write_text(json.dumps(info))
    again, holder = try_lease(tmp_path, "GPU-1", 60, now=1030.0)
    assert again is None and "pid 1" in holder
    after, _ = try_lease(tmp_path, "GPU-1", 60, now=1061.0)  # expired: free again
    assert after is not None


def test_held_lease_blocks_while_open(tmp_path):
    held, _ = try_lease(tmp_path, "MIG-GPU-x/1/0", None)
    assert held is not None and held.fd is not None
    assert (tmp_path / "MIG-GPU-x_1_0.lease").exists()
    other, holder = try_lease(tmp_path, "MIG-GPU-x/1/0", 60)
    assert other is None and "(running)" in holder
    held.release()
    assert try_lease(tmp_path, "MIG-GPU-x/1/0", 0)[0] is not None


def test_undo_waits_for_a_briefly_locked_lease_file(tmp_path):
    """Another picker reading the file holds its lock for a moment: giving back must wait, not skip."""
    import fcntl
    import threading

    from ckptfix.gpu.leases import undo as _undo

    lease, _ = try_lease(tmp_path, "GPU-1", 60)
    assert lease is not None and lease.fd is None
    other = os.open(lease.path, os.O_RDWR)
    fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a separate open file: conflicts like another process
    timer = threading.Timer(0.2, os.close, (other,))
    timer.start()
    try:
        _undo(lease)
    finally:
        timer.join()
    assert Path(lease.path).read_text() == ""  # given back, not reserved until the expiry


def test_check_only_lease_writes_nothing(tmp_path):
    lease, _ = try_lease(tmp_path, "GPU-2", 0)
    assert lease is not None and (tmp_path / "GPU-2.lease").read_text() == ""


# ----------------------------------------------------------------------------- pick() with waiting (fake clock)


class FakeClock:
    def __init__(self):
        self.t = 0.0
        self.sleeps: list[float] = []

    def __call__(self):
        return self.t

    def sleep(self, s):
        self.sleeps.append(s)
        self.t += s


def test_pick_waits_then_times_out(tmp_path):
    runner = scenario_runner("h200_busy")
    clock = FakeClock()
    msgs: list[str] = []
    with pytest.raises(GpuWaitTimeoutError, match="waited 25s") as ei:
        pick(
            lambda: visible_gpus(env={}, runner=runner),
            Criteria(min_free_mib=200_000),
            lease_seconds=0,
            directory=tmp_path,
            wait=25,
            interval=10,
            sleep=clock.sleep,
            clock=clock,
            on_wait=msgs.append,
        )
    assert clock.sleeps == [10, 10, 5]
    assert ei.value.exit_code == 23 and len(msgs) == 3


def test_pick_waits_until_released(tmp_path):
    calls = {"n": 0}

    def get_view():
        calls["n"] += 1
        return visible_gpus(env={}, runner=scenario_runner("h200_busy" if calls["n"] < 3 else "h200_after_release"))

    clock = FakeClock()
    res = pick(
        get_view,
        Criteria(n=2, min_free_mib=100 * 1024, max_procs=0),
        lease_seconds=0,
        directory=tmp_path,
        wait=600,
        interval=10,
        sleep=clock.sleep,
        clock=clock,
    )
    assert [r.gpu.smi_index for r in res.chosen] == [2, 4] and res.waited_s == 20


def test_pick_without_wait_fails_fast_with_reasons(tmp_path):
    with pytest.raises(NoGpuFitsError) as ei:
        pick(
            lambda: visible_gpus(env={}, runner=scenario_runner("h200_busy")),
            Criteria(n=2, max_util=50),
            lease_seconds=0,
            directory=tmp_path,
        )
    assert ei.value.exit_code == 22
    msg = str(ei.value)
    assert msg.startswith("no GPU fits the request (need 2 GPU(s), 1 qualifies: GPU 0 (NVIDIA H200): 100% utilization")
    assert msg.endswith("relax the filters or use --wait SECONDS")


def test_pick_more_than_visible(tmp_path):
    with pytest.raises(NoGpuFitsError, match="only 2 are visible"):
        pick(
            lambda: visible_gpus(env={"CUDA_VISIBLE_DEVICES": "0,1"}, runner=scenario_runner("h200_busy")),
            Criteria(n=3),
            lease_seconds=0,
            directory=tmp_path,
        )


def test_partial_pick_gives_leases_back(tmp_path):
    env = {"CKPTFIX_LEASE_DIR": str(tmp_path)}
    with pytest.raises(NoGpuFitsError):
        pick_gpu(3, min_free="100GiB", environ=env, runner=scenario_runner("two_free"), set_env=False, lease=60)
    assert all(p.read_text() == "" for p in tmp_path.iterdir())
    res = pick_gpu(2, environ=env, runner=scenario_runner("two_free"), set_env=False, lease=60)
    assert len(res.chosen) == 2


# ----------------------------------------------------------------------------- the Python API


def test_pick_gpu_sets_environ_and_holds_lease(tmp_path):
    environ = {"CKPTFIX_LEASE_DIR": str(tmp_path), "CUDA_VISIBLE_DEVICES": "0,1,7"}
    res = pick_gpu(environ=environ, runner=scenario_runner("h200_after_release"))
    assert environ["CUDA_VISIBLE_DEVICES"] == "GPU-28780eb0-24d5-1f13-59b8-ae5c23617a72"
    assert environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert res.leases[0].fd is not None  # held for the life of this process
    other, holder = try_lease(tmp_path, res.chosen[0].gpu.id, 60)
    assert other is None
    res.leases[0].release()


def test_second_pick_gpu_in_the_same_process_reuses_its_own_lease(tmp_path):
    from ckptfix.gpu import leases as pick_mod

    environ = {"CKPTFIX_LEASE_DIR": str(tmp_path)}
    first = pick_gpu(environ=environ, runner=scenario_runner("two_free"))
    try:
        # environ now names only that GPU: picking again (a re-run notebook cell) gets it back, same lease
        again = pick_gpu(environ=environ, runner=scenario_runner("two_free"))
        assert again.ids == first.ids and again.leases[0] is first.leases[0]
        # asking for two without narrowing: the held one plus the other, no "leased by another job"
        both = pick_gpu(
            2, environ={"CKPTFIX_LEASE_DIR": str(tmp_path)}, runner=scenario_runner("two_free"), set_env=False
        )
        assert set(first.ids) < set(both.ids) and not both.rejected
        assert sum(1 for h in pick_mod._HELD if h is first.leases[0]) == 1
        # a pick that falls short must not give back the lease the first pick holds
        (other,) = [le for le in both.leases if le is not first.leases[0]]
        other.release()
        blocker, _ = try_lease(tmp_path, other.key, None)
        try:
            with pytest.raises(NoGpuFitsError, match="already leased by this process"):
                pick_gpu(
                    2, environ={"CKPTFIX_LEASE_DIR": str(tmp_path)}, runner=scenario_runner("two_free"), set_env=False
                )
        finally:
            blocker.release()
        assert first.leases[0].fd is not None
        assert try_lease(tmp_path, first.ids[0], 60)[0] is None
    finally:
        for res in (first, locals().get("both")):
            for le in res.leases if res else ():
                le.release()


def test_a_lease_this_process_took_itself_is_named_as_such(tmp_path):
    held, _ = try_lease(tmp_path, "GPU-4e9e74b7-4977-f04d-3af3-ccfe5f570e90", None)  # not via pick_gpu
    try:
        with pytest.raises(NoGpuFitsError) as ei:
            pick_gpu(
                environ={"CKPTFIX_LEASE_DIR": str(tmp_path), "CUDA_VISIBLE_DEVICES": "2"},
                runner=scenario_runner("h200_after_release"),
                set_env=False,
            )
        assert f"already leased by this process (pid {os.getpid()}" in str(ei.value)
        assert "another job" not in str(ei.value)
    finally:
        held.release()


def test_pick_gpu_refuses_after_cuda_init(monkeypatch, tmp_path):
    fake = types.ModuleType("torch")
    fake.cuda = types.SimpleNamespace(is_initialized=lambda: True)
    monkeypatch.setitem(sys.modules, "torch", fake)
    environ = {"CKPTFIX_LEASE_DIR": str(tmp_path)}
    with pytest.raises(CudaAlreadyInitializedError, match="already initialised") as ei:
        pick_gpu(environ=environ, runner=scenario_runner("h200_after_release"))
    assert ei.value.exit_code == 24 and "CUDA_VISIBLE_DEVICES" not in environ
    # set_env=False only reports a choice, so it is allowed
    res = pick_gpu(environ=environ, runner=scenario_runner("h200_after_release"), set_env=False, lease=False)
    assert res.chosen[0].gpu.smi_index == 2


def test_pick_gpu_no_gpu_is_catchable_for_cpu_fallback(tmp_path):
    environ = {"CKPTFIX_LEASE_DIR": str(tmp_path)}
    for scen in ("driver_not_loaded", "lib_mismatch", "no_devices"):
        with pytest.raises(NoGpuError):
            pick_gpu(environ=environ, runner=scenario_runner(scen))
    with pytest.raises(NoGpuError, match="hides all of them"):
        pick_gpu(environ=dict(environ, CUDA_VISIBLE_DEVICES=""), runner=scenario_runner("h200_busy"))


def test_lazy_top_level_exports():
    import ckptfix

    assert ckptfix.pick_gpu is pick_gpu and ckptfix.visible_gpus is visible_gpus
