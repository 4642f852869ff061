"""A torch zip saved on a big-endian machine (issue 33 §4): ``byteorder`` record ``big``, every storage in that order.

No s390x here, so the file is made as ``torch.save`` writes it there: a little-endian ``torch.save`` archive whose
``byteorder`` record says ``big`` and whose storages are byte-swapped element by element.  ``torch.load`` is the
oracle: it reads the made file back equal to the tensors saved (checked first).  Every command either gives the
same values (convert swaps through torch.load, verified on values; rewrites keep the record and the bytes) or
refuses with exit 8 (diff, a ZeRO folder, convert without torch); never exit 0 with swapped garbage.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from ckptfix.formats import read_checkpoint  # noqa: E402

from helpers import run_cli  # noqa: E402


def make_big_endian(src: Path, dst: Path) -> None:
    cf = read_checkpoint(str(src))
    sizes = {k: st.element_size for k, st in cf.storages.items()}
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = zin.read(info)
            parts = info.filename.split("/")
            if parts[-1] == "byteorder":
                data = b"big"
            elif len(parts) == 3 and parts[1] == "data" and parts[2] in sizes:
                k = sizes[parts[2]]
                data = b"".join(data[i : i + k][::-1] for i in range(0, len(data), k))
            zout.writestr(info, data)


@pytest.fixture
def big(tmp_path: Path) -> tuple[Path, dict]:
    g = torch.Generator().manual_seed(0)
    sd = {
        "module.w": torch.randn(3, 4, generator=g),
        "module.i": torch.arange(5, dtype=torch.int64) * 1000003,
        "module.h": torch.randn(6, generator=g).to(torch.bfloat16),
        "module.d": torch.randn(2, generator=g, dtype=torch.float64),
        "module.b": torch.tensor([1, 2, 3], dtype=torch.uint8),
    }
    le = tmp_path / "le.pt"
    torch.save(sd, le)
    be = tmp_path / "be.pt"
    make_big_endian(le, be)
    got = torch.load(be, weights_only=True)  # the oracle reads it right
    assert all(torch.equal(got[k], v) for k, v in sd.items())
    assert zipfile.ZipFile(be).read("le/byteorder") == b"big"  # (the archive root is the name torch.save saw)
    return be, sd


def _equal(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_convert_to_safetensors_swaps_to_the_values_torch_load_reads(big, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    be, sd = big
    out = tmp_path / "o.safetensors"
    r = run_cli("convert", str(be), "-o", str(out))
    assert r.returncode == 0, r.stderr
    _equal(load_file(str(out)), torch.load(be, weights_only=True))
    out2 = tmp_path / "o2.safetensors"
    r = run_cli("convert", str(be), "-o", str(out2), "--strip-prefix")
    assert r.returncode == 0, r.stderr
    _equal(load_file(str(out2)), {k[len("module.") :]: v for k, v in sd.items()})


def test_load_anywhere_gives_the_values(big) -> None:
    from ckptfix import load_anywhere

    be, sd = big
    _equal(dict(load_anywhere(str(be))), sd)


def test_rewrites_keep_the_byteorder_record_and_the_bytes(big, tmp_path: Path) -> None:
    be, sd = big
    out = tmp_path / "s.pt"
    r = run_cli("strip-prefix", str(be), "-o", str(out))
    assert r.returncode == 0, r.stderr
    _equal(torch.load(out, weights_only=True), {k[len("module.") :]: v for k, v in sd.items()})
    r = run_cli("add-prefix", str(out), "--prefix", "enc.", "-o", str(tmp_path / "a.pt"))
    assert r.returncode == 0, r.stderr
    _equal(torch.load(tmp_path / "a.pt", weights_only=True), {"enc." + k[len("module.") :]: v for k, v in sd.items()})


def test_diff_refuses_with_exit_8(big, tmp_path: Path) -> None:
    be, sd = big
    le = tmp_path / "le.pt"
    r = run_cli("diff", str(be), str(le))
    assert r.returncode == 8 and "big-endian" in r.stderr, (r.returncode, r.stdout, r.stderr)


def test_convert_without_torch_refuses_with_exit_8(big, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ckptfix._torch as ct
    from ckptfix.errors import TorchMissingError, UnsupportedError
    from ckptfix.ops.convert import convert

    def missing(feature: str):
        raise TorchMissingError(f"{feature} needs torch")

    monkeypatch.setattr(ct, "require_torch", missing)
    be, _ = big
    with pytest.raises(UnsupportedError, match="big-endian") as e:
        convert(str(be), tmp_path / "x.safetensors")
    assert e.value.exit_code == 8
    assert not (tmp_path / "x.safetensors").exists()


def test_a_byteorder_torch_rejects_is_corrupt(tmp_path: Path) -> None:
    p = tmp_path / "a.pt"
    torch.save({"w": torch.zeros(2)}, p)
    q = tmp_path / "b.pt"
    with zipfile.ZipFile(p) as zin, zipfile.ZipFile(q, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            zout.writestr(info, b"middle" if info.filename.endswith("/byteorder") else zin.read(info))
    with pytest.raises(ValueError):
        torch.load(q, weights_only=True)  # the oracle refuses it
    r = run_cli("convert", str(q), "-o", str(tmp_path / "b.safetensors"))
    assert r.returncode == 4 and "byteorder" in r.stderr
