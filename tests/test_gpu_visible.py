"""CUDA_VISIBLE_DEVICES / CUDA_DEVICE_ORDER rules (pure), including a hypothesis property test."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

if not any(Path(p, "ckptfix", "__init__.py").exists() for p in sys.path if p):  # a checkout, not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckptfix.gpu.cudainit import cuda_initialized
from ckptfix.gpu.cvd import parse_visible_devices, strtoul_prefix
from ckptfix.gpu.order import enumeration_order
from ckptfix.gpu.records import MigDevice, SmiGpu, SmiSnapshot
from ckptfix.gpu.visible import build_view

U = [
    "GPU-4dd97325-7fe6-abf1-d6a9-ba746fe0fdab",
    "GPU-9e13f17f-a213-eb38-9a9c-0b2a540e4908",
    "GPU-9e1aaaaa-a213-eb38-9a9c-0b2a540e4908",
    "GPU-eeb0f073-2f03-6035-72a3-7b1ac76c5a72",
]


def gpus(names=("A100",) * 4, pcis=None):
    pcis = pcis or [f"00000000:{0x10 * (i + 1):02X}:00.0" for i in range(len(names))]
    return tuple(
        SmiGpu(
            index=i,
            uuid=U[i],
            pci_bus_id=pcis[i],
            name=n,
            memory_total_mib=1000,
            memory_used_mib=0,
            memory_free_mib=1000,
            utilization_pct=0,
            processes=(),
        )
        for i, n in enumerate(names)
    )


def view(env, g=None, **kw):
    return build_view(SmiSnapshot(gpus=g or gpus(), driver_version="550.1"), env, **kw)


def smi_indices(v):
    return [d.smi_index for d in v.devices]


# ----------------------------------------------------------------------------- the parser


@pytest.mark.parametrize(
    "value, kind, entries",
    [
        (None, "all", ()),
        ("", "none", ()),
        ("0,1", "index", (0, 1)),
        ("2,0", "index", (2, 0)),  # listed order is CUDA's order
        (" 1, 3", "index", (1, 3)),
        ("1gpu2", "index", (1,)),  # strtoul
        ("0,2,-1,3", "index", (0, 2)),  # a negative stops the list
        ("-1", "index", ()),
        ("0,abc,1", "index", (0,)),  # first invalid entry truncates
        ("0,1,0", "index", ()),  # a duplicate empties everything
        ("+1", "index", (1,)),
        ("0,GPU-4dd9", "index", (0,)),  # mixing stops parsing
        ("GPU-4dd9,GPU-9e13", "uuid", ("GPU-4dd9", "GPU-9e13")),
        ("GPU-4dd9,1", "uuid", ("GPU-4dd9",)),
        ("GPU-4dd9,GPU-4dd9", "uuid", ()),
        ("MIG-1c5876e6,MIG-934f", "mig", ("MIG-1c5876e6", "MIG-934f")),
        (
            "MIG-GPU-fb8bbc70-d551-45f9-43d4-9734f9cddb2c/1/0",
            "mig",
            ("MIG-GPU-fb8bbc70-d551-45f9-43d4-9734f9cddb2c/1/0",),
        ),
        ("MIG-x,GPU-y", "mig", ("MIG-x",)),
    ],
)
def test_parse_visible_devices(value, kind, entries):
    spec = parse_visible_devices(value)
    assert (spec.kind, spec.entries) == (kind, entries)


def test_parser_notes_say_what_was_dropped():
    assert parse_visible_devices("0,1,0").emptied_by_duplicate
    assert "read as 1 (CUDA parses entries like strtoul)" in parse_visible_devices("1gpu2").read_as[0]
    assert "'-1' is negative" in parse_visible_devices("0,-1,2").notes[0]
    assert "UUID after indices" in parse_visible_devices("0,GPU-x").notes[0]


@pytest.mark.parametrize(
    "s, n", [("1gpu2", 1), ("  7", 7), ("-3", -3), ("+", None), ("-", None), ("", None), ("x1", None), ("²", None)]
)
def test_strtoul_prefix(s, n):
    assert strtoul_prefix(s) == n


@settings(max_examples=500, deadline=None)
@given(
    st.one_of(
        st.text(),
        st.text(alphabet="0123456789,-+ GPUMI-abcdef/"),
        st.lists(st.integers(-3, 12)).map(lambda xs: ",".join(map(str, xs))),
    )
)
def test_parser_never_raises_and_never_duplicates(value):
    spec = parse_visible_devices(value)
    assert len(set(spec.entries)) == len(spec.entries)
    v = view({"CUDA_VISIBLE_DEVICES": value})
    assert len({d.smi_index for d in v.devices}) == len(v.devices)
    assert [d.cuda_index for d in v.devices] == list(range(len(v.devices)))


# ----------------------------------------------------------------------------- mapping to physical GPUs


def test_unset_is_all_in_pci_order():
    g = gpus(pcis=["00000000:80:00.0", "00000000:10:00.0", "00000000:5e:00.0", "00000000:5F:00.0"])
    v = view({}, g)
    assert smi_indices(v) == [1, 2, 3, 0] and v.order_certain


def test_empty_hides_all():
    v = view({"CUDA_VISIBLE_DEVICES": ""})
    assert v.devices == () and [p.code for p in v.problems] == ["cvd_empty"]


def test_index_list_order_and_out_of_range_truncates():
    assert smi_indices(view({"CUDA_VISIBLE_DEVICES": "3,1"})) == [3, 1]
    v = view({"CUDA_VISIBLE_DEVICES": "1,7,2"})
    assert smi_indices(v) == [1]
    assert "index 7 is out of range (this machine has 4 GPU(s))" in v.problems[0].message


def test_uuid_abbreviation_unique_ambiguous_unknown():
    assert smi_indices(view({"CUDA_VISIBLE_DEVICES": "GPU-eeb0,GPU-4dd97325-7fe6-abf1-d6a9-ba746fe0fdab"})) == [3, 0]
    v = view({"CUDA_VISIBLE_DEVICES": "GPU-4dd9,GPU-9e1,GPU-eeb0"})  # GPU-9e1 matches two GPUs
    assert smi_indices(v) == [0] and "ambiguous" in v.problems[0].message
    v = view({"CUDA_VISIBLE_DEVICES": "GPU-ffff,GPU-eeb0"})
    assert smi_indices(v) == [] and "matches no GPU" in v.problems[0].message
    v = view({"CUDA_VISIBLE_DEVICES": "GPU-eeb0,GPU-eeb0f073"})  # same GPU twice via different prefixes
    assert smi_indices(v) == [] and v.problems[0].code == "cvd_empty"


def test_mixed_models_without_pci_order_is_uncertain():
    g = gpus(names=("T1000", "RTX PRO 6000", "RTX PRO 6000", "RTX PRO 6000"))
    v = view({}, g)
    assert not v.order_certain and "order_uncertain" in [p.code for p in v.problems]
    assert "export CUDA_DEVICE_ORDER=PCI_BUS_ID" in v.problems[-1].fix
    assert view({"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, g).order_certain
    assert not view({"CUDA_VISIBLE_DEVICES": "0"}, g).order_certain  # index 0 may be the fastest card
    assert view({"CUDA_VISIBLE_DEVICES": U[0]}, g).order_certain  # UUIDs do not depend on the order
    assert enumeration_order(g, None)[1] is False and enumeration_order(g[1:], None)[1] is True


def test_invalid_device_order_is_reported_and_read_as_cuda_reads_it():
    mixed = gpus(names=("T1000", "RTX PRO 6000", "RTX PRO 6000", "RTX PRO 6000"))
    for bad in ("pci_bus_id", "PCI_BUS_ID ", "PCI-BUS-ID", ""):
        v = view({"CUDA_DEVICE_ORDER": bad}, mixed)
        # CUDA honours only the exact string PCI_BUS_ID: anything else is FASTEST_FIRST, so still a guess
        assert v.effective_order == "FASTEST_FIRST" and not v.order_certain
        (p,) = [p for p in v.problems if p.code == "device_order_invalid"]
        assert f"CUDA_DEVICE_ORDER={bad!r}" in p.message and "uses FASTEST_FIRST" in p.message
        assert "export CUDA_DEVICE_ORDER=PCI_BUS_ID exactly" in p.fix
        assert any(repr(bad) in w for w in v.warnings)
    v = view({"CUDA_DEVICE_ORDER": "pci_bus_id"})  # same models: the mapping is certain, the value still wrong
    assert v.order_certain and [p.code for p in v.problems] == ["device_order_invalid"]
    for ok in (None, "PCI_BUS_ID", "FASTEST_FIRST"):
        env = {} if ok is None else {"CUDA_DEVICE_ORDER": ok}
        assert "device_order_invalid" not in [p.code for p in view(env, mixed).problems]


def _mig_gpus():
    base = gpus()
    legacy = MigDevice("MIG-GPU-" + U[1][4:] + "/1/0", U[1], 1, 0, "3g.20gb")
    modern = (
        MigDevice("MIG-1c5876e6-d3b9-524a-9eb4-664fcfbd4de2", U[2], 2, 0, "1g.5gb"),
        MigDevice("MIG-1c58aaaa-d3b9-524a-9eb4-664fcfbd4de2", U[2], 2, 1, "1g.5gb"),
    )
    from dataclasses import replace

    return (
        base[0],
        replace(base[1], mig_enabled=True, mig_devices=(legacy,)),
        replace(base[2], mig_enabled=True, mig_devices=modern),
        base[3],
    )


def test_mig_ids_current_and_legacy():
    g = _mig_gpus()
    v = view({"CUDA_VISIBLE_DEVICES": "MIG-1c5876e6,MIG-GPU-" + U[1][4:] + "/1/0"}, g)
    # a CUDA process sees a single MIG instance: the first; both stay candidates for pick-gpu
    assert smi_indices(v) == [2] and [d.smi_index for d in v.candidates] == [2, 1]
    assert "mig_single" in [p.code for p in v.problems]
    assert v.devices[0].name == "A100 MIG 1g.5gb" and v.devices[0].id.startswith("MIG-1c5876e6")
    v = view({"CUDA_VISIBLE_DEVICES": "MIG-1c58"}, g)  # ambiguous prefix
    assert smi_indices(v) == [] and "ambiguous" in v.problems[0].message
    v = view({}, g)
    # CVD unset: CUDA enumerates the MIG devices, never their parents; the fix names them (no `nvidia-smi -L`)
    assert [(d.smi_index, d.mig_device.uuid if d.mig_device else None) for d in v.devices] == [
        (0, None),
        (1, g[1].mig_devices[0].uuid),
        (2, g[2].mig_devices[0].uuid),
        (2, g[2].mig_devices[1].uuid),
        (3, None),
    ]
    assert [d.memory_total_mib for d in v.devices][1:4] == [20480, 5120, 5120]
    codes = [p.code for p in v.problems]
    assert "mig_parent" not in codes and codes.count("mig_enumeration") == 1 and not v.order_certain
    p = next(p for p in v.problems if p.code == "mig_enumeration")
    assert g[1].mig_devices[0].uuid in p.fix and "nvidia-smi -L" not in p.fix


def test_mig_parent_without_instances_says_how_to_make_one():
    from dataclasses import replace

    base = gpus()
    g = (base[0], replace(base[1], mig_enabled=True), base[2], base[3])
    v = build_view(SmiSnapshot(gpus=g, mig_listed=True), {})
    p = next(p for p in v.problems if p.code == "mig_parent")
    assert "nvidia-smi -L" not in p.fix and "-cgi" in p.fix and "-mig 0" in p.fix


def test_cuda_initialized_detection_without_importing_torch(monkeypatch):
    fake = types.ModuleType("torch")
    fake.cuda = types.SimpleNamespace(is_initialized=lambda: True)
    monkeypatch.setitem(sys.modules, "torch", fake)
    assert cuda_initialized() is True
    fake.cuda = types.SimpleNamespace(is_initialized=lambda: False)
    assert cuda_initialized() is False
    monkeypatch.delitem(sys.modules, "torch")
    assert cuda_initialized() is False
    v = view({}, cuda_is_initialized=True)
    assert v.cuda_initialized and v.problems[-1].code == "cuda_initialized"
    assert "has no effect" in v.problems[-1].message


def test_view_to_dict_round_trips_to_json():
    import json

    doc = json.loads(json.dumps(view({"CUDA_VISIBLE_DEVICES": "1,0"}).to_dict()))
    assert [d["device"] for d in doc["devices"]] == ["cuda:0", "cuda:1"]
    assert [d["smi_index"] for d in doc["devices"]] == [1, 0]


def test_mig_duplicate_by_prefix_and_unlisted_mig_are_explained():
    g = _mig_gpus()
    v = view({"CUDA_VISIBLE_DEVICES": "MIG-1c5876e6,MIG-1c5876e6-d3b9"}, g)  # one MIG device, two spellings
    assert smi_indices(v) == [] and [p.code for p in v.problems] == ["cvd_empty"]
    assert "twice" in v.problems[0].message
    v = view({"CUDA_VISIBLE_DEVICES": "MIG-1c5876e6"})  # no MIG device on this machine
    assert smi_indices(v) == [] and v.problems[0].code == "cvd_truncated"
    assert "nvidia-smi -L lists none" in v.problems[0].message


def test_mig_parent_missing_from_query_gpu_does_not_crash():
    from dataclasses import replace

    g = _mig_gpus()
    orphan = MigDevice("MIG-77777777-d3b9-524a-9eb4-664fcfbd4de2", "GPU-00000000-lost", 4, 0, "1g.5gb")
    g = g[:3] + (replace(g[3], mig_devices=(orphan,)),)
    v = view({"CUDA_VISIBLE_DEVICES": "MIG-7777"}, g)
    assert smi_indices(v) == [4] and v.devices[0].mig_device == orphan


def test_memory_placeholder_decides_the_fix():
    from dataclasses import replace

    base = gpus()
    g = (
        replace(base[0], memory_total_mib=None, memory_free_mib=None, unavailable=(("memory.free", "N/A"),)),
        replace(base[1], memory_free_mib=None, unavailable=(("memory.free", "Insufficient Permissions"),)),
        replace(base[2], memory_free_mib=None, unavailable=(("memory.free", "Unknown Error"),)),
        base[3],
    )
    fixes = [p.fix for p in view({}, g).problems if p.code == "memory_unavailable"]
    assert "unified memory" not in fixes[0] and "does not report memory" in fixes[0]  # a consumer card
    gb10 = (replace(g[0], name="NVIDIA GB10"),)
    assert "unified memory" in next(p.fix for p in view({}, gb10).problems if p.code == "memory_unavailable")
    assert "access to the GPU's memory counters" in fixes[1]
    assert "unified memory" not in fixes[2] and "dmesg" in fixes[2]


def test_gpu_nvidia_smi_could_not_read_makes_indices_uncertain():
    g = gpus()
    lost = (g[0], g[2], g[3])  # "Unable to determine the device handle for GPU1", rows 0, 2, 3
    v = view({}, lost)
    assert smi_indices(v) == [0, 2, 3] and not v.order_certain
    assert [p.code for p in v.problems] == ["gpu_unreadable"] and "GPU(s) 1" in v.problems[0].message
    assert not view({"CUDA_VISIBLE_DEVICES": "1"}, lost).order_certain
    assert view({"CUDA_VISIBLE_DEVICES": U[2]}, lost).order_certain  # a UUID does not depend on numbering
    assert view({}, g).order_certain and view({}, g).problems == ()


def test_row_without_pci_keeps_its_listing_position():
    from dataclasses import replace

    g = gpus()
    broken = replace(g[1], uuid=None, pci_bus_id=None, name=None, unavailable=(("pci.bus_id", "Unknown Error"),))
    assert smi_indices(view({}, (g[0], broken, g[2], g[3]))) == [0, 1, 2, 3]


# ----------------------------------------------------------------------------- issue 12


@pytest.mark.parametrize("cvd", ["", "-1", "1,1", "NoDevFiles", "GPU-nope", "7"])
def test_hiding_every_gpu_is_cvd_empty_with_physical_gpus_listed(cvd):
    v = view({"CUDA_VISIBLE_DEVICES": cvd})
    assert v.devices == ()
    assert "cvd_empty" in [p.code for p in v.problems], v.problems
    doc = v.to_dict()
    assert [p["cuda_index"] for p in doc["physical"]] == [None] * 4
    assert [p["uuid"] for p in doc["physical"]] == list(U[:4])


@pytest.mark.parametrize("cvd, seen", [("1gpu2,2ampere", [1, 2]), ("+1,-0", [1, 0]), ("0, 2", [0, 2])])
def test_entries_cuda_accepts_are_not_reported_as_truncated(cvd, seen):
    v = view({"CUDA_VISIBLE_DEVICES": cvd})
    assert smi_indices(v) == seen
    codes = [p.code for p in v.problems]
    assert "cvd_truncated" not in codes and "cvd_empty" not in codes
    assert all("remove the invalid entry" not in p.fix for p in v.problems)


def test_physical_list_maps_cuda_indices():
    doc = view({"CUDA_VISIBLE_DEVICES": "2,0"}).to_dict()
    assert [p["cuda_index"] for p in doc["physical"]] == [1, None, 0, None]


def test_pci_index_follows_pci_order_not_smi_index():
    # nvidia-smi index order differs from PCI order (as on samples/csv_noheader_units_mixed_models_order_mismatch)
    g = gpus(pcis=["00000000:81:00.0", "00000000:01:00.0", "00000000:41:00.0", "00000000:C1:00.0"])
    v = view({"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, g)
    assert smi_indices(v) == [1, 2, 0, 3]
    assert [(d.smi_index, d.pci_index) for d in v.devices] == [(1, 0), (2, 1), (0, 2), (3, 3)]


def test_fastest_first_guess_ranks_like_cuda():
    """A T4 and two A100s, CUDA_DEVICE_ORDER unset: the A100s (cc 8.0) come first, the T4 (7.5) last."""
    g = gpus(names=("Tesla T4", "NVIDIA A100-SXM4-40GB", "NVIDIA A100-SXM4-40GB"))
    v = view({}, g)
    assert smi_indices(v) == [1, 2, 0] and not v.order_certain
    assert "order_uncertain" in [p.code for p in v.problems]
    assert smi_indices(view({"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, g)) == [0, 1, 2]
    assert smi_indices(view({"CUDA_VISIBLE_DEVICES": "0"}, g)) == [1]  # cuda:0 is (probably) an A100


def test_fastest_first_uses_reported_compute_cap_and_clock():
    from dataclasses import replace

    g = gpus(names=("Unknown Board X", "Unknown Board Y"))
    g = (
        replace(g[0], compute_cap=(8, 6), max_sm_clock_mhz=1800),
        replace(g[1], compute_cap=(9, 0), max_sm_clock_mhz=1980),
    )
    assert smi_indices(view({}, g)) == [1, 0]
    # same compute capability: multiprocessors x clock decides (table gives the SM counts)
    h = gpus(names=("NVIDIA GeForce RTX 5060", "NVIDIA GeForce RTX 5060 Ti"))
    h = (
        replace(h[0], compute_cap=(12, 0), max_sm_clock_mhz=3090),
        replace(h[1], compute_cap=(12, 0), max_sm_clock_mhz=3090),
    )
    assert smi_indices(view({}, h)) == [1, 0]


def test_model_table():
    from ckptfix.gpu.order import model_info

    assert model_info("Tesla T4") == ((7, 5), 40)
    assert model_info("NVIDIA T1000 8GB") == ((7, 5), 14)
    assert model_info("NVIDIA H100 PCIe") == ((9, 0), 114)
    assert model_info("NVIDIA A10") == ((8, 6), 72) and model_info("NVIDIA A100 80GB PCIe")[0] == (8, 0)
    assert model_info("Some Future GPU") == (None, None)


FIX = Path(__file__).parent / "fixtures" / "nvidia-smi"


def test_fastest_first_guess_matches_the_real_sample():
    """samples/csv_noheader_units_mixed_models_order_mismatch.txt: CUDA (llama.cpp's log) listed the RTX 3090
    as device 0 and the GTX 1660 SUPER (nvidia-smi 0) as device 1."""
    text = (FIX / "samples" / "csv_noheader_units_mixed_models_order_mismatch.txt").read_text().split("\n", 1)[1]
    from ckptfix.gpu.parse import parse_gpu_csv

    parsed, _ = parse_gpu_csv(text, ("name", "memory.total", "index"))
    v = build_view(SmiSnapshot(gpus=tuple(parsed)), {})
    assert [d.name for d in v.devices] == ["NVIDIA GeForce RTX 3090", "NVIDIA GeForce GTX 1660 SUPER"]
    assert not v.order_certain


@pytest.mark.parametrize("module", ["ckptfix.gpu.cvd", "ckptfix.gpu.order", "ckptfix.gpu.visible"])
def test_doctests(module):
    import doctest
    import importlib

    res = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert res.failed == 0
