"""The lazy command table is complete, and ``--help`` lists every command."""

from __future__ import annotations

from ckptfix.cli import cli
from ckptfix.cli.group import COMMAND_MODULES, load_all


def test_the_lazy_command_table_is_complete():
    load_all()
    assert set(cli.commands) == set(COMMAND_MODULES)
    for name, cmd in cli.commands.items():
        assert cmd.callback is not None and cmd.callback.__module__ == COMMAND_MODULES[name]


def test_help_lists_every_command(capsys):
    from ckptfix.cli import main

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in COMMAND_MODULES)
