"""Each entry point classifies its input once and passes the typed result down (issue #24, "data walks back and forth").

``ckptfix.formats.sniff`` is replaced, in every ckptfix module that holds it, by a counter per path: an entry
point may sniff its input exactly once (``classify`` at the entry), each file it reads of a sharded checkpoint
once, and nothing else.  A written output read back for verification is another file (not counted here).
"""

from __future__ import annotations

import collections
import os
import sys
import types
from pathlib import Path
from typing import Any, Callable

import pytest

import ckptfix.formats as formats
import ckptfix.ops.convert
import ckptfix.ops.inspect
import ckptfix.ops.load
import ckptfix.ops.rewrite.keys
import ckptfix.ops.sanitize
import ckptfix.ops.scan
from ckptfix.errors import CheckpointNotFoundError, OutputError, UnsupportedError
from ckptfix.formats import Format, Input, classify, classify_or_none, read_checkpoint
from ckptfix.ops.convert.report import ConvertReport

from helpers import CkptFactory, run_cli, tiny_model


class Sniffs(collections.Counter):
    """path (real) -> how many times ``sniff`` looked at it."""

    def of(self, path: str | os.PathLike) -> int:
        return self[os.path.realpath(path)]

    def others(self, *paths: str | os.PathLike) -> dict[str, int]:
        """Counts for paths other than ``paths`` and temporary outputs (``.ckptfix-*.tmp`` read back)."""
        skip = {os.path.realpath(p) for p in paths}
        return {p: n for p, n in self.items() if p not in skip and ".ckptfix-" not in os.path.basename(p)}


