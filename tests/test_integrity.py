"""Issue 21 (integrity): no output shares storage with its input, no container member escapes its
directory, bounded cost on tiny hostile files, no exit 0 that dropped tensors.

Every hostile file is generated here at test time.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptfix.cli import main
from ckptfix.files import atomic

dcp = pytest.importorskip("torch.distributed.checkpoint")


def _save_dcp(d: Path, sd: dict[str, Any]) -> None:
    dcp.save(sd, checkpoint_id=str(d), no_dist=True)


def _load_dcp(d: Path, template: dict[str, Any]) -> dict[str, Any]:
    dcp.load(template, checkpoint_id=str(d), no_dist=True)
    return template


# --------------------------------------------------------------------------- item 2: no aliasing


@pytest.mark.parametrize(
    "argv",
    [
        ["strip-prefix"],
        ["add-prefix", "--prefix", "pre."],
    ],
)
def test_dcp_rename_never_shares_data_files(tmp_path, argv):
    """A torch save into the renamed directory must leave the input as it was (it truncated it through a link)."""
    src, out = tmp_path / "run.dcp", tmp_path / "out.dcp"
    w = torch.arange(64, dtype=torch.float32)
    _save_dcp(src, {"model": {"module.w": w.clone()}})
    assert main([argv[0], str(src), *argv[1:], "-o", str(out)]) == 0
    names = sorted(p.name for p in src.glob("*.distcp"))
    assert names
    for n in names:
        assert os.stat(src / n).st_ino != os.stat(out / n).st_ino
        assert (src / n).read_bytes() == (out / n).read_bytes()
    key = "module.w" if argv[0] == "add-prefix" else "w"
    key = "pre.module.w" if argv[0] == "add-prefix" else key
    _save_dcp(out, {"model": {key: torch.full((64,), 7.0)}})  # the user fine-tunes and saves into the output
    got = _load_dcp(src, {"model": {"module.w": torch.zeros(64)}})["model"]["module.w"]
    assert torch.equal(got, w)


def test_dcp_rename_link_is_opt_in_and_says_the_risk(tmp_path, capsys):
    src, out = tmp_path / "run.dcp", tmp_path / "out.dcp"
    _save_dcp(src, {"model": {"module.w": torch.ones(8)}})
    assert main(["strip-prefix", str(src), "-o", str(out), "--link"]) == 0
    err = capsys.readouterr().err
    assert "hard-linked" in err and "do not save into the output" in err
    for f in src.glob("*.distcp"):
        assert os.stat(f).st_ino == os.stat(out / f.name).st_ino
    assert main(["strip-prefix", "--help"]) == 0
    assert "changes the input" in " ".join(capsys.readouterr().out.split())


def test_no_os_link_outside_backups():
    """Every os.link in the package is either a backup of a file about to be replaced, or behind --link."""
    root = Path(__file__).resolve().parents[1] / "ckptfix"
    hits = []
    for p in root.rglob("*.py"):
        for line in p.read_text().splitlines():
            if "os.link(" in line:
                hits.append(f"{p.relative_to(root)}:{line.strip()}")
    allowed = {"files/atomic.py", "ops/rewrite/dcp.py"}
    assert all(h.split(":")[0] in allowed for h in hits), hits
    assert len(hits) == 3, hits


def _data(n: int) -> bytes:
    return bytes(range(256)) * (n // 256) + b"x" * (n % 256)


def test_copy_file_data_copies(tmp_path):
    src, dst = tmp_path / "a", tmp_path / "b"
    src.write_bytes(_data(3 << 20))
    os.chmod(src, 0o640)
    atomic.copy_file_data(str(src), str(dst), fsync=True)
    assert dst.read_bytes() == src.read_bytes()
    assert os.stat(src).st_ino != os.stat(dst).st_ino
    assert os.stat(dst).st_mode & 0o777 == 0o640
    with pytest.raises(FileExistsError):
        atomic.copy_file_data(str(src), str(dst))
    empty = tmp_path / "e"
    empty.write_bytes(b"")
    atomic.copy_file_data(str(empty), str(tmp_path / "e2"))
    assert (tmp_path / "e2").read_bytes() == b""


@pytest.mark.parametrize("broken", ["cfr", "cfr+sendfile"])
def test_copy_file_data_falls_back_per_call(tmp_path, monkeypatch, broken):
    src, dst = tmp_path / "a", tmp_path / "b"
    src.write_bytes(_data((1 << 20) + 17))
    from ckptfix.files import fileio

    monkeypatch.setattr(fileio, "reflink_range", lambda *a: False)
    monkeypatch.setattr(fileio, "STEP", 1 << 16)
    calls = {"cfr": 0}
    real_cfr = os.copy_file_range

    def cfr(*a: Any) -> int:  # works for the first call, then the file system says EXDEV
        calls["cfr"] += 1
        if calls["cfr"] > 1:
            raise OSError(errno.EXDEV, "cross-device")
        return real_cfr(*a)

    monkeypatch.setattr(os, "copy_file_range", cfr)
    if "sendfile" in broken:

        def sf(*a: Any) -> int:
            raise OSError(errno.EINVAL, "no sendfile")

        monkeypatch.setattr(os, "sendfile", sf)
    atomic.copy_file_data(str(src), str(dst))
    assert dst.read_bytes() == src.read_bytes()


# --------------------------------------------------------------------------- item 6: symlinks out of a DCP directory


def _dcp_with_outside_link(tmp_path: Path, member: str) -> Path:
    d = tmp_path / "run.dcp"
    _save_dcp(d, {"model": {"module.w": torch.ones(16)}})
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    name = member if member == ".metadata" else sorted(p.name for p in d.glob("*.distcp"))[0]
    (d / name).rename(outside / name)
    (d / name).symlink_to(outside / name)
    return d


@pytest.mark.parametrize("member", [".metadata", "distcp"])
@pytest.mark.parametrize(
    "argv",
    [["inspect"], ["scan"], ["strip-prefix", "-o", "{out}"], ["convert", "-o", "{out}.safetensors"]],
)
def test_dcp_member_linking_outside_is_refused(tmp_path, capsys, member, argv):
    d = _dcp_with_outside_link(tmp_path, member)
    out = str(tmp_path / "out")
    rc = main([argv[0], str(d), *(a.format(out=out) for a in argv[1:])])
    err = capsys.readouterr().err
    assert rc == 8, err
    assert "outside the checkpoint directory" in err and "Traceback" not in err
    assert not os.path.exists(out) and not os.path.exists(out + ".safetensors")


def test_dcp_member_linking_inside_is_fine_and_copied_as_a_file(tmp_path):
    d = tmp_path / "run.dcp"
    _save_dcp(d, {"model": {"module.w": torch.ones(16)}})
    name = sorted(p.name for p in d.glob("*.distcp"))[0]
    (d / name).rename(d / "real.bin")
    (d / name).symlink_to("real.bin")
    out = tmp_path / "out.dcp"
    assert main(["strip-prefix", str(d), "-o", str(out)]) == 0
    assert not (out / name).is_symlink()
    assert (out / name).read_bytes() == (d / "real.bin").read_bytes()


def test_dcp_rename_refuses_a_stray_file_linking_outside(tmp_path, capsys):
    d = tmp_path / "run.dcp"
    _save_dcp(d, {"model": {"module.w": torch.ones(16)}})
    secret = tmp_path / "secret.txt"
    secret.write_text("private")
    (d / "notes.txt").symlink_to(secret)
    out = tmp_path / "out.dcp"
    assert main(["strip-prefix", str(d), "-o", str(out)]) == 8
    assert "outside the checkpoint directory" in capsys.readouterr().err
    assert not out.exists()


# --------------------------------------------------------------------------- item 3: shared-reference DAG bomb


def _dag(levels: int) -> Any:
    x: Any = [1]
    for _ in range(levels):
        x = [x, x]  # the pickler memoizes x: the file stays tiny, a naive walk expands 2**levels
    return x


def _dag_file(tmp_path: Path, levels: int, where: str) -> Path:
    x = _dag(levels)
    if where == "extra":
        obj = {"model": {"w": torch.zeros(4)}, "extra": x}
    else:
        obj = {
            "model": {"w": torch.zeros(4)},
            "optimizer": {"state": {0: {"step": x}}, "param_groups": [{"params": [0], "lr": 0.1}]},
        }
    p = tmp_path / f"dag_{where}_{levels}.pt"
    torch.save(obj, p)
    assert p.stat().st_size < 4096
    return p


@pytest.mark.parametrize("where", ["extra", "optimizer"])
def test_dag_bomb_refused_quickly_by_convert(tmp_path, where):
    from helpers import assert_one_line_error, run_cli

    p = _dag_file(tmp_path, 40, where)
    out = tmp_path / "x.safetensors"
    r = run_cli("convert", str(p), "-o", str(out), "--include-optimizer", timeout=60)
    assert_one_line_error(r, 12)
    assert "CKPTFIX_MAX_PICKLE_ITEMS" in r.stderr
    assert not out.exists()
    for argv in (["inspect", str(p)], ["scan", str(p)], ["sanitize", str(p), "-o", str(tmp_path / "s.pt")]):
        assert run_cli(*argv, timeout=60).returncode == 0


def test_shared_extras_below_the_budget_are_written_whole(tmp_path):
    """Sharing is rendered once and repeated in the JSON: the same output as before, in linear time."""
    import json

    from safetensors import safe_open

    from ckptfix.ops.convert import convert

    p = _dag_file(tmp_path, 10, "extra")
    out = tmp_path / "x.safetensors"
    convert(p, out)
    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
    blob = next(v for v in meta.values() if "extra" in v)
    extra = json.loads(blob)
    node = extra["extra"] if "extra" in extra else extra
    for _ in range(10):
        assert len(node) == 2 and node[0] == node[1]
        node = node[0]
    assert node == [1]


def test_extras_node_budget_is_the_items_limit(tmp_path, monkeypatch):
    from ckptfix.errors import ResourceLimitError
    from ckptfix.ops.convert import convert

    p = _dag_file(tmp_path, 12, "extra")  # 2**13 values in the JSON
    monkeypatch.setenv("CKPTFIX_MAX_PICKLE_ITEMS", "4000")
    with pytest.raises(ResourceLimitError, match="CKPTFIX_MAX_PICKLE_ITEMS"):
        convert(p, tmp_path / "a.safetensors")
    monkeypatch.setenv("CKPTFIX_MAX_PICKLE_ITEMS", "20000")
    convert(p, tmp_path / "b.safetensors")


# --------------------------------------------------------------------------- item 4: no-op opcode zip bomb

_NOOPS = {
    "proto": b"\x80\x02",
    "mark_pop_mark": b"(1",
    "none_pop": b"N0",
    "empty_frame": b"\x95" + bytes(8),
    "put_over": b"N\x94q\x000",  # NONE MEMOIZE, BINPUT 0 over the filled slot, POP
    "empty_appends": b"](e0",  # EMPTY_LIST MARK APPENDS (nothing) POP
    "mix": b"\x80\x02(1N0",
}


def _noop_zip(tmp_path: Path, kind: str, nbytes: int) -> Path:
    """A real torch zip whose deflated data.pkl starts with ``nbytes`` of opcodes that build nothing."""
    import io
    import zipfile

    buf = io.BytesIO()
    torch.save({"w": torch.arange(4.0)}, buf)
    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    unit = _NOOPS[kind]
    p = tmp_path / f"noop_{kind}.pt"
    with zipfile.ZipFile(p, "w") as z:
        for info in src.infolist():
            data = src.read(info.filename)
            if info.filename.endswith("data.pkl"):
                if kind == "put_over":  # the first MEMOIZE fills slot 0; every later BINPUT 0 overwrites it
                    data = data[:2] + b"N\x940" + unit * (nbytes // len(unit)) + data[2:]
                else:
                    data = data[:2] + unit * (nbytes // len(unit)) + data[2:]
                z.writestr(info.filename, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
            else:
                z.writestr(info, data)
    return p


@pytest.mark.parametrize("kind", sorted(_NOOPS))
def test_noop_opcode_bomb_is_refused_at_once(tmp_path, capsys, kind):
    p = _noop_zip(tmp_path, kind, 4 << 20)
    assert p.stat().st_size < 200_000
    for argv in (["inspect", str(p)], ["convert", str(p), "-o", str(tmp_path / "o.safetensors")]):
        rc = main(argv)
        err = capsys.readouterr().err
        assert rc == 12, (kind, argv, err)
        assert "CKPTFIX_MAX_PICKLE_IDLE" in err and "building nothing" in err
    assert main(["scan", str(p)]) == 11  # never "safe": the rest of the pickle was not checked
    out = capsys.readouterr().out
    assert "scan stopped" in out and "CKPTFIX_MAX_PICKLE_IDLE" in out


def test_noop_budget_lifted_by_its_variable(tmp_path, monkeypatch, capsys):
    p = _noop_zip(tmp_path, "mix", 600_000)
    assert main(["inspect", str(p)]) == 12
    capsys.readouterr()
    monkeypatch.setenv("CKPTFIX_MAX_PICKLE_IDLE", "1000000")
    assert main(["inspect", str(p)]) == 0
    assert "w" in capsys.readouterr().out


def test_real_pickles_spend_no_idle_opcodes():
    """torch.save (protocol 2) and protocol-4/5 framed pickles stay far below the idle allowance."""
    import io
    import pickle

    from ckptfix.pickles.opcodes import PickleLimits, scan_globals

    tight = PickleLimits(max_idle=2)
    buf = io.BytesIO()
    sd = {f"layer{i}.weight": torch.zeros(3) for i in range(300)}
    torch.save({"model": sd, "opt": {"state": {}, "param_groups": [{"params": list(range(300))}]}}, buf)
    import zipfile

    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        pkl = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    assert scan_globals(pkl, limits=tight, strict_limits=True).limit_error is None
    rec: list = []
    rec.append((rec, rec))  # a recursive tuple: the pickler writes POP / POP_MARK for it
    for proto in (4, 5):
        big = pickle.dumps({"s": ["x" * 100] * 5000, "n": list(range(100_000)), "r": rec}, protocol=proto)
        assert scan_globals(big, limits=tight, strict_limits=True).limit_error is None


# --------------------------------------------------------------------------- item 9: ZeRO-3 placeholders


def _zero3_model_states(d: Path, *, frozen_real: bool = False) -> Path:
    """What DeepSpeed ZeRO-3 writes as ``zero_pp_rank_0_mp_rank_00_model_states.pt``: empty parameters."""
    from collections import OrderedDict

    d.mkdir(parents=True, exist_ok=True)
    shapes = OrderedDict([("fc.weight", torch.Size([4, 8])), ("fc.bias", torch.Size([4]))])
    module = OrderedDict([("fc.weight", torch.empty(0)), ("fc.bias", torch.empty(0))])
    module["norm.running_mean"] = torch.zeros(4)  # buffers are saved whole
    p = d / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    torch.save(
        {
            "module": module,
            "buffer_names": ["norm.running_mean"],
            "param_shapes": [shapes],
            "frozen_param_shapes": None,
            "optimizer": None,
            "lr_scheduler": None,
            "global_steps": 10,
            "dp_world_size": 2,
            "mp_world_size": 1,
            "ds_config": {"zero_optimization": {"stage": 3}},
            "ds_version": "0.14.0",
        },
        p,
    )
    return p


def test_zero3_placeholders_inspect_warns(tmp_path, capsys):
    p = _zero3_model_states(tmp_path / "global_step10")
    assert main(["inspect", str(p)]) == 0
    cap = capsys.readouterr()
    assert "empty placeholders" in cap.out and "warning:" in cap.err
    assert f"ckptfix convert {tmp_path / 'global_step10'} -o model.safetensors" in cap.err
    from ckptfix.ops.inspect import inspect_checkpoint

    assert any(n.startswith("WARNING: 2 of 3 tensor(s)") for n in inspect_checkpoint(p).notes)


@pytest.mark.parametrize(
    "argv",
    [
        ["convert", "-o", "{out}.safetensors"],
        ["strip-prefix", "--prefix", "fc.", "-o", "{out}.pt"],
        ["add-prefix", "--prefix", "module.", "-o", "{out}.pt"],
    ],
)
def test_zero3_placeholders_refused_with_the_consolidating_command(tmp_path, capsys, argv):
    p = _zero3_model_states(tmp_path / "global_step10")
    out = str(tmp_path / "out")
    rc = main([argv[0], str(p), *(a.format(out=out) for a in argv[1:])])
    err = capsys.readouterr().err
    assert rc == 17, err
    assert "param_shapes records [4, 8]" in err
    assert f"ckptfix convert {tmp_path / 'global_step10'} -o model.safetensors" in err
    assert not list(tmp_path.glob("out*"))


def test_empty_tensors_without_recorded_shapes_are_fine(tmp_path):
    """A genuinely empty parameter (no param_shapes saying otherwise) converts as before."""
    from ckptfix.ops.convert import convert

    p = tmp_path / "empty.pt"
    torch.save({"w": torch.empty(0), "b": torch.ones(2)}, p)
    convert(p, tmp_path / "e.safetensors")
    from ckptfix.pickles.placeholders import empty_placeholders

    assert empty_placeholders({"param_shapes": [{"w": torch.Size([0, 3])}]}, {"w": torch.empty(0)}) == []


# --------------------------------------------------------------------------- item 8: no exit 0 that dropped tensors


def _quantized_state_dict(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    import warnings

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = torch.ao.quantization.quantize_dynamic(m, {torch.nn.Linear}, dtype=torch.qint8)
    sd = q.state_dict()
    p = tmp_path / "quantized.pt"
    torch.save(sd, p)
    return p, sd


def test_quantized_packed_params_refused_not_dropped(tmp_path, capsys):
    p, _ = _quantized_state_dict(tmp_path)
    out = tmp_path / "q.safetensors"
    rc = main(["convert", str(p), "-o", str(out)])
    err = capsys.readouterr().err
    assert rc == 8, err
    assert "0._packed_params._packed_params.0" in err and "quantized" in err and "--drop" in err
    assert "Traceback" not in err and not out.exists()


def test_quantized_dropped_on_request_is_reported(tmp_path, capsys):
    import json

    p, _ = _quantized_state_dict(tmp_path)
    out = tmp_path / "q.safetensors"
    assert main(["convert", str(p), "-o", str(out), "--drop", "*_packed_params*", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert sorted(doc["dropped"]) == [f"{i}._packed_params._packed_params.{j}" for i in (0, 2) for j in (0, 1)]


def test_tensor_outside_the_state_dict_excluded_and_named_strict_refuses(tmp_path):
    from ckptfix.errors import UnsupportedError
    from ckptfix.ops.convert import convert

    p = tmp_path / "ema.pt"
    torch.save({"model": {"w": torch.ones(2)}, "extra": {"shadow": [torch.zeros(3)]}, "epoch": 1}, p)
    r = convert(p, tmp_path / "a.safetensors")  # issue 34 A: the output is the state dict; the rest is named
    assert r.tensors == 1 and r.dropped == [] and r.excluded == ["extra"] and r.excluded_tensors == {"extra": 1}
    assert "extra.shadow.0" not in r.skipped
    with pytest.raises(UnsupportedError, match=r"extra\.shadow\.0.*--strict"):
        convert(p, tmp_path / "s.safetensors", strict=True)
    assert not (tmp_path / "s.safetensors").exists()
    r = convert(p, tmp_path / "b.safetensors", drop=["extra"], strict=True)
    assert r.dropped == ["extra.shadow.0"] and r.tensors == 1
    r = convert(p, tmp_path / "c.safetensors", key="model")  # an explicit entry: the rest excluded, not "dropped"
    assert r.dropped == [] and r.excluded == ["extra"]


def test_tensor_under_a_tuple_key_is_counted(tmp_path):
    from ckptfix.errors import UnsupportedError
    from ckptfix.ops.convert import convert

    p = tmp_path / "tk.pt"
    torch.save({"model": {"w": torch.ones(2)}, "cache": {(1, 2): torch.zeros(3)}}, p)
    assert convert(p, tmp_path / "a.safetensors").excluded_tensors == {"cache": 1}
    with pytest.raises(UnsupportedError, match="missing from the output"):
        convert(p, tmp_path / "b.safetensors", strict=True)


def test_drop_leaves_out_state_dict_tensors_by_pattern(tmp_path):
    from safetensors.torch import load_file

    from ckptfix.ops.convert import convert

    p = tmp_path / "sd.pt"
    torch.save({"a.weight": torch.ones(2), "a.bias": torch.ones(1), "b.weight": torch.zeros(2)}, p)
    r = convert(p, tmp_path / "o.safetensors", drop=["a"])
    assert sorted(r.dropped) == ["a.bias", "a.weight"]
    assert set(load_file(tmp_path / "o.safetensors")) == {"b.weight"}


def test_dcp_convert_excludes_tensor_entries_outside_the_state_dict(tmp_path, capsys):
    from safetensors.torch import load_file

    d = tmp_path / "run.dcp"
    _save_dcp(d, {"model": {"w": torch.ones(4)}, "ema": {"w": torch.zeros(4)}, "epoch": 3})
    out = tmp_path / "m.safetensors"
    assert main(["convert", str(d), "-o", str(out), "--strict"]) == 8
    assert "ema.w" in capsys.readouterr().err and not out.exists()
    assert main(["convert", str(d), "-o", str(out)]) == 0
    assert "excluded: ema (1 tensor: --key ema converts the EMA weights)" in capsys.readouterr().err
    assert set(load_file(out)) == {"w"}


@pytest.mark.parametrize("member", [".metadata", "distcp"])
def test_dcp_member_linking_outside_is_refused_by_load_anywhere(tmp_path, member):
    from ckptfix import load_anywhere
    from ckptfix.errors import UnsupportedError

    d = _dcp_with_outside_link(tmp_path, member)
    with pytest.raises(UnsupportedError, match="outside the checkpoint directory"):
        load_anywhere(d)


def test_link_is_refused_for_single_files(tmp_path, capsys):
    p = tmp_path / "m.pt"
    torch.save({"module.w": torch.ones(2)}, p)
    assert main(["strip-prefix", str(p), "--link", "-o", str(tmp_path / "o.pt")]) == 8
    assert "DCP directories only" in capsys.readouterr().err


# --------------------------------------------------------------------------- from the second adversarial pass


@pytest.mark.parametrize("extra", ["tensor_key", "tuple_key"])
def test_tensor_used_as_a_dict_key_is_not_dropped_behind_exit_0(tmp_path, capsys, extra):
    t = torch.arange(3)
    key = t if extra == "tensor_key" else (1, t)
    src = tmp_path / "k.pt"
    torch.save({"w": torch.ones(2), "m": {key: 1}}, src)
    out = tmp_path / "k.safetensors"
    assert main(["convert", str(src), "-o", str(out)]) == 8
    assert "would be missing" in capsys.readouterr().err and not out.exists()


def test_force_never_replaces_a_file_the_input_is_made_of(tmp_path, capsys):
    from safetensors.torch import save_file

    d = tmp_path / "sharded"
    d.mkdir()
    save_file({"a": torch.ones(2)}, str(d / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.zeros(2)}, str(d / "model-00002-of-00002.safetensors"))
    index = {
        "metadata": {},
        "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"},
    }
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    for src in (d, d / "model.safetensors.index.json"):
        for target in ("model-00002-of-00002.safetensors", "model.safetensors.index.json"):
            assert main(["convert", str(src), "-o", str(d / target), "--force"]) == 9
            assert "Error" not in capsys.readouterr().out
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before


def _legacy_with_payload_first(tmp_path: Path) -> Path:
    import io
    import pickle

    plain = tmp_path / "plain.pt"
    torch.save({"w": torch.ones(3)}, plain, _use_new_zipfile_serialization=False)
    data = plain.read_bytes()
    f = io.BytesIO(data)
    pickle.Unpickler(f).load()  # the magic number's pickle
    magic, rest = data[: f.tell()], data[f.tell() :]
    # os.system('true'), its result popped, then the real magic number: torch runs it and reads on
    payload = b"cos\nsystem\n(S'true'\ntR0"
    hostile = tmp_path / "legacy_payload_in_magic.pt"
    hostile.write_bytes(magic[:2] + payload + magic[2:] + rest)
    return hostile


def test_inspect_and_sanitize_see_a_payload_in_a_legacy_header_pickle(tmp_path, capsys):
    src = _legacy_with_payload_first(tmp_path)
    before = src.read_bytes()
    assert main(["inspect", str(src)]) == 0
    assert "weights_only  FAILS" in capsys.readouterr().out
    out = tmp_path / "clean.pt"
    assert main(["sanitize", str(src), "-o", str(out)]) == 0  # written without the header pickles
    assert torch.load(out, weights_only=True)["w"].equal(torch.ones(3))
    assert src.read_bytes() == before


def _st_pickle_polyglot(path: Path) -> None:
    """A valid safetensors file that is also a protocol-0 pickle calling os.system (the second adversarial pass's
    construction): bytes 0..7 are LONG1 over the length field, the JSON swallows itself, the data is the payload."""
    import struct

    pl = b"cos\nsystem\n(Vtrue\ntR."
    n = 0x8A + 8 * 256

    def js(pad: int) -> str:
        return '{"0V%s":{"dtype":"U8","shape":[%d],"data_offsets":[0,%d]\n}}' % ("A" * pad, len(pl), len(pl))

    body = js(n - len(js(0)))
    assert len(body) == n
    data = bytes([0x8A, 8]) + b"\0" * 6 + body.encode() + pl
    assert struct.unpack("<Q", data[:8])[0] == n
    path.write_bytes(data)


def test_a_safetensors_pickle_polyglot_is_never_weights_only_ok(tmp_path, capsys):
    from safetensors.torch import load_file

    p = tmp_path / "poly.safetensors"
    _st_pickle_polyglot(p)
    assert (
        load_file(str(p))[
            "0V" + "A" * (0x8A + 8 * 256 - len('{"0V":{"dtype":"U8","shape":[21],"data_offsets":[0,21]\n}}'))
        ].numel()
        == 21
    )
    assert main(["inspect", str(p)]) == 0
    assert "weights_only  FAILS" in capsys.readouterr().out
    assert main(["scan", str(p)]) == 11
    assert main(["sanitize", str(p), "-o", str(tmp_path / "s.pt")]) == 8
    assert "polyglot" in capsys.readouterr().err


def test_a_zip_holding_a_second_archive_is_refused_as_torch_refuses_it(tmp_path, capsys):
    import io
    import zipfile

    buf = io.BytesIO()
    torch.save({"w": torch.ones(3)}, buf)
    p = tmp_path / "two.pt"
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as a, zipfile.ZipFile(p, "w") as z:
        for info in a.infolist():
            z.writestr(info, a.read(info))
        z.writestr("zzz/data.pkl", a.read(next(n for n in a.namelist() if n.endswith("/data.pkl"))))
    with pytest.raises(RuntimeError, match="not in a subdirectory"):
        torch.load(p, weights_only=True)
    assert main(["inspect", str(p)]) == 4
    assert "outside the archive folder" in capsys.readouterr().err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ulimit -v and sparse files")
def test_scan_of_a_file_larger_than_the_address_space_is_no_internal_error(tmp_path):
    p = tmp_path / "sparse.pt"
    with open(p, "wb") as f:
        f.write(b"\x80\x02")
        f.truncate(20 << 30)  # sparse: no disk used
    r = subprocess.run(
        ["bash", "-c", f'ulimit -v 3000000; exec "{sys.executable}" -m ckptfix scan "{p}"'],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
    )
    assert r.returncode in (4, 11, 12), r.stderr
    assert "internal error" not in r.stderr and "Traceback" not in r.stderr


def test_timm_style_ema_checkpoint_converts_and_the_report_words_are_true(tmp_path, capsys):
    """Issue 34 A: timm's last.pth.tar layout (state_dict, state_dict_ema, optimizer): exit 0, the rest named."""
    m = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    m(torch.ones(1, 3)).sum().backward()
    opt.step()
    ema = {k: v.clone() * 0.5 for k, v in m.state_dict().items()}
    p = tmp_path / "last.pth.tar"
    torch.save({"epoch": 3, "arch": "lin", "state_dict": m.state_dict(), "optimizer": opt.state_dict(),
                "state_dict_ema": ema, "metric": 0.5}, p)  # fmt: skip
    out = tmp_path / "a.safetensors"
    assert main(["convert", str(p), "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert "excluded: optimizer (--include-optimizer), state_dict_ema (2 tensors: --key state_dict_ema" in err
    out2 = tmp_path / "b.safetensors"
    assert main(["convert", str(p), "--key", "state_dict_ema", "-o", str(out2), "--json"]) == 0
    cap = capsys.readouterr()
    doc = json.loads(cap.out)
    assert doc["dropped"] == [] and doc["excluded_tensors"] == {"state_dict": 2} and doc["skipped"] == {}
    from safetensors.torch import load_file

    got = load_file(out2)
    assert all(torch.equal(got[k], v) for k, v in ema.items())
    assert main(["convert", str(p), "--key", "state_dict_ema", "-o", str(tmp_path / "c.safetensors"), "--force"]) == 0
    err = capsys.readouterr().err
    assert "--drop" not in err and "non-tensor" not in err
    assert main(["convert", str(p), "-o", str(tmp_path / "d.safetensors"), "--keep-all"]) == 8


def test_a_safetensors_header_length_that_opens_like_a_pickle_is_no_polyglot(tmp_path):
    """A header length whose low bytes are 0x80 0x02-0x05 (PROTO n) starts like a pickle, but the next byte
    (0x00) is no opcode: pickle.load fails before importing anything, so scan reports no second reading
    (a diffusers shard of header length 0x380 was called "also a pickle (a polyglot)")."""
    import pickle
    import struct

    from safetensors.torch import save_file

    from helpers import run_cli

    p = tmp_path / "shard.safetensors"
    for n in range(2000):
        save_file({"w": torch.zeros(2)}, str(p), metadata={"pad": "x" * n})
        hl = struct.unpack("<Q", p.read_bytes()[:8])[0]
        if hl & 0xFF == 0x80 and 2 <= (hl >> 8) & 0xFF <= 5:
            break
    else:
        pytest.fail("no padding gave such a header length")
    with pytest.raises(pickle.UnpicklingError):
        pickle.loads(p.read_bytes())  # the oracle: not a pickle
    r = run_cli("scan", str(p), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert not doc["pickles"] and not any("polyglot" in n for n in doc["notes"])
