"""Start-up: each command imports only the modules it needs (the command table is complete)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ckptfix.cli import cli
from ckptfix.cli.group import COMMAND_MODULES, load_all


def test_the_lazy_command_table_is_complete():
    load_all()
    assert set(cli.commands) == set(COMMAND_MODULES)
    for name, cmd in cli.commands.items():
        assert cmd.callback is not None and cmd.callback.__module__ == COMMAND_MODULES[name]


def _imported(*args: str) -> set[str]:
    code = (
        "import sys\nfrom ckptfix.cli import main\n"
        "try:\n    main(sys.argv[1:])\nfinally:\n    print('\\n'.join(sorted(sys.modules)), file=sys.stderr)\n"
    )
    p = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
    return set(p.stderr.split())


@pytest.mark.parametrize(
    ("args", "absent"),
    [
        (["gpus", "--help"], ["ckptfix.cli.ckpt", "ckptfix.cli.train", "ckptfix.formats", "ckptfix.pickles"]),
        (["inspect", "--help"], ["ckptfix.cli.gpu", "ckptfix.cli.train", "ckptfix.cli.demo", "ckptfix.train"]),
    ],
)
def test_a_command_imports_only_its_own_module(args, absent):
    mods = _imported(*args)
    assert "torch" not in mods
    assert not [m for m in absent if m in mods]


def test_help_lists_every_command(capsys):
    from ckptfix.cli import main

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in COMMAND_MODULES)
