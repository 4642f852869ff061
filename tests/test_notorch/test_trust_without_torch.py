"""``convert --trust`` without torch: exit 14 with the install command (issue 23, item 12), never a silent 0."""

from __future__ import annotations

INSTALL = "pip install torch"


def test_convert_trust_without_torch_exits_14(cli, ckpts):
    r = cli("convert", "ddp.pth", "--trust", "-o", "t.safetensors")
    assert r.rc == 14, (r.rc, r.out, r.err)
    assert r.err == f"Error: --trust needs torch, which is not installed here; install it with: {INSTALL}\n"
    assert not (ckpts / "t.safetensors").exists()


def test_convert_without_trust_still_works_without_torch(cli, ckpts):
    r = cli("convert", "ddp.pth", "-o", "t.safetensors")
    assert r.rc == 0, r.err
    assert (ckpts / "t.safetensors").exists()
