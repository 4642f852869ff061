"""DCP ``.metadata`` written under Python >= 3.12 names enum members as ``builtins.getattr(cls, "MEMBER")``.

Python 3.12 changed ``Enum.__reduce_ex__`` to ``(getattr, (cls, self._name_))``.  The suite runs on
Python 3.11, so the tests give torch's own ``_MEM_FORMAT_ENCODING`` that reduction for the save (what a
3.12+ interpreter does by itself): the files are written by torch's DCP writer and read back by
``dcp.load``, the oracle.  Only that exact call is allowed: ``getattr`` on anything else, or left on the
stack for any other use, stays dangerous in ``scan`` and foreign in the ``.metadata`` reader.
"""

from __future__ import annotations

import contextlib
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_md

from ckptfix import load_anywhere
from ckptfix.cli import main
from ckptfix.errors import UnsafePickleError
from ckptfix.ops.convert import convert
from ckptfix.ops.scan import scan_checkpoint
from ckptfix.pickles.opcodes import scan_globals
from ckptfix.pickles.policy import DCP_ENUM_MEMBERS

MD = "torch.distributed.checkpoint.metadata"


@contextlib.contextmanager
def enums_by_name():
    """Pickle DCP's enum members as Python >= 3.12 does: ``getattr(cls, name)``."""
    cls = dcp_md._MEM_FORMAT_ENCODING
    cls.__reduce_ex__ = lambda self, proto: (getattr, (self.__class__, self._name_))
    try:
        yield
    finally:
        del cls.__reduce_ex__


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "conv.weight": torch.randn(4, 3, 2, 2, generator=g).to(memory_format=torch.channels_last),
        "fc.weight": torch.randn(3, 4, generator=g),
        "steps": torch.arange(5),
    }


def _save(d: Path, protocol: int | None = None, formats: dict[str, torch.memory_format] | None = None) -> None:
    """A real DCP save; ``formats`` rewrites some entries' recorded memory format (torch's writer records
    contiguous for every tensor), ``protocol`` re-pickles ``.metadata`` at that protocol (torch's own
    classes pickle themselves: the oracle reads it)."""
    with enums_by_name(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_state(), checkpoint_id=str(d), no_dist=True)
        if formats or protocol is not None:
            with open(d / ".metadata", "rb") as f:
                meta = pickle.load(f)
            for fqn, fmt in (formats or {}).items():
                meta.state_dict_metadata[fqn].properties.memory_format = fmt
            with open(d / ".metadata", "wb") as f:
                pickle.dump(meta, f, protocol=4 if protocol is None else protocol)


def _torch_load(d: Path) -> dict[str, torch.Tensor]:
    sd = {k: torch.empty_like(v) for k, v in _state().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, checkpoint_id=str(d), no_dist=True)
    return sd


ALL_FORMATS = {
    "conv.weight": torch.channels_last,
    "fc.weight": torch.preserve_format,
    "steps": torch.contiguous_format,
}


