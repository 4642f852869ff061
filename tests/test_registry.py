"""The format registry (ckptfix.formats.registry): every format has every capability, or refuses it.

Also a Trainer output_dir's checkpoint-N/ sub-folders in sniff's "pass one of them" message, reached from the
entry points in a fresh interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import types
from pathlib import Path

import pytest

from ckptfix.errors import UnsupportedError
from ckptfix.formats import Format, package_message, read_checkpoint, sniff, tar_message
from ckptfix.formats.registry import CAPABILITIES, FORMATS, Refused, dispatch, missing, resolve

ROOT = Path(__file__).resolve().parents[1]
FW = ROOT / "tests" / "fixtures" / "frameworks"


def test_every_format_has_one_entry():
    assert set(FORMATS) == set(Format)
    assert all(spec.format == fmt and spec.what for fmt, spec in FORMATS.items())


def test_every_capability_is_implemented_or_refused():
    assert missing() == [], 'name each a function ("module:function") or a Refused in registry.FORMATS'
    for fmt, spec in FORMATS.items():
        for cap in CAPABILITIES:
            entry = spec.get(cap)
            assert isinstance(entry, (str, Refused)), (fmt, cap, entry)
            if isinstance(entry, str):  # names a function that exists
                assert callable(resolve(entry)), (fmt, cap, entry)
            if isinstance(entry, Refused):  # a refusal says why and what to do instead, for the path
                msg = entry.message("x.pt")
                assert msg.startswith("x.pt: ") and "\n" not in msg and ";" in msg, (fmt, cap, msg)


def test_what_is_refused():
    refused = {(f.value, c) for f, s in FORMATS.items() for c in CAPABILITIES if isinstance(s.get(c), Refused)}
    assert refused == {
        ("torch-tar", "read"),
        ("torch-tar", "convert"),
        ("torch-tar", "rewrite"),
        ("torch-package", "read"),
        ("torch-package", "load"),
        ("torch-package", "convert"),
        ("torch-package", "rewrite"),
        ("torchscript", "rewrite"),
        ("pickle", "rewrite"),
        ("torch-tar", "sanitize"),
        ("torch-package", "sanitize"),
        ("torchscript", "sanitize"),
        ("sharded", "sanitize"),
        ("dcp", "sanitize"),
        ("pickle", "sanitize"),
    }


def test_the_rewrite_entries_are_the_routing_of_rewrite():
    import ckptfix.ops.rewrite as rw
    from ckptfix.ops.rewrite.writers import WRITABLE, check_writable

    for fmt in WRITABLE:
        assert dispatch(fmt, "rewrite", "x") is rw.rewrite_file
    assert dispatch(Format.SHARDED, "rewrite", "x") is rw.rewrite_index
    assert dispatch(Format.DCP, "rewrite", "x") is rw.rewrite_directory
    for fmt in (Format.TORCHSCRIPT, Format.PICKLE):  # the refusal is check_writable's own message
        entry = FORMATS[fmt].rewrite
        assert isinstance(entry, Refused)
        with pytest.raises(UnsupportedError) as e:
            check_writable(types.SimpleNamespace(format=fmt, path="x.pt"))  # type: ignore[arg-type]
        assert str(e.value) == entry.message("x.pt")


def test_the_convert_entries_are_the_routing_of_convert():
    from ckptfix.ops.convert.dcp_in import convert_dcp
    from ckptfix.ops.convert.forward import convert_to_safetensors

    assert dispatch(Format.DCP, "convert", "d") is convert_dcp
    readable = [f for f in Format if isinstance(FORMATS[f].read, str) and f != Format.DCP]
    assert all(dispatch(f, "convert", "x") is convert_to_safetensors for f in readable)
    for fmt in Format:  # what cannot be read cannot be converted, with the same message
        if isinstance(FORMATS[fmt].read, Refused):
            assert FORMATS[fmt].convert == FORMATS[fmt].read


def test_refusals_are_the_formats_messages(tmp_path):
    p = tmp_path / "old.pt"
    with tarfile.open(p, "w") as tar:
        for name in ("sys_info", "pickle", "storages", "tensors"):
            f = tmp_path / name
            f.write_bytes(b"\x80\x02K\x01.")
            tar.add(f, arcname=name)
    assert sniff(str(p)) == Format.TORCH_TAR
    with pytest.raises(UnsupportedError) as e:
        read_checkpoint(p)
    assert str(e.value) == tar_message(str(p))
    with pytest.raises(UnsupportedError) as e:
        dispatch(Format.TORCH_PACKAGE, "load", "m.pt")
    assert str(e.value) == package_message("m.pt")


def test_an_empty_or_wrong_entry_is_a_lookup_error(monkeypatch):
    with pytest.raises(KeyError):
        FORMATS[Format.DCP].get("sing")
    monkeypatch.setattr(FORMATS[Format.DCP], "scan", None)
    with pytest.raises(LookupError, match="no scan"):
        dispatch(Format.DCP, "scan", "d")
    monkeypatch.setattr(FORMATS[Format.DCP], "scan", "ckptfix.ops.scan:no_such_function")
    with pytest.raises(LookupError, match="no_such_function"):
        dispatch(Format.DCP, "scan", "d")


def test_dispatch_imports_only_the_module_its_entry_names():
    """``read_checkpoint`` of a torch zip imports neither the scanner, the loader nor the writers."""
    code = (
        "import sys, ckptfix.formats.registry as r; from ckptfix.formats import Format; "
        "r.dispatch(Format.TORCH_ZIP, 'read', 'x'); "
        "print([m for m in ('ckptfix.ops.scan', 'ckptfix.ops.load', 'ckptfix.ops.convert') if m in sys.modules])"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize(
    "code",
    [
        "from ckptfix import read_checkpoint as f",
        "from ckptfix import strip_prefix_checkpoint as f",
        "from ckptfix.ops.rewrite.keys import strip_prefix_checkpoint as f",
        "from ckptfix.ops.inspect import inspect_checkpoint as f",
    ],
)
def test_an_output_dir_names_its_checkpoint_folders_from_every_entry(tmp_path, code):
    """sniff's message names the Trainer sub-folders whichever entry point reached it."""
    out = tmp_path / "out"
    ck = out / "checkpoint-7"
    ck.mkdir(parents=True)
    for f in (FW / "hf_llama_bin").iterdir():
        (ck / f.name).write_bytes(f.read_bytes())
    (ck / "trainer_state.json").write_text('{"global_step": 7}')
    prog = f"{code}\ntry:\n    f({str(out)!r})\nexcept Exception as e:\n    print(e)\n"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, env=env, timeout=300)
    assert "it holds checkpoint-7/: pass one of them" in r.stdout, (r.stdout, r.stderr)
