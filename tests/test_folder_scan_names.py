"""A folder's scan never trusts a file's name: a pickle hidden (``.optimizer.pt``, ``.cache/x.pt``) or named as
text or JSON (``tokenizer.json``, ``notes.txt``: ``pickle.load`` reads a protocol-0 pickle whatever its name)
makes the folder dangerous; real text, JSON and a repository's ``.git`` stay out of the verdict."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
from safetensors.torch import save_file  # noqa: E402

from helpers import run_cli  # noqa: E402


def _evil(canary) -> bytes:
    return b"cos\nsystem\n(S'touch " + str(canary).encode() + b"'\ntR."


def _trainer(d):
    d.mkdir()
    save_file({"w": torch.zeros(2)}, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (d / "trainer_state.json").write_text(json.dumps({"global_step": 5, "epoch": 1.0, "log_history": []}))
    (d / "README.md").write_text("# a model\n")
    (d / "tokenizer.json").write_text(json.dumps({"version": "1.0"}))
    return d


PLACES = [".optimizer.pt", "tokenizer.json", "special_tokens_map.json", "notes.txt", "README.md", "run.py",
          ".cache/evil.pt"]  # fmt: skip


@pytest.mark.parametrize("place", PLACES)
def test_a_pickle_under_any_name_makes_the_folder_dangerous(tmp_path, place):
    d = _trainer(tmp_path / "ckpt")
    canary = tmp_path / "ran"
    (d / place).parent.mkdir(exist_ok=True)
    (d / place).write_bytes(_evil(canary))
    # the oracle: pickle.load really runs it
    subprocess.run([sys.executable, "-c", f"import pickle; pickle.load(open({str(d / place)!r}, 'rb'))"], check=True)
    assert canary.exists()
    canary.unlink()
    r = run_cli("scan", str(d), "--json")
    assert r.rc == 11, r.err
    doc = json.loads(r.out)
    assert doc["verdict"] == "dangerous"
    assert doc["files"][place]["verdict"] == "dangerous"
    r = run_cli("inspect", str(d))
    assert "weights_only  FAILS" in r.out or "weights_only  fails" in r.out.lower(), r.out
    assert not canary.exists()


def test_text_json_and_a_repositorys_git_stay_out_of_the_verdict(tmp_path):
    d = _trainer(tmp_path / "ckpt")
    (d / ".git" / "objects").mkdir(parents=True)
    (d / ".git" / "objects" / "ab").write_bytes(os.urandom(200))
    (d / ".cache" / "huggingface").mkdir(parents=True)
    (d / ".cache" / "huggingface" / "model.safetensors.lock").write_text("")
    (d / ".cache" / "huggingface" / "model.safetensors.metadata").write_text("abc\n123\n")
    (d / ".gitattributes").write_text("*.bin filter=lfs diff=lfs merge=lfs -text\n")
    (d / "vocab.txt").write_text("[PAD]\n[UNK]\nhello\n")
    r = run_cli("scan", str(d), "--json")
    assert r.rc == 0, r.err
    assert json.loads(r.out)["verdict"] == "safe"


def test_a_forged_newline_in_a_file_name_prints_no_line_of_its_own(tmp_path):
    d = _trainer(tmp_path / "ckpt")
    forged = "evil\nckpt: safe (safetensors, 0 pickle(s), 0 globals)\n.pt"
    (d / forged).write_bytes(_evil(tmp_path / "canary"))
    for args in (("scan", d), ("inspect", d), ("inspect", d, "--keys")):
        r = run_cli(*map(str, args))
        assert r.returncode in (0, 11), r.stderr
        lines = r.stdout.splitlines()
        assert not any(line.startswith("ckpt: safe") for line in lines), r.stdout
        assert any("evil\\x0ackpt: safe" in line for line in lines), (args, r.stdout)
        assert "\n" not in r.stderr.rstrip("\n")
    assert not (tmp_path / "canary").exists()


def _case_variant_zip(path, canary) -> None:
    """A torch zip with a second, case-variant ``DATA.PKL`` that torch's reader (case-insensitive) takes."""
    import io
    import zipfile

    b = io.BytesIO()
    torch.save({"w": torch.zeros(2)}, b)
    z = zipfile.ZipFile(b)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as o:
        for i in z.infolist():
            o.writestr(zipfile.ZipInfo(i.filename, i.date_time), z.read(i))
        root = z.namelist()[0].split("/")[0]
        o.writestr(zipfile.ZipInfo(root + "/DATA.PKL", (2020, 1, 1, 0, 0, 0)), _evil(canary))


def _joined_zips(path, canary) -> None:
    """Two torch zips joined, the directory of the second: zipfile reads the second, torch's reader the first."""
    import io

    first, second = io.BytesIO(), io.BytesIO()
    torch.save({"w": torch.zeros(2)}, first)
    torch.save({"w": torch.ones(2)}, second)
    path.write_bytes(first.getvalue() + second.getvalue())


@pytest.mark.parametrize("make", [_case_variant_zip, _joined_zips], ids=["case-variant", "joined"])
@pytest.mark.parametrize("place", ["README.md", "sub/notes.txt", ".cache/opt.bin"])
def test_a_crafted_zip_under_a_text_name_is_no_safe_folder(tmp_path, make, place):
    """torch.load opens any file starting with a zip local header as its archive, whatever its name: a zip the
    checks refuse (torch and zipfile would read different members) makes the folder malformed, never safe."""
    d = _trainer(tmp_path / "ckpt")
    (d / place).parent.mkdir(parents=True, exist_ok=True)
    make(d / place, tmp_path / "canary")
    r = run_cli("scan", str(d), "--json")
    doc = json.loads(r.stdout)
    assert r.returncode != 0 and doc["verdict"] != "safe", r.stdout
    assert doc["files"][place]["verdict"] in ("malformed", "dangerous", "unknown")
