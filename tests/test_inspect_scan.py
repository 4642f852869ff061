"""inspect / scan: report fields per format, JSON schema, verdicts and exit codes, and no torch import."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from ckptfix.cli import main
from ckptfix.ops.inspect import INSPECT_SCHEMA, SCAN_SCHEMA, inspect_checkpoint, scan_checkpoint

from helpers import run_cli

pytestmark = pytest.mark.filterwarnings("ignore")

INSPECT_KEYS = {
    "schema",
    "path",
    "format",
    "file_size",
    "state_dict_key",
    "tensor_count",
    "parameter_count",
    "unique_parameter_count",
    "unique_bytes",
    "total_bytes",
    "dtypes",
    "locations",
    "prefixes",
    "shared",
    "non_tensor_entries",
    "globals",
    "stubbed_globals",
    "weights_only_ok",
    "weights_only_reason",
    "notes",
}
SCAN_KEYS = {"schema", "path", "format", "verdict", "pickles", "globals", "dangerous", "unknown", "errors"}

TINY_PARAMS = 4 * 3 + 3 + 3 + 3 + 3 + 3 + 1 + 3 * 2 + 2  # fc1 w,b; bn w,b,mean,var,nbt; fc2 w,b


# --------------------------------------------------------------------------- inspect fields


@pytest.mark.parametrize(
    "builder,fmt,key",
    [
        ("plain", "torch-zip", []),
        ("legacy", "torch-legacy", []),
        ("weird_root", "torch-zip", []),
        ("safetensors", "safetensors", []),
        ("sharded_bin", "sharded", []),
        ("sharded_safetensors", "sharded", []),
        ("dcp", "dcp", []),
        ("torchscript", "torchscript", []),
        ("lightning", "torch-zip", ["state_dict"]),
        ("wrapped", "torch-zip", ["model"]),
    ],
)
def test_inspect_format_and_counts(ckpt, builder, fmt, key):
    b = getattr(ckpt, builder)()
    r = inspect_checkpoint(b.path)
    assert r.format == fmt
    assert r.state_dict_key == key
    assert r.tensor_count == len(b.expected) == 9
    assert r.parameter_count == TINY_PARAMS
    assert r.dtypes == {"float32": 8, "int64": 1}
    assert INSPECT_KEYS <= set(r.to_dict())
    assert r.to_dict()["schema"] == INSPECT_SCHEMA
    json.dumps(r.to_dict())  # serialisable


def test_inspect_total_bytes(ckpt):
    b = ckpt.plain()
    r = inspect_checkpoint(b.path)
    assert r.total_bytes == sum(v.numel() * v.element_size() for v in b.expected.values())


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_inspect_locations_cuda7(ckpt, legacy):
    b = ckpt.cuda_tagged(device="cuda:7", legacy=legacy)
    r = inspect_checkpoint(b.path)
    assert r.locations == {"cuda:7": 9}
    assert any("cuda:7" in n for n in r.notes)


def test_inspect_locations_mixed(ckpt):
    r = inspect_checkpoint(ckpt.mixed_tagged().path)
    assert r.locations == {"cpu": 1, "cuda:1": 8}


@pytest.mark.parametrize(
    "builder,prefix", [("dataparallel", "module."), ("compiled", "_orig_mod."), ("lightning", "model.")]
)
def test_inspect_prefixes(ckpt, builder, prefix):
    r = inspect_checkpoint(getattr(ckpt, builder)().path)
    assert r.prefixes.get(prefix) == 9, r.prefixes


def test_inspect_plain_has_no_prefix(ckpt):
    assert inspect_checkpoint(ckpt.plain().path).prefixes == {}


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_inspect_shared_storage_tied(ckpt, legacy):
    r = inspect_checkpoint(ckpt.tied(legacy=legacy).path)
    assert r.shared == [["emb.weight", "head.weight"]]
    assert r.tensor_count == 2
    assert sum(r.locations.values()) == 1  # one storage


def test_inspect_lightning_namespace(ckpt):
    r = inspect_checkpoint(ckpt.lightning().path)
    assert r.weights_only_ok is False
    assert "argparse.Namespace" in r.weights_only_reason
    assert r.stubbed_globals == ["argparse.Namespace"]
    assert r.globals["argparse.Namespace"] == "unknown"
    assert r.non_tensor_entries["epoch"] == "3"
    assert "placeholder" in r.non_tensor_entries["hyper_parameters"]


def test_inspect_unimportable_args(ckpt):
    r = inspect_checkpoint(ckpt.unimportable_args().path)
    assert r.weights_only_ok is False
    assert r.stubbed_globals == ["models.TrainArgs"]
    assert "models.TrainArgs" in r.non_tensor_entries["args"]


def test_inspect_plain_weights_only_ok(ckpt):
    r = inspect_checkpoint(ckpt.plain().path)
    assert r.weights_only_ok is True
    assert all(c == "safe" for c in r.globals.values())
    assert r.stubbed_globals == []


def test_inspect_key_option(ckpt):
    b = ckpt.wrapped()
    r = inspect_checkpoint(b.path, key="model")
    assert r.state_dict_key == ["model"] and r.tensor_count == 9
    assert "epoch" in r.non_tensor_entries and "optimizer" in r.non_tensor_entries


def test_inspect_cli_text_and_json(ckpt, capsys):
    b = ckpt.cuda_tagged(dp=True)
    assert main(["inspect", str(b.path)]) == 0
    out = capsys.readouterr().out
    assert "torch-zip" in out and "cuda:7 x9" in out and "module. x9" in out
    assert main(["inspect", "--json", str(b.path)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert INSPECT_KEYS <= set(doc)
    assert doc["locations"] == {"cuda:7": 9}
    assert doc["prefixes"] == {"module.": 9}


# --------------------------------------------------------------------------- scan


def test_scan_safe_exit_0(ckpt, capsys):
    for b in (ckpt.plain(), ckpt.legacy(), ckpt.safetensors(), ckpt.dcp(), ckpt.sharded_bin()):
        r = scan_checkpoint(b.path)
        assert r.verdict == "safe", (b.path, r.globals, r.errors)
        assert main(["scan", str(b.path)]) == 0, b.path
        assert "safe" in capsys.readouterr().out


def test_scan_namespace_unknown_exit_11(ckpt, capsys):
    b = ckpt.lightning()
    r = scan_checkpoint(b.path)
    assert r.verdict == "unknown" and r.unknown == ["argparse.Namespace"] and r.dangerous == []
    assert main(["scan", str(b.path)]) == 11
    cap = capsys.readouterr()
    assert "unknown" in cap.out and "argparse.Namespace" in cap.out
    assert cap.err.startswith("Error: ")


@pytest.mark.parametrize("mode", ["zip", "legacy", "pickle"])
def test_scan_os_system_dangerous_exit_11_not_executed(ckpt, mode, capsys):
    b = ckpt.evil(f"evil_{mode}.pt", mode=mode)
    r = scan_checkpoint(b.path)
    assert r.verdict == "dangerous"
    assert any(g.endswith(".system") for g in r.dangerous), r.dangerous
    assert main(["scan", str(b.path)]) == 11
    cap = capsys.readouterr()
    assert "dangerous" in cap.out
    assert main(["scan", "--json", str(b.path)]) == 11
    doc = json.loads(capsys.readouterr().out)
    assert SCAN_KEYS <= set(doc) and doc["schema"] == SCAN_SCHEMA and doc["verdict"] == "dangerous"
    assert not b.extra["marker"].exists()


def test_inspect_evil_uses_placeholder(ckpt, capsys):
    b = ckpt.evil()
    assert main(["inspect", str(b.path)]) == 0
    out = capsys.readouterr().out
    assert "placeholder" in out and "system" in out
    r = inspect_checkpoint(b.path)
    assert r.weights_only_ok is False
    assert r.globals[next(g for g in r.globals if g.endswith(".system"))] == "dangerous"
    assert not b.extra["marker"].exists()


def test_scan_json_schema(ckpt, capsys):
    b = ckpt.plain()
    assert main(["scan", "--json", str(b.path)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert SCAN_KEYS <= set(doc)
    assert doc["verdict"] == "safe" and doc["dangerous"] == [] and doc["unknown"] == []
    for d in doc["globals"].values():
        assert set(d) == {"class", "count"} and d["class"] == "safe"


def test_scan_sharded_merges_shard_globals(ckpt):
    b = ckpt.sharded_bin()
    r = scan_checkpoint(b.path)
    assert len(r.pickles) == 2
    assert r.globals["torch._utils._rebuild_tensor_v2"]["count"] == 2


# --------------------------------------------------------------------------- no torch import

_NO_TORCH = textwrap.dedent("""
    import sys
    from ckptfix.cli import main
    codes = []
    for argv in {argvs!r}:
        codes.append(main(argv))
    bad = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.") or m == "safetensors.torch")
    print("CODES", codes)
    print("TORCH", bad[:5])
