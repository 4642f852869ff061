"""Whole pickled objects torch wrote itself (issue 34 B5): legacy whole-module saves, objects holding modules,
TorchScript archives with an Enum attribute or a folder named ``data``.

The fixtures are in tests/fixtures/frameworks/pickled/ (``make_pickled.py``, versions in its ``VERSIONS``);
``NAME.expected.safetensors`` beside each is what ``module.state_dict()`` gave.  ckptfix reads them without
their classes; torch, the oracle, loads them with ``pickled/src`` on ``sys.path`` (only there).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from ckptfix import load_anywhere
from ckptfix.errors import KeyConflictError
from ckptfix.ops.convert import convert
from ckptfix.ops.inspect import inspect_checkpoint
from ckptfix.ops.load import load_checkpoint

from helpers import run_cli

torch = pytest.importorskip("torch")

PK = Path(__file__).resolve().parent / "fixtures" / "frameworks" / "pickled"


def _expected(name: str) -> dict:
    return load_file(str(PK / f"{name}.expected.safetensors"))


def _same(got: dict, want: dict) -> None:
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


@pytest.fixture
def oracle_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fixtures' classes importable, for torch's own loader only."""
    monkeypatch.syspath_prepend(str(PK / "src"))


# --------------------------------------------------------------------------- B5a: legacy whole-module save


def test_legacy_whole_module_is_read_not_corrupt(tmp_path: Path) -> None:
    # was: exit 4 "unsupported persistent id ('module', <class ...Net>, ...): the file is corrupt"
    p = run_cli("inspect", str(PK / "legacy_module.pt"))
    assert p.returncode == 0, p.stderr
    assert "module class(es) saved with their source" in p.stdout and "pickled_models.Net" in p.stdout
    rep = inspect_checkpoint(PK / "legacy_module.pt")
    assert rep.tensor_count == len(_expected("legacy_module"))
    _same(load_anywhere(PK / "legacy_module.pt"), _expected("legacy_module"))
    out = tmp_path / "m.safetensors"
    convert(PK / "legacy_module.pt", out)
    _same(load_file(str(out)), _expected("legacy_module"))


def test_legacy_whole_module_against_torch(oracle_path: None) -> None:
    m = torch.load(PK / "legacy_module.pt", weights_only=False)
    want = m.state_dict()
    got = load_anywhere(PK / "legacy_module.pt")
    assert list(got) == list(want)  # state_dict() order: the non-persistent buffer left out
    assert "cache" not in got and "cache" in dict(m.named_buffers())
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def test_legacy_module_classes_stay_unknown_to_scan() -> None:
    # the source in the persistent id is data, and the classes stay placeholders: scan calls them unknown
    p = run_cli("scan", str(PK / "legacy_module.pt"))
    assert p.returncode == 11, p.stderr  # outside the weights-only allowlist, as torch says
    assert "unknown   pickled_models.Net" in p.stdout and "unknown   torch.nn.modules.linear.Linear" in p.stdout


# --------------------------------------------------------------------------- B5b: objects holding modules


@pytest.mark.parametrize("name", ["agent.pt", "agent_legacy.pt"])
def test_agent_object_modules_named_as_state_dict(name: str, tmp_path: Path) -> None:
    # was: "no state dict ... found in the checkpoint; pass --key", then --key actor: exit 6 "top-level keys: []"
    want = _expected("agent")
    _same(load_anywhere(PK / name), want)
    out = tmp_path / "a.safetensors"
    convert(PK / name, out)
    _same(load_file(str(out)), want)
    p = run_cli("inspect", str(PK / name))
    assert p.returncode == 0, p.stderr
    assert "actor (pickled_models.Actor, 5 tensors), critic (pickled_models.Critic, 4 tensors)" in p.stdout


def test_agent_key_names_an_attribute(tmp_path: Path) -> None:
    want = {k[len("actor.") :]: v for k, v in _expected("agent").items() if k.startswith("actor.")}
    _same(load_anywhere(PK / "agent.pt", key="actor"), want)
    p = run_cli("convert", str(PK / "agent.pt"), "--key", "actor", "-o", str(tmp_path / "actor.safetensors"))
    assert p.returncode == 0, p.stderr
    _same(load_file(str(tmp_path / "actor.safetensors")), want)
    q = {k[len("critic.q.") :]: v for k, v in _expected("agent").items() if k.startswith("critic.q.")}
    _same(load_anywhere(PK / "agent.pt", key="critic.q"), q)
    with pytest.raises(KeyConflictError, match=r"names at its top: \['actor', 'critic', 'critic_target'"):
        load_anywhere(PK / "agent.pt", key="policy")
    p = run_cli("inspect", str(PK / "agent.pt"), "--key", "policy")
    assert p.returncode == 6 and "an object of class pickled_models.Agent" in p.stderr


