"""torch.export's ``.pt2`` archive (issue 37 §10): a program, not a torch.save checkpoint; said so, not 'corrupt'.

The writer is torch's own ``torch.export.save``; its loader, ``torch.export.load``, is what the message names.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptfix.errors import CorruptCheckpointError, UnsupportedError

from helpers import run_cli

torch = pytest.importorskip("torch")


@pytest.fixture
def pt2(tmp_path: Path) -> Path:
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU()).eval()
    p = tmp_path / "model.pt2"
    torch.export.save(torch.export.export(m, (torch.randn(2, 3),)), p)
    assert list(torch.export.load(p).state_dict) == ["0.weight", "0.bias"]
    return p


@pytest.mark.parametrize("command", ["inspect", "convert", "scan"])
def test_pt2_is_named_a_torch_export_program(command: str, pt2: Path) -> None:
    r = run_cli(command, str(pt2), isolated=False)
    assert r.rc == UnsupportedError.exit_code != CorruptCheckpointError.exit_code, r.err
    assert "a torch.export program" in r.err and "torch.export.load" in r.err and "corrupt" not in r.err