@pytest.fixture
def sniffs(monkeypatch: pytest.MonkeyPatch) -> Sniffs:
    real = formats.sniff
    calls = Sniffs()

    def counting(path: str) -> Format:
        calls[os.path.realpath(os.fspath(path))] += 1
        return real(path)

    patched = []
    for name, mod in list(sys.modules.items()):
        if name.startswith("ckptfix") and getattr(mod, "sniff", None) is real:
            monkeypatch.setattr(mod, "sniff", counting)
            patched.append(name)
    assert "ckptfix.formats" in patched
    return calls


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One read-only input of each kind (never modified: every output goes to the test's tmp_path)."""
    f = CkptFactory(tmp_path_factory.mktemp("classify_once"))
    return {
        "zip": f.dataparallel("dp.pt"),
        "legacy": f.dataparallel("dp_legacy.pt", legacy=True),
        "safetensors": f.safetensors("model.safetensors", prefix="module."),
        "sharded-bin": f.sharded_bin("hf_bin", prefix="module."),
        "sharded-st": f.sharded_safetensors("hf_st", prefix="module."),
        "dcp": f.dcp("dcp_ckpt"),
    }


FILES = ("zip", "legacy", "safetensors")
SHARDED = ("sharded-bin", "sharded-st")
ALL = FILES + SHARDED + ("dcp",)


def _check(sniffs: Sniffs, built: Any) -> None:
    """The input sniffed once; each shard of a sharded input at most once (safetensors' own reader opens the
    shards of a safetensors index converted back to .pth: none); nothing else."""
    assert sniffs.of(built.path) == 1, dict(sniffs)
    shards = [Path(built.extra["dir"]) / s for s in built.extra.get("shards", [])]
    for s in shards:
        assert sniffs.of(s) <= 1, (s, dict(sniffs))
    assert sniffs.others(built.path, *shards) == {}


def _out(tmp_path: Path, built: Any, suffix: str) -> str:
    """An output path in tmp_path (a directory for sharded/DCP rewrites)."""
    if suffix == "same":
        suffix = "" if "shards" in built.extra or os.path.isdir(built.path) else os.path.splitext(built.path)[1]
    return str(tmp_path / f"out{suffix}")


#: the keys of the model the inputs were saved from (align's target)
MODEL_KEYS = list(tiny_model().state_dict())

ENTRIES: dict[str, tuple[tuple[str, ...], Callable[[str, str], Any], str]] = {
    # name: (input kinds, call(src, out), output suffix)
    "convert": (ALL, lambda s, o: ckptfix.ops.convert.convert(s, o), ".safetensors"),
    "convert-to-pt": (("safetensors", "sharded-st"), lambda s, o: ckptfix.ops.convert.convert(s, o), ".pt"),
    "convert-to-dcp": (("safetensors", "sharded-st"), lambda s, o: ckptfix.ops.convert.convert(s, o), ".dcp"),
    "convert-to-pt-explicit": (("safetensors",), lambda s, o: ckptfix.ops.convert.convert(s, o, to="pt"), ".pth"),
    "inspect": (FILES + ("dcp",), lambda s, o: ckptfix.ops.inspect.inspect_checkpoint(s), ""),
    "scan": (ALL, lambda s, o: ckptfix.ops.scan.scan_checkpoint(s), ""),
    "load_checkpoint": (ALL, lambda s, o: ckptfix.ops.load.load_checkpoint(s), ""),
    "strip-prefix": (ALL, lambda s, o: ckptfix.ops.rewrite.keys.strip_prefix_checkpoint(s, output=o), "same"),
    "add-prefix": (
        FILES + SHARDED,
        lambda s, o: ckptfix.ops.rewrite.keys.add_prefix_checkpoint(s, "x.", output=o),
        "same",
    ),
    "align": (
        FILES,
        lambda s, o: ckptfix.ops.rewrite.keys.align_checkpoint(s, MODEL_KEYS, output=o),
        "same",
    ),
    "sanitize": (("zip", "legacy"), lambda s, o: ckptfix.ops.sanitize.sanitize_checkpoint(s, o, force=True), ".pt"),
}

CASES = [pytest.param(entry, kind, id=f"{entry}-{kind}") for entry, (kinds, _, _) in ENTRIES.items() for kind in kinds]


@pytest.mark.parametrize("entry,kind", CASES)
def test_each_entry_point_sniffs_its_input_once(
    entry: str, kind: str, inputs: dict[str, Any], sniffs: Sniffs, tmp_path: Path
) -> None:
    kinds, call, suffix = ENTRIES[entry]
    built = inputs[kind]
    call(str(built.path), _out(tmp_path, built, suffix))
    _check(sniffs, built)


@pytest.mark.parametrize(
    "argv",
    [
        ("convert", "{src}", "-o", "{tmp}/o.safetensors"),
        ("inspect", "{src}"),
        ("scan", "{src}"),
        ("strip-prefix", "{src}", "-o", "{tmp}/o.pt"),
        ("sanitize", "{src}", "-o", "{tmp}/o.pt"),
    ],
    ids=lambda a: a[0],
)
def test_each_command_sniffs_its_input_once(
    argv: tuple[str, ...], inputs: dict[str, Any], sniffs: Sniffs, tmp_path: Path
) -> None:
    """The commands make one library call each: the input is classified once, in it."""
    built = inputs["zip"]
    r = run_cli(*(a.format(src=built.path, tmp=tmp_path) for a in argv), isolated=False)
    assert r.returncode == 0, r.stderr
    _check(sniffs, built)


@pytest.mark.parametrize("kind", SHARDED)
def test_inspect_of_a_sharded_checkpoint_sniffs_each_file_once_per_pass(
    kind: str, inputs: dict[str, Any], sniffs: Sniffs
) -> None:
    """inspect reads the shards (the reader) and scans their pickles (the weights-only verdict): the index
    is sniffed once, each shard once by each pass over it."""
    built = inputs[kind]
    ckptfix.ops.inspect.inspect_checkpoint(str(built.path))
    assert sniffs.of(built.path) == 1, dict(sniffs)
    for s in built.extra["shards"]:
        assert sniffs.of(Path(built.extra["dir"]) / s) <= 2, dict(sniffs)


def test_an_input_passed_down_is_never_sniffed(inputs: dict[str, Any], sniffs: Sniffs, tmp_path: Path) -> None:
    """A caller that classified already passes the Input: no entry point sniffs it again."""
    inp = classify(str(inputs["zip"].path))
    assert sniffs.of(inp.path) == 1
    read_checkpoint(inp)
    ckptfix.ops.inspect.inspect_checkpoint(inp)
    ckptfix.ops.scan.scan_checkpoint(inp)
    ckptfix.ops.load.load_checkpoint(inp)
    ckptfix.ops.convert.convert(inp, str(tmp_path / "a.safetensors"))
    ckptfix.ops.rewrite.keys.strip_prefix_checkpoint(inp, output=str(tmp_path / "a.pt"))
    ckptfix.ops.sanitize.sanitize_checkpoint(inp, str(tmp_path / "b.pt"))
    assert sniffs.of(inp.path) == 1, dict(sniffs)


def test_input_is_a_path(inputs: dict[str, Any]) -> None:
    p = str(inputs["zip"].path)
    inp = classify(p)
    assert inp == Input(p, Format.TORCH_ZIP, os.path.getsize(p))
    assert os.fspath(inp) == str(inp) == p and f"{inp}: x" == f"{p}: x"
    assert classify(inp) is inp
    assert read_checkpoint(p).input == inp
    d = classify(str(inputs["dcp"].path))
    assert d.format == Format.DCP and d.size is None
    s = classify(str(inputs["sharded-st"].path))
    assert s.format == Format.SHARDED and s.size is None


def test_read_checkpoint_takes_the_format_it_is_told(inputs: dict[str, Any], sniffs: Sniffs) -> None:
    p = str(inputs["safetensors"].path)
    assert read_checkpoint(p, Format.SAFETENSORS).format == Format.SAFETENSORS
    assert sniffs.of(p) == 0


def test_errors_are_unchanged_by_the_router(tmp_path: Path, inputs: dict[str, Any], sniffs: Sniffs) -> None:
    """convert classifies first but reports a bad input where its entry point did: after its own checks."""
    missing = str(tmp_path / "missing.pt")
    assert classify_or_none(missing) is None
    sniffs.clear()
    with pytest.raises(CheckpointNotFoundError, match="no such file"):
        ckptfix.ops.convert.convert(missing, str(tmp_path / "o.safetensors"))
    assert sniffs.of(missing) == 2  # the router's classification, and the entry point's, which reports it
    taken = tmp_path / "taken.safetensors"
    taken.write_bytes(b"x")
    with pytest.raises(OutputError):  # the existing output is reported first, as before
        ckptfix.ops.convert.convert(missing, str(taken))
    with pytest.raises(UnsupportedError, match="not a safetensors file"):
        ckptfix.ops.convert.convert(str(inputs["zip"].path), str(tmp_path / "o.pt"), to="pt")


# --------------------------------------------------------------------------- the registry is the one place


def test_rewrite_convert_and_sanitize_route_through_the_registry(
    inputs: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replacing a format's entry changes what the entry point does for it: the routers hold no format branch."""
    from ckptfix.formats.registry import FORMATS, Refused

    seen: list[tuple[str, Any]] = []

    def fake(name: str) -> Callable[..., Any]:
        def entry(*args: Any, **kw: Any) -> Any:
            seen.append((name, args[0]))
            return ConvertReport(source=name, outputs=[]) if name == "convert" else name

        return entry

    entries = types.ModuleType("fake_entries")  # the entries name "module:function", imported at dispatch
    for name in ("rewrite", "convert", "sanitize"):
        setattr(entries, name, fake(name))
    monkeypatch.setitem(sys.modules, "fake_entries", entries)
    monkeypatch.setattr(FORMATS[Format.TORCH_ZIP], "rewrite", "fake_entries:rewrite")
    monkeypatch.setattr(FORMATS[Format.DCP], "convert", "fake_entries:convert")
    monkeypatch.setattr(FORMATS[Format.TORCH_LEGACY], "sanitize", "fake_entries:sanitize")
    zp, dcp, legacy = (str(inputs[k].path) for k in ("zip", "dcp", "legacy"))
    assert ckptfix.ops.rewrite.keys.strip_prefix_checkpoint(zp, output=str(tmp_path / "a.pt")) == "rewrite"
    ckptfix.ops.convert.convert_to_safetensors(dcp, str(tmp_path / "d.safetensors"))  # a framework folder's report
    assert ckptfix.ops.sanitize.sanitize_checkpoint(legacy, str(tmp_path / "l.pt")) == "sanitize"
    assert seen[0] == ("rewrite", classify(zp)) and seen[1] == ("convert", dcp) and seen[2][0] == "sanitize"
    monkeypatch.setattr(FORMATS[Format.TORCH_ZIP], "sanitize", Refused(lambda p: f"{p}: refused here; do X"))
    with pytest.raises(UnsupportedError, match=r"refused here; do X$"):
        ckptfix.ops.sanitize.sanitize_checkpoint(zp, str(tmp_path / "z.pt"))
    assert not (tmp_path / "z.pt").exists()


@pytest.mark.parametrize(
    "kind,message",
    [
        ("sharded-bin", "sharded checkpoints cannot be sanitized; sanitize a single torch.save file"),
        ("dcp", "dcp checkpoints cannot be sanitized; sanitize a single torch.save file"),
        ("safetensors", "a safetensors file holds no pickle; it already loads without weights_only concerns"),
    ],
)
def test_sanitize_refusals_name_the_input_as_given(
    kind: str, message: str, inputs: dict[str, Any], tmp_path: Path
) -> None:
    src = str(inputs[kind].extra.get("dir", inputs[kind].path))  # a sharded checkpoint by its folder
    with pytest.raises(UnsupportedError) as e:
        ckptfix.ops.sanitize.sanitize_checkpoint(src, str(tmp_path / "o.pt"))
    assert str(e.value).startswith(f"{src}: {message}")