def test_agent_against_torch(oracle_path: None) -> None:
    agent = torch.load(PK / "agent.pt", weights_only=False)
    got = load_anywhere(PK / "agent.pt")
    for attr in ("actor", "critic", "critic_target"):
        for k, v in getattr(agent, attr).state_dict().items():
            assert torch.equal(got[f"{attr}.{k}"], v)
    actor = load_anywhere(PK / "agent.pt", key="actor")
    fresh = type(agent.actor)()
    fresh.load_state_dict(actor, strict=True)
    x = torch.randn(2, 3)
    assert torch.equal(fresh.fc2(fresh.fc1(x)), agent.actor.fc2(agent.actor.fc1(x)))


def test_agent_convert_json_says_where(tmp_path: Path) -> None:
    p = run_cli("inspect", str(PK / "agent.pt"), "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["tensor_count"] == 13


# --------------------------------------------------------------------------- B5c: TorchScript archives


@pytest.mark.parametrize("name", ["ts_enum", "data"])
def test_torchscript_archives_read(name: str, tmp_path: Path) -> None:
    # ts_enum: was exit 4 "data.pkl cannot be read (TypeError: argument list must be a tuple)";
    # data: was exit 8 "tensor record 'data/code/__torch__/data/nets.py' is compressed ... re-zipped"
    p = run_cli("inspect", str(PK / f"{name}.pt"))
    assert p.returncode == 0, p.stderr
    out = tmp_path / "o.safetensors"
    convert(PK / f"{name}.pt", out)
    _same(load_file(str(out)), _expected(name))
    _same(load_anywhere(PK / f"{name}.pt"), _expected(name))
    assert run_cli("scan", str(PK / f"{name}.pt")).returncode == 11  # TorchScript runs code: unknown, as always


@pytest.mark.parametrize("name", ["ts_enum", "data"])
def test_torchscript_archives_against_jit_load(name: str, oracle_path: None) -> None:
    m = torch.jit.load(str(PK / f"{name}.pt"))
    got = load_anywhere(PK / f"{name}.pt")
    want = m.state_dict()
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def test_enum_value_is_the_placeholders_argument() -> None:
    from ckptfix.formats import read_checkpoint

    cf = read_checkpoint(PK / "ts_enum.pt")
    mode = cf.obj.state["mode"]
    assert mode.full_name == "__torch__.pickled_models.Mode" and mode.args == ("bilinear",)


def test_tuple_enum_reduces_leaves_other_pickles_alone() -> None:
    import pickle

    from ckptfix.pickles.jitenum import tuple_enum_reduces

    assert tuple_enum_reduces(pickle.dumps({"a": [1, 2.0, "x"], "b": (3,)}, protocol=2)) is None
    assert tuple_enum_reduces(pickle.dumps({"a": 1}, protocol=4)) is None  # framed: never rewritten
    assert tuple_enum_reduces(b"\x80\x02garbage") is None


# --------------------------------------------------------------------------- B5b: ultralytics' own files

UL = PK.parent / "ultralytics"


@pytest.mark.parametrize(("name", "entry"), [("yolo.pt", "model"), ("last.pt", "ema")])
def test_ultralytics_files_give_the_detection_models_state_dict(name: str, entry: str, tmp_path: Path) -> None:
    want = load_file(str(UL / "expected.safetensors"))
    lc = load_checkpoint(UL / name)
    assert lc.key_path == (entry,)
    _same(lc.state_dict, want)
    _same(load_anywhere(UL / name, key=entry), want)
    p = run_cli("convert", str(UL / name), "--key", entry, "--strip-prefix", "-o", str(tmp_path / "o.safetensors"))
    assert p.returncode == 0, p.stderr
    assert "nothing stripped" in p.stderr  # model.0.conv.weight is DetectionModel's own name (issue 37 item 3)
    _same(load_file(str(tmp_path / "o.safetensors")), want)


def test_ultralytics_convert_loads_strict_into_detection_model(tmp_path: Path) -> None:
    pytest.importorskip("ultralytics")
    from ultralytics.nn.tasks import DetectionModel

    for name in ("yolo.pt", "last.pt"):
        out = tmp_path / f"{name}.safetensors"
        convert(UL / name, out)
        m = DetectionModel(str(UL / "tiny.yaml"), verbose=False).half()
        m.load_state_dict(load_file(str(out)), strict=True)
        ref = torch.load(UL / name, weights_only=False)
        ref = ref["model"] or ref["ema"]
        got, want = m.state_dict(), ref.state_dict()
        assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