""")


def _run_no_torch(argvs):
    p = subprocess.run(
        [sys.executable, "-c", _NO_TORCH.format(argvs=argvs)], capture_output=True, text=True, timeout=600
    )
    lines = {
        ln.split(" ", 1)[0]: ln.split(" ", 1)[1] for ln in p.stdout.splitlines() if ln.startswith(("CODES", "TORCH"))
    }
    assert "TORCH" in lines, (p.stdout, p.stderr)
    return lines["CODES"], lines["TORCH"]


def test_inspect_and_scan_never_import_torch(ckpt):
    files = [
        ckpt.plain(),
        ckpt.legacy(),
        ckpt.lightning(),
        ckpt.safetensors(),
        ckpt.sharded_bin(),
        ckpt.sharded_safetensors(),
        ckpt.dcp(),
        ckpt.torchscript(),
        ckpt.evil(),
        ckpt.tied(),
        ckpt.cuda_tagged(),
    ]
    argvs = []
    for b in files:
        argvs += [
            ["inspect", str(b.path)],
            ["inspect", "--json", str(b.path)],
            ["scan", str(b.path)],
            ["scan", "--json", str(b.path)],
        ]
    codes, torch_mods = _run_no_torch(argvs)
    assert torch_mods == "[]"
    import ast

    codes = ast.literal_eval(codes)
    expected = []
    for b in files:
        bad = b.path.name in ("lit.ckpt", "evil.pt", "scripted.pt")  # TorchScript: torch.jit.load runs its code
        expected += [0, 0, 11 if bad else 0, 11 if bad else 0]
    assert codes == expected


def test_help_does_not_import_torch():
    codes, torch_mods = _run_no_torch(
        [["--help"], ["inspect", "--help"], ["scan", "--help"], ["strip-prefix", "--help"]]
    )
    assert torch_mods == "[]"
    assert codes == "[0, 0, 0, 0]"


def test_inspect_importtime_has_no_torch(ckpt):
    b = ckpt.plain()
    p = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "ckptfix", "inspect", str(b.path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr
    mods = [ln.rsplit("|", 1)[-1].strip() for ln in p.stderr.splitlines() if ln.startswith("import time:")]
    assert mods, p.stderr[:500]
    assert not [m for m in mods if m == "torch" or m.startswith("torch.")]


def test_cli_subprocess_inspect_scan(ckpt):
    b = ckpt.lightning()
    p = run_cli("inspect", "--json", b.path)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["stubbed_globals"] == ["argparse.Namespace"]
    p = run_cli("scan", b.path)
    assert p.returncode == 11
    assert "Traceback" not in p.stderr
