"""tests/helpers.py run_cli: ordinary commands run in-process and give what the console script gives; a test
about the interpreter still gets a fresh one.  And ``main()`` keeps no state from one call to the next."""

from __future__ import annotations

import os

import pytest

from ckptfix.cli import main

from helpers import assert_one_line_error, run_cli


def test_in_process_and_fresh_interpreter_agree(ckpt, tmp_path):
    b = ckpt.dataparallel()
    for args in (("inspect", b.path), ("inspect", b.path, "--json"), ("scan", tmp_path / "missing.pt")):
        here, fresh = run_cli(*args), run_cli(*args, isolated=True)
        assert not here.isolated and fresh.isolated
        assert (here.rc, here.out, here.err) == (fresh.rc, fresh.out, fresh.err), args


def test_in_process_run_restores_environment_and_cwd(tmp_path):
    before_env, before_cwd = dict(os.environ), os.getcwd()
    r = run_cli("gpus", env={"PATH": "/nonexistent"}, cwd=tmp_path, CUDA_VISIBLE_DEVICES="0")
    assert not r.isolated and r.rc != 0
    assert dict(os.environ) == before_env and os.getcwd() == before_cwd


def test_torch_imported_needs_an_explicit_fresh_interpreter(tmp_path):
    """The choice is the caller's (``isolated=True``), not guessed from the test's code: an in-process run cannot
    say whether torch was imported, and asking it says what to pass."""
    here = run_cli("scan", tmp_path / "missing.pt")
    assert not here.isolated
    with pytest.raises(AssertionError, match="isolated=True"):
        _ = here.torch_imported
    r = run_cli("scan", tmp_path / "missing.pt", isolated=True)
    assert r.isolated and r.torch_imported is False


def test_process_commands_and_another_pythonpath_get_a_fresh_interpreter(tmp_path):
    assert run_cli("pick-gpu", "--help").isolated
    assert run_cli("--version", PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ["PYTHONPATH"]])).isolated
    assert run_cli("--version", CKPTFIX_DCP_MAX_METADATA="100").isolated  # read when ckptfix.formats.dcp is imported
    assert not run_cli("--version", CKPTFIX_DEBUG="1").isolated  # read on each run


def test_debug_does_not_outlive_its_run(tmp_path, capsys):
    missing = str(tmp_path / "missing.pt")
    assert main(["--debug", "inspect", missing]) != 0
    assert "Traceback" in capsys.readouterr().err
    code = main(["inspect", missing])
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("Error: "), err
    assert_one_line_error(run_cli("inspect", missing), code)


def test_a_hung_in_process_run_fails_and_names_the_command(monkeypatch):
    import time

    import ckptfix.cli

    import helpers

    def hang(argv):
        time.sleep(30)

    monkeypatch.setattr(ckptfix.cli, "main", hang)
    with pytest.raises(helpers.CliHang, match=r"ckptfix inspect x: still running after 0.2 s \(hung\?\)"):
        run_cli("inspect", "x", timeout=0.2, isolated=False)
