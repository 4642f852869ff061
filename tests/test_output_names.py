"""The output is what its name says: no command writes safetensors bytes under a ``.pt`` name, a torch file under
``.safetensors``, or a folder of shards under a file's name (torch.load then fails "invalid load key")."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from safetensors.torch import load_file, save_file  # noqa: E402

from helpers import run_cli  # noqa: E402


@pytest.fixture
def ck(tmp_path: Path) -> Path:
    sd = {"module.a": torch.randn(4, 4), "module.b": torch.randn(4)}
    torch.save(sd, tmp_path / "m.pt")
    save_file(sd, str(tmp_path / "m.safetensors"))
    return tmp_path


REFUSED = [
    (["strip-prefix", "m.safetensors", "-o", "x.pt"], "safetensors bytes under a .pt name", "x.safetensors"),
    (["add-prefix", "m.safetensors", "--prefix", "p.", "-o", "x.bin"], "under a .bin name", "x.safetensors"),
    (["strip-prefix", "m.pt", "-o", "x.safetensors"], "torch.save file under a .safetensors name", "x.pt"),
    (["convert", "m.pt", "-o", "x.pt"], "safetensors bytes under a .pt name", "x.safetensors"),
    (["convert", "m.pt", "--strip-prefix", "-o", "x.pth"], "under a .pth name", "x.safetensors"),
    (["convert", "m.safetensors", "--to", "pt", "-o", "x.safetensors"], "under a .safetensors name", "x.pth"),
]


@pytest.mark.parametrize("argv,says,fix", REFUSED, ids=[" ".join(a) for a, _, _ in REFUSED])
def test_a_name_that_says_another_format_is_refused_before_anything_is_written(ck, argv, says, fix):
    r = run_cli(*argv, cwd=ck)
    assert r.rc == 9, r.err
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and says in lines[0] and fix in lines[0], r.err
    assert not (ck / argv[argv.index("-o") + 1]).exists()
    assert sorted(os.listdir(ck)) == ["m.pt", "m.safetensors"]


def test_a_sharded_rewrite_is_a_directory_and_is_not_named_as_a_file(ck):
    os.makedirs(ck / "sh", exist_ok=True)
    r = run_cli("convert", "m.pt", "-o", "sh/model.safetensors", "--max-shard-size", "64B", cwd=ck)
    assert r.rc == 0, r.err
    r = run_cli("strip-prefix", "sh/model.safetensors.index.json", "-o", "out.pt", cwd=ck)
    assert r.rc == 9, r.err
    assert "a sharded checkpoint is rewritten into a directory" in r.err
    assert not (ck / "out.pt").exists()
    r = run_cli("strip-prefix", "sh/model.safetensors.index.json", "-o", "out", cwd=ck)
    assert r.rc == 0, r.err


@pytest.mark.parametrize(
    "argv,out",
    [
        (["strip-prefix", "m.safetensors", "-o", "x.safetensors"], "x.safetensors"),
        (["strip-prefix", "m.pt", "-o", "x.pth"], "x.pth"),
        (["strip-prefix", "m.pt", "-o", "x.weights"], "x.weights"),  # no checkpoint extension: no promise
        (["convert", "m.pt", "--strip-prefix", "-o", "x.safetensors"], "x.safetensors"),
        (["convert", "m.safetensors", "-o", "x.pth"], "x.pth"),
    ],
)
def test_names_that_fit_still_write_what_they_say(ck, argv, out):
    r = run_cli(*argv, cwd=ck)
    assert r.rc == 0, r.err
    if out.endswith(".safetensors"):
        assert set(load_file(str(ck / out))) <= {"a", "b", "module.a", "module.b"}
    else:
        assert set(torch.load(ck / out, weights_only=True)) <= {"a", "b", "module.a", "module.b"}


def test_merging_shards_without_o_writes_one_safetensors_torch_free(tmp_path):
    """A diffusers-style index (not model.safetensors.index.json) with no -o: the shards merge into one
    safetensors file, torch-free, not a pickle through torch."""
    import json

    d = tmp_path / "unet"
    d.mkdir()
    names = [f"diffusion_pytorch_model-0000{i}-of-00002.safetensors" for i in (1, 2)]
    save_file({"a": torch.ones(4)}, str(d / names[0]))
    save_file({"b": torch.zeros(4)}, str(d / names[1]))
    doc = {"metadata": {"total_size": 32}, "weight_map": {"a": names[0], "b": names[1]}}
    (d / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(doc))
    r = run_cli("convert", "unet", cwd=tmp_path, isolated=True)
    assert r.rc == 0, r.err
    assert r.out.strip() == "unet.safetensors"
    assert r.torch_imported is False
    assert set(load_file(str(tmp_path / "unet.safetensors"))) == {"a", "b"}