@pytest.mark.parametrize("protocol", [None, 2, 4, 5])
def test_enum_members_by_name_are_safe_and_convert(tmp_path, protocol, capsys):
    d = tmp_path / "ckpt"
    _save(d, protocol, ALL_FORMATS if protocol is not None else None)
    data = (d / ".metadata").read_bytes()
    assert b"getattr" in data  # the shape under test: builtins.getattr(<enum class>, "MEMBER")
    r = scan_globals(data)
    assert ("builtins", "getattr") not in r.pairs
    members = {n for (m, n) in r.pairs if n.startswith("_MEM_FORMAT_ENCODING.")}
    assert members == (
        {f"_MEM_FORMAT_ENCODING.{m}" for m in DCP_ENUM_MEMBERS[f"{MD}._MEM_FORMAT_ENCODING"]}
        if protocol is not None
        else {"_MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT"}
    )
    rep = scan_checkpoint(d)
    assert rep.verdict == "safe", rep.globals
    assert "builtins.getattr" not in rep.globals
    ref = _torch_load(d)  # the oracle reads the same folder
    got = load_anywhere(d)
    assert set(got) == set(ref)
    for k, v in ref.items():
        assert torch.equal(got[k], v)
    out = tmp_path / "o.safetensors"
    convert(d, out)
    from safetensors.torch import load_file

    st = load_file(str(out))
    for k, v in ref.items():
        assert torch.equal(st[k], v)
    # a rename writes .metadata back (members by value, as torch pickles them on any Python): torch loads it
    assert main(["add-prefix", str(d), "--prefix", "model.", "-o", str(tmp_path / "renamed")]) == 0
    renamed = {f"model.{k}": torch.empty_like(v) for k, v in ref.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(renamed, checkpoint_id=str(tmp_path / "renamed"), no_dist=True)
        back = pickle.loads((tmp_path / "renamed" / ".metadata").read_bytes())
    for k, v in ref.items():
        assert torch.equal(renamed[f"model.{k}"], v)
    if protocol is not None:  # each entry keeps its recorded memory format
        for k, fmt in ALL_FORMATS.items():
            assert back.state_dict_metadata[f"model.{k}"].properties.memory_format == fmt
    capsys.readouterr()


def _poisoned(tmp_path: Path, old: bytes, new: bytes) -> Path:
    d = tmp_path / "ckpt"
    _save(d, 2, ALL_FORMATS)
    data = (d / ".metadata").read_bytes()
    assert data.count(old) >= 1, data
    (d / ".metadata").write_bytes(data.replace(old, new, 1))
    return d


def _member(name: bytes) -> bytes:
    return b"X" + len(name).to_bytes(4, "little") + name


# each keeps the pickle well formed for CPython; each makes getattr reach something else than a member
HOSTILE = {
    # a name that is not a member of the enum
    "not_a_member": (_member(b"TORCH_CHANNELS_LAST"), _member(b"__init_subclass__")),
    # getattr on another class than a DCP enum
    "other_class": (b"ctorch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\n", b"cos\nsystem\n"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_getattr_on_anything_else_stays_dangerous(tmp_path, case, capsys):
    old, new = HOSTILE[case]
    d = _poisoned(tmp_path, old, new)
    rep = scan_checkpoint(d)
    assert rep.verdict == "dangerous"
    assert rep.globals["builtins.getattr"]["class"] == "dangerous"
    with pytest.raises(UnsafePickleError, match="builtins.getattr"):
        load_anywhere(d)
    assert main(["convert", str(d), "-o", str(tmp_path / "o.safetensors")]) == 5
    assert not (tmp_path / "o.safetensors").exists()
    capsys.readouterr()


def _stream(*parts: bytes) -> bytes:
    return b"\x80\x02" + b"".join(parts) + b"."


GA = b"cbuiltins\ngetattr\n"
ENUM = f"c{MD}\n_MEM_FORMAT_ENCODING\n".encode()


@pytest.mark.parametrize(
    "data",
    [
        # getattr memoized, called once for a member, then fetched and called on os
        _stream(
            GA, b"q\x00", ENUM, _member(b"TORCH_CHANNELS_LAST"), b"\x86R0h\x00cos\nsystem\n", _member(b"x"), b"\x86R"
        ),
        # getattr DUP'ed: one copy called for a member, the other left as the result
        _stream(GA, b"2", ENUM, _member(b"TORCH_CHANNELS_LAST"), b"\x86R0"),
        # getattr as a plain value (never called)
        _stream(b"]", GA, b"a"),
        # getattr called through INST
        b"\x80\x02(" + ENUM + _member(b"TORCH_CHANNELS_LAST") + b"ibuiltins\ngetattr\n.",
        # getattr(enum, member) whose result is then called: still only getattr's own call is allowed
        _stream(GA, ENUM, _member(b"TORCH_CHANNELS_LAST"), b"\x86R", GA, b"\x85R"),
    ],
    ids=["memo_reused_on_os", "dup_left_over", "as_value", "inst", "second_getattr_on_member"],
)
def test_scan_counts_every_other_getattr(data):
    with contextlib.suppress(Exception):
        pickle.loads(data)  # well formed for CPython (some raise at load time: what matters is the scan)
    r = scan_globals(data)
    assert r.pairs[("builtins", "getattr")] >= 1, r.pairs
    assert rep_verdict(data) == "dangerous"


def rep_verdict(data: bytes) -> str:
    from ckptfix.pickles.policy import classify_pair, worst

    r = scan_globals(data)
    return worst(*(classify_pair(m, n, "dcp") for (m, n) in r.pairs))


def test_member_lookup_alone_is_safe_only_in_dcp_metadata():
    data = _stream(GA, ENUM, _member(b"TORCH_PRESERVE_FORMAT"), b"\x86R")
    assert pickle.loads(data) is dcp_md._MEM_FORMAT_ENCODING.TORCH_PRESERVE_FORMAT
    assert rep_verdict(data) == "safe"
    from ckptfix.pickles.policy import classify_pair

    r = scan_globals(data)
    # in a torch.load file: not what torch's weights-only loader allows, so never "safe" there
    assert {classify_pair(m, n) for (m, n) in r.pairs} == {"unknown"}
