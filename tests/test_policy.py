"""The pickle security policy: one table, read by the classifier and by the restricted reader alike.

The oracles are torch's weights-only unpickler (what it allows is what "safe" means) and CPython's
pickle (what the reader rebuilds for real must equal what ``pickle.loads`` builds).
"""

from __future__ import annotations

import collections
import io
import pickle
import subprocess
import sys

import pytest

from ckptfix.pickles import ELEMENT_SIZE, RecordingUnpickler, Stub, loads_records, policy
from ckptfix.pickles.policy import KNOWN_GLOBALS, classify_global, classify_pair, known_global, worst


def test_every_known_global_has_one_verdict_everywhere():
    """The classifier's "safe" and the reader's treatment come from the same entry."""
    for (module, name), known in KNOWN_GLOBALS.items():
        verdict = classify_global(f"{module}.{name}")
        assert (verdict == "safe") == known.safe, (module, name, verdict)
        assert classify_pair(module, name) == verdict
        assert known_global(module, name) is known


@pytest.mark.parametrize(
    "value",
    [
        collections.OrderedDict(a=1),
        complex(1, 2),
        slice(1, 5, 2),
        {1, 2},
        frozenset([3]),
        bytearray(b"xy"),
        b"raw",
        range(2, 9, 3),
    ],
    ids=lambda v: type(v).__name__,
)
def test_what_the_table_builds_for_real_is_what_pickle_builds(value):
    data = pickle.dumps({"v": value}, protocol=2)
    obj, up = loads_records(data)
    assert obj["v"] == pickle.loads(data)["v"] and type(obj["v"]) is type(value)
    assert up.notes == []


def test_the_reader_builds_nothing_the_table_does_not_name():
    """Every global outside the table's constructors stays an inert placeholder class."""
    up = RecordingUnpickler(io.BytesIO(b""))
    for module, name in [("argparse", "Namespace"), ("collections", "Counter"), ("os", "system"), ("torch", "Size")]:
        cls = up.find_class(module, name)
        assert isinstance(cls, type) and issubclass(cls, Stub), (module, name)
    for (module, name), known in KNOWN_GLOBALS.items():
        got = up.find_class(module, name)
        if known.build is None:
            assert issubclass(got, Stub)
        elif known.bounded:
            assert issubclass(got, Stub) and got._real is known.build  # built for real while small
        else:
            assert got is known.build


def test_torch_weights_only_allowlist_is_safe():
    """Everything torch's weights-only unpickler allows by default (torch.distributed's too) classifies as safe."""
    wo = pytest.importorskip("torch._weights_only_unpickler")
    allowed = list(wo._get_allowed_globals())
    assert allowed
    assert [g for g in allowed if classify_global(g) != "safe"] == []


@pytest.mark.parametrize(
    "name,verdict",
    [
        ("os.system", "dangerous"),
        ("posix.system", "dangerous"),
        ("builtins.eval", "dangerous"),
        ("builtins.getattr", "dangerous"),
        ("builtins.int", "unknown"),
        ("torch.FloatStorage", "safe"),
        ("torch.bfloat16", "safe"),
        ("torch._utils._rebuild_tensor_v2", "safe"),
        ("torch.hub.load", "dangerous"),
        ("numpy.load", "dangerous"),
        ("numpy.core.multiarray._reconstruct", "unknown"),
        ("mymodule.__builtins__", "dangerous"),
        ("<STACK_GLOBAL of values computed at load time>", "unknown"),
        ("argparse.Namespace", "unknown"),
    ],
)
def test_classify_global(name, verdict):
    assert classify_global(name) == verdict


def test_contexts_widen_only_exact_names():
    assert classify_global("__torch__.Net", "torchscript") == "safe"
    assert classify_global("__torch__.Net") == "unknown"
    assert classify_global("__torch__.__builtins__", "torchscript") != "safe"
    assert classify_global("torch.distributed.checkpoint.metadata.Metadata", "dcp") == "safe"
    assert classify_global("torch.distributed.checkpoint.metadata.Metadata") != "safe"
    assert classify_global("torch.distributed.checkpoint.metadata.os", "dcp") != "safe"


def test_a_dotted_attribute_path_is_never_safe():
    assert classify_pair("collections", "OrderedDict") == "safe"
    assert classify_pair("torch", "Size.__init__") == "dangerous"
    assert classify_pair("collections", "OrderedDict.fromkeys") == "unknown"
    assert classify_pair("torch.nn", "parameter.Parameter") == "unknown"
    assert known_global("torch.nn", "parameter.Parameter") is None


def test_worst():
    assert worst() == "safe"
    assert worst("safe", "unknown") == "unknown"
    assert worst("unknown", "dangerous", "safe") == "dangerous"


def test_codecs_encode_allows_plain_text_codecs_only():
    assert policy.codecs_encode("é", "latin1") == b"\xe9"
    with pytest.raises(pickle.UnpicklingError):
        policy.codecs_encode("x", "rot13")
    with pytest.raises(pickle.UnpicklingError):
        policy.codecs_encode(b"x", "utf-8")


def test_dtype_names_match_the_reader():
    assert set(policy.DTYPE_NAMES) == set(ELEMENT_SIZE)
    assert policy.DTYPE_GLOBALS["half"] == "float16"


def test_policy_imports_neither_torch_nor_the_formats():
    code = (
        "import sys; import ckptfix.pickles.policy as p; p.classify_global('os.system'); "
        "bad = [m for m in ('torch', 'numpy', 'ckptfix.formats') if m in sys.modules]; "
        "assert not bad, bad"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr


def test_weights_only_opcodes_are_the_ones_torch_reads():
    """torch's weights-only unpickler imports each opcode it handles from ``pickle`` by name: the same set."""
    wo = pytest.importorskip("torch._weights_only_unpickler")
    handled = {
        n
        for n in dir(wo)
        if n.isupper() and isinstance(getattr(wo, n), bytes) and getattr(pickle, n, None) == getattr(wo, n)
    }
    assert handled == policy.WEIGHTS_ONLY_OPCODES
