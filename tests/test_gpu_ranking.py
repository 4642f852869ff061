"""Ranking compares exact MiB with a stated tolerance, and the printed reason is the real one (issue 23, item 2)."""

from __future__ import annotations

from ckptfix.gpu.pick import FREE_TOLERANCE_MIB, Criteria, rank_gpus
from ckptfix.gpu.records import GpuProcess, SmiGpu, VisibleGpu


def gpu(i, free, util=0, procs=0, total=81_559):
    uuid = f"GPU-{i:08d}"
    g = SmiGpu(
        index=i,
        uuid=uuid,
        name="H100",
        memory_total_mib=total,
        memory_used_mib=total - free,
        memory_free_mib=free,
        utilization_pct=util,
        processes=tuple(GpuProcess(uuid, 100 + k, "python", 10) for k in range(procs)),
    )
    return VisibleGpu(i, g)


def test_two_mib_more_free_does_not_beat_idle():
    # 80,897 vs 80,895 MiB: both "79.0 GiB"; the busy one used to win on rounding down across a GiB boundary
    busy, idle = gpu(0, 80_897, util=100, procs=1), gpu(1, 80_895, util=0)
    ranked, _ = rank_gpus([busy, idle], Criteria())
    assert [r.gpu.smi_index for r in ranked] == [1, 0]
    why = ranked[0].reason
    assert "79.0 GiB vs 79.0 GiB" not in why
    assert f"within {FREE_TOLERANCE_MIB} MiB of GPU 0 (80,895 MiB vs 80,897 MiB" in why, why
    assert "lower utilization (0% vs 100%)" in why, why


def test_gib_boundary_does_not_split_equals():
    # 1,023.9 GiB vs 1,024.0 GiB: formerly different "GiB" buckets, so the 100%-busy one came first
    a, b = gpu(0, 1024 * 80, util=100), gpu(1, 1024 * 80 - 1, util=0)
    ranked, _ = rank_gpus([a, b], Criteria())
    assert [r.gpu.smi_index for r in ranked] == [1, 0]


def test_beyond_tolerance_free_memory_wins_and_says_by_how_much():
    a, b = gpu(0, 40_000, util=100), gpu(1, 40_000 + FREE_TOLERANCE_MIB + 1, util=100)
    ranked, _ = rank_gpus([a, b], Criteria())
    assert [r.gpu.smi_index for r in ranked] == [1, 0]
    assert f"(40,513 MiB vs 40,000 MiB, 513 MiB more: beyond the {FREE_TOLERANCE_MIB} MiB tolerance)" in (
        ranked[0].reason
    )


def test_group_is_anchored_at_its_freest_gpu():
    # 1000 and 600 tie (400 apart); 200 is 800 below the freest: next group even though 400 below 600
    gs = [gpu(0, 30_000 + 200, util=0), gpu(1, 30_000 + 600, util=50), gpu(2, 30_000 + 1000, util=90)]
    ranked, _ = rank_gpus(gs, Criteria())
    assert [r.gpu.smi_index for r in ranked] == [1, 2, 0]
    assert "lower utilization (50% vs 90%)" in ranked[0].reason
    assert "beyond the" in ranked[1].reason


def test_min_free_rejection_shows_exact_sizes_when_gib_look_equal():
    _, rejected = rank_gpus([gpu(0, 81_919)], Criteria(min_free_mib=81_920))
    assert rejected[0].reason == "81,919 MiB free < --min-free 81,920 MiB"


def test_an_idle_cuda_context_of_another_container_loses_the_tie_to_an_empty_gpu():
    # issue 34 C4: GPU 0 has 400 MiB used and no visible process (another container's idle CUDA context: under
    # HIDDEN_BUSY_MIB, so no process is counted), GPU 1 nothing; within the 512 MiB tolerance GPU 0 won on index
    from ckptfix.gpu.records import SmiSnapshot
    from ckptfix.gpu.visible import build_view

    def smi(i, used):
        total = 143_771
        return SmiGpu(
            index=i,
            uuid=f"GPU-{i:08d}",
            name="NVIDIA H200",
            memory_total_mib=total,
            memory_used_mib=used,
            memory_free_mib=total - used - 502,
            utilization_pct=0,
            processes=(),
        )

    view = build_view(SmiSnapshot(gpus=(smi(0, 400), smi(1, 0)), processes_known=True), {})
    assert view.devices[0].process_count == 0 and view.devices[0].hidden_used_mib == 0
    ranked, _ = rank_gpus(view.devices, Criteria())
    assert [r.gpu.smi_index for r in ranked] == [1, 0]
    assert "nothing on it (GPU 0 has 400 MiB used with no visible process" in ranked[0].reason, ranked[0].reason


def _unified(i, name="NVIDIA GB10"):
    g = SmiGpu(
        index=i,
        uuid=f"GPU-{i:08d}-0000-0000-0000-000000000000",
        name=name,
        utilization_pct=0,
        unavailable=(("memory.total", "N/A"), ("memory.used", "N/A"), ("memory.free", "N/A")),
        processes=(),
    )
    return VisibleGpu(i, g)


def test_unified_memory_gpu_is_picked_after_gpus_whose_memory_is_known():
    # issue 34 C1: memory.* [N/A] on a unified-memory GPU: a candidate with memory unknown, never above a known one
    ranked, rejected = rank_gpus([_unified(0), gpu(1, 40_000)], Criteria(n=2))
    assert [r.gpu.smi_index for r in ranked] == [1, 0] and rejected == []
    assert "memory unknown" in ranked[1].reason and "unified memory" in ranked[1].reason
    assert "is not (unified memory)" in ranked[0].reason
    ranked, rejected = rank_gpus([_unified(0, "Orin (nvgpu)")], Criteria(min_free_mib=1024))
    assert ranked == [] and rejected[0].permanent and "memory is unknown on this GPU" in rejected[0].reason


def test_memory_unavailable_for_other_reasons_is_still_rejected():
    g = SmiGpu(index=0, uuid="GPU-0", name="NVIDIA A100", unavailable=(("memory.free", "Insufficient Permissions"),))
    ranked, rejected = rank_gpus([VisibleGpu(0, g)], Criteria())
    assert ranked == [] and "memory is unavailable ([Insufficient Permissions])" in rejected[0].reason
    g = SmiGpu(index=0, uuid="GPU-0", name="NVIDIA GeForce GTX 1080", unavailable=(("memory.free", "N/A"),))
    ranked, _ = rank_gpus([VisibleGpu(0, g)], Criteria())
    assert ranked == []  # [N/A] on a card with memory of its own: nothing to rank it by
