"""Checkpoints that are not a state dict, read as torch reads them (issue 21, items 11, 12 and 13).

A bare tensor or a list/tuple of tensors saved with torch.save is a checkpoint; a TorchScript archive is
not weights_only-loadable (torch 2.13 refuses it); a torch.package archive is a packaged model with code.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckptfix.errors import NoTensorsError, UnsupportedError
from ckptfix.formats import Format, sniff
from ckptfix.ops.inspect import inspect_checkpoint, scan_checkpoint
from ckptfix.ops.load import load_anywhere

from helpers import assert_one_line_error, run_cli


def _torch_weights_only_ok(path: Path) -> bool:
    try:
        torch.load(str(path), weights_only=True)
    except Exception:  # noqa: BLE001 - whatever torch refuses with
        return False
    return True


# --------------------------------------------------------------------------- item 11: bare tensors and sequences


LAYOUTS = {
    "tensor": (lambda: torch.arange(32.0).reshape(4, 8), {"tensor": (4, 8)}),
    "list": (lambda: [torch.zeros(2), torch.ones(3)], {"0": (2,), "1": (3,)}),
    "tuple": (lambda: (torch.zeros(2), torch.ones(3)), {"0": (2,), "1": (3,)}),
}


@pytest.mark.parametrize("legacy", [False, True])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_bare_tensor_and_sequences_are_checkpoints(tmp_path, layout, legacy):
    make, names = LAYOUTS[layout]
    obj = make()
    src = tmp_path / "t.pt"
    torch.save(obj, src, _use_new_zipfile_serialization=not legacy)
    assert _torch_weights_only_ok(src)  # torch reads it: so must ckptfix
    r = inspect_checkpoint(src)
    assert r.tensor_count == len(names) and r.weights_only_ok
    if layout == "tensor":
        assert any('named "tensor"' in n for n in r.notes)
    assert scan_checkpoint(src).verdict == "safe"
    sd = load_anywhere(src)
    assert {k: tuple(v.shape) for k, v in sd.items()} == names
    want = [obj] if layout == "tensor" else list(obj)
    for got, w in zip(sd.values(), want, strict=True):
        assert torch.equal(got, w)
    out = tmp_path / "t.safetensors"
    res = run_cli("convert", src, "-o", out)
    rc, stderr = res.rc, res.err
    assert rc == 0, stderr
    assert "the file holds" in stderr and ('"tensor"' in stderr if layout == "tensor" else '"0"' in stderr)
    assert {k: tuple(v.shape) for k, v in load_file(out).items()} == names


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("cmd", ["strip-prefix", "add-prefix"])
def test_rewrites_of_unnamed_tensors_say_why(tmp_path, layout, cmd):
    src = tmp_path / "t.pt"
    torch.save(LAYOUTS[layout][0](), src)
    argv = [cmd, src, "-o", tmp_path / "o.pt"] + (["--prefix", "a."] if cmd == "add-prefix" else [])
    res = run_cli(*argv)
    assert_one_line_error(res, NoTensorsError.exit_code)
    assert "no names" in res.err and "corrupt" not in res.err
    assert not (tmp_path / "o.pt").exists()


# --------------------------------------------------------------------------- item 12: TorchScript


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def test_torchscript_weights_only_verdict_is_torchs(tmp_path):
    p = tmp_path / "ts.pt"
    torch.jit.save(torch.jit.script(_Net()), p)
    assert sniff(str(p)) == Format.TORCHSCRIPT
    r = inspect_checkpoint(p)
    assert r.weights_only_ok is _torch_weights_only_ok(p) is False
    assert "TorchScript" in r.weights_only_reason and "torch.jit.load" in r.weights_only_reason
    res = run_cli("inspect", p)
    assert res.rc == 0 and "weights_only  ok" not in res.out


def test_weights_only_verdict_matches_torch_for_plain_files(tmp_path):
    for name, obj in {"sd": _Net().state_dict(), "tensor": torch.zeros(3), "list": [torch.zeros(1)]}.items():
        p = tmp_path / f"{name}.pt"
        torch.save(obj, p)
        assert inspect_checkpoint(p).weights_only_ok is _torch_weights_only_ok(p) is True


# --------------------------------------------------------------------------- item 13: torch.package


def _package(tmp_path: Path, with_code: bool) -> Path:

    out = tmp_path / ("pkg_code.pt" if with_code else "pkg.pt")
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    (src / "pkgmodel_t21.py").write_text(
        "import torch\n\nclass Net(torch.nn.Module):\n    def __init__(self):\n"
        "        super().__init__()\n        self.fc = torch.nn.Linear(2, 2)\n"
    )
    code = (
        "import sys, torch\n"
        f"sys.path.insert(0, {str(src)!r})\n"
        "from torch.package import PackageExporter\n"
        "import pkgmodel_t21\n"
        f"with PackageExporter({str(out)!r}) as e:\n"
        "    e.extern('torch.**')\n"
        + (
            "    e.intern('pkgmodel_t21')\n    e.save_pickle('model', 'model.pkl', pkgmodel_t21.Net())\n"
            if with_code
            else "    e.save_pickle('model', 'model.pkl', {'w': torch.zeros(3)})\n"
        )
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=120)
    return out


@pytest.mark.parametrize("with_code", [False, True])
def test_torch_package_is_recognised_and_scanned(tmp_path, with_code):
    p = _package(tmp_path, with_code)
    assert sniff(str(p)) == Format.TORCH_PACKAGE
    with pytest.raises(UnsupportedError, match="torch.package.*PackageImporter"):
        inspect_checkpoint(p)
    with pytest.raises(UnsupportedError, match="torch.package"):
        load_anywhere(p)
    r = scan_checkpoint(p)
    assert r.format == Format.TORCH_PACKAGE and any("model.pkl" in x for x in r.pickles)
    assert any("torch.package" in n for n in r.notes)
    if with_code:
        assert r.verdict == "dangerous" and "pkgmodel_t21.Net" in r.dangerous
    res = run_cli("inspect", p)
    assert_one_line_error(res, UnsupportedError.exit_code)
    assert "corrupt" not in res.err and "packaged model" in res.err


def test_torch_package_global_shadowed_by_packaged_code_is_dangerous(tmp_path):
    """PackageImporter resolves globals in the package first: a packaged ``collections`` runs on import."""
    p = _package(tmp_path, with_code=False)
    evil = tmp_path / "evil.pt"
    with zipfile.ZipFile(p) as zin, zipfile.ZipFile(evil, "w") as zout:
        for info in zin.infolist():
            zout.writestr(info, zin.read(info))
        root = zin.namelist()[0].split("/", 1)[0]
        zout.writestr(f"{root}/collections/__init__.py", "import os\nos.system('true')\n")
    r = scan_checkpoint(evil)
    assert r.verdict == "dangerous" and "collections.OrderedDict" in r.dangerous
