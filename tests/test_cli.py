"""The CLI shell around every command: shell completion, colour on a terminal only, one error line."""

from __future__ import annotations

import os
import pty
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ckptfix.cli import _common, main
from ckptfix.errors import OutputError
from ckptfix.files.atomic import atomic_output

from helpers import run_cli, run_python

REPO = Path(__file__).resolve().parents[1]
ESC = "\x1b["


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "FORCE_COLOR", "TERM")}
    env.update({"PYTHONPATH": str(REPO), "TERM": "xterm-256color", **extra})
    return env


def _ckptfix(*args: str, stderr_tty: bool = False, **env: str) -> tuple[int, str, str]:
    """Run ``python -m ckptfix ARGS``; with ``stderr_tty`` stderr is a pseudo-terminal."""
    cmd = [sys.executable, "-m", "ckptfix", *args]
    if not stderr_tty:
        p = subprocess.run(cmd, env=_env(**env), capture_output=True, text=True, timeout=600)
        return p.returncode, p.stdout, p.stderr
    leader, follower = pty.openpty()
    try:
        p = subprocess.run(cmd, env=_env(**env), stdout=subprocess.PIPE, stderr=follower, timeout=600)
        os.close(follower)
        follower = -1
        chunks = []
        while True:
            try:
                b = os.read(leader, 4096)
            except OSError:  # EIO: the other side is closed and drained
                break
            if not b:
                break
            chunks.append(b)
        return p.returncode, p.stdout.decode(), b"".join(chunks).decode().replace("\r\n", "\n")
    finally:
        os.close(leader)
        if follower >= 0:
            os.close(follower)


@pytest.mark.parametrize(
    "shell,marker",
    [
        ("bash", "complete -o nosort -F _ckptfix_completion ckptfix"),
        ("zsh", "#compdef ckptfix"),
        ("fish", "complete --no-files --command ckptfix"),
    ],
)
def test_completion_script_for_each_shell(shell, marker):
    rc, out, err = _ckptfix(_CKPTFIX_COMPLETE=f"{shell}_source")
    assert rc == 0, err
    assert marker in out and "_CKPTFIX_COMPLETE" in out


def test_completion_completes_commands_and_options():
    rc, out, _ = _ckptfix(_CKPTFIX_COMPLETE="bash_complete", COMP_WORDS="ckptfix pick", COMP_CWORD="1")
    assert rc == 0 and out.split() == ["plain,pick-gpu"]
    rc, out, _ = _ckptfix(_CKPTFIX_COMPLETE="bash_complete", COMP_WORDS="ckptfix scan --j", COMP_CWORD="2")
    assert rc == 0 and out.split() == ["plain,--json"]


def test_error_is_red_on_a_terminal(tmp_path):
    rc, out, err = _ckptfix("inspect", str(tmp_path / "nope.pt"), stderr_tty=True)
    assert rc == 3 and out == ""
    assert err.startswith(f"{ESC}31m{ESC}1mError:{ESC}0m ") or err.startswith(f"{ESC}1m{ESC}31mError:")
    assert err.count("\n") == 1


@pytest.mark.parametrize("env", [{"NO_COLOR": "1"}, {"TERM": "dumb"}])
def test_no_colour_when_asked_on_a_terminal(tmp_path, env):
    rc, _, err = _ckptfix("inspect", str(tmp_path / "nope.pt"), stderr_tty=True, **env)
    assert rc == 3 and err.startswith("Error: ") and ESC not in err


def test_no_colour_when_piped_unless_forced(tmp_path):
    rc, _, err = _ckptfix("inspect", str(tmp_path / "nope.pt"))
    assert rc == 3 and err.startswith("Error: ") and ESC not in err
    rc, _, err = _ckptfix("inspect", str(tmp_path / "nope.pt"), FORCE_COLOR="1")
    assert rc == 3 and ESC in err and "Error:" in err


def test_warn_and_error_line_follow_use_color(monkeypatch, capsys):
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("FORCE_COLOR", "1")
    _common.warn("careful")
    _common.error_line("broken")
    err = capsys.readouterr().err
    assert f"warning:{ESC}0m careful" in err and f"Error:{ESC}0m broken" in err
    monkeypatch.setenv("NO_COLOR", "1")
    _common.warn("careful")
    _common.error_line("broken")
    assert capsys.readouterr().err == "warning: careful\nError: broken\n"


def test_use_color_on_a_closed_or_plain_stream(monkeypatch):
    import io

    for k in ("NO_COLOR", "FORCE_COLOR"):
        monkeypatch.delenv(k, raising=False)
    assert _common.use_color(io.StringIO()) is False
    s = io.StringIO()
    s.close()
    assert _common.use_color(s) is False


def test_debug_shows_the_traceback_of_a_torch_missing_error(tmp_path):
    code = "import sys; sys.modules['torch'] = None\nfrom ckptfix.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    p = subprocess.run(
        [sys.executable, "-c", code, "--debug", "demo", "--out", str(tmp_path / "d")],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 14
    assert "Traceback" in p.stderr and p.stderr.rstrip().splitlines()[-1].startswith("Error: ckptfix demo needs torch")


def test_a_missing_module_that_is_not_torch_is_an_internal_error(tmp_path):
    code = (
        "import sys; sys.modules['ckptfix.ops.inspect'] = None\n"
        "from ckptfix.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code, "inspect", str(tmp_path)], env=_env(), capture_output=True, text=True, timeout=600
    )
    assert p.returncode == 1 and p.stderr.startswith("Error: internal error: ModuleNotFoundError")


def test_the_pre_commit_hook_scans_checkpoints_with_several_filenames():
    text = (REPO / ".pre-commit-hooks.yaml").read_text(encoding="utf-8")
    fields = dict(re.findall(r"^\s*-?\s*(id|entry|language|files|pass_filenames):\s*(.+?)\s*$", text, re.M))
    assert fields["id"] == "ckptfix-scan" and fields["entry"] == "ckptfix scan"
    assert fields["language"] == "python" and fields["pass_filenames"] == "true"
    files = re.compile(fields["files"].strip("'\""))
    for name in ("a.pt", "b/c.pth", "pytorch_model.bin", "last.ckpt", "model.safetensors", "X.PT"):
        assert files.search(name), name
    for name in ("train.py", "model.pt.txt", "README.md", "config.json"):
        assert not files.search(name), name


def test_docs_ci_shows_completion_for_every_shell_and_a_ci_step():
    text = (REPO / "docs" / "ci.md").read_text(encoding="utf-8")
    for shell in ("bash", "zsh", "fish"):
        assert f"_CKPTFIX_COMPLETE={shell}_source ckptfix" in text
    assert 'pip install "ckptfix @ git+$CKPTFIX_GIT_URL" && ckptfix scan $(git ls-files' in text
    assert "OWNER" not in text
    assert "id: ckptfix-scan" in text


def test_ctrl_c_says_nothing_was_written_and_exits_130(monkeypatch, capsys, dp_work):
    import ckptfix.ops.inspect

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(ckptfix.ops.inspect, "inspect_checkpoint", interrupted)
    monkeypatch.setattr("ckptfix.files.atomic.FINISHED", [])
    rc = main(["inspect", str(dp_work / "m.pt")])
    err = capsys.readouterr().err
    assert rc == 130
    assert err == "Error: interrupted; nothing was written\n"


def test_ctrl_c_names_what_was_kept(monkeypatch, capsys, dp_work):
    import ckptfix.ops.inspect

    monkeypatch.chdir(dp_work)
    monkeypatch.setattr("ckptfix.files.atomic.FINISHED", [])

    def half_done(*a, **k):
        with atomic_output(str(dp_work / "first.pt")) as f:
            f.write(b"done")
        with atomic_output(str(dp_work / "second.pt")) as f:
            f.write(b"half")
            raise KeyboardInterrupt

    monkeypatch.setattr(ckptfix.ops.inspect, "inspect_checkpoint", half_done)
    rc = main(["inspect", "m.pt"])
    err = capsys.readouterr().err
    assert rc == 130
    assert err.startswith("Error: interrupted; kept 1 output(s) finished before it: first.pt;"), err
    assert not (dp_work / "second.pt").exists()
    assert not [p for p in os.listdir(dp_work) if p.startswith(".second")]  # its temp file is gone


def test_a_real_sigint_gives_the_error_line(dp_work):
    code = (
        "import os, signal, sys, time\n"
        "import ckptfix.ops.inspect\n"
        "def hang(*a, **k):\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        # a hung inspect: it waits until the interrupt lands (the handler runs between bytecodes, maybe not
        # before this returns; returning None into the command would be an internal error, not the interrupt)
        "    while True:\n"
        "        time.sleep(0.05)\n"
        "ckptfix.ops.inspect.inspect_checkpoint = hang\n"
        "from ckptfix.cli import main\n"
        "sys.exit(main(['inspect', 'm.pt']))\n"
    )
    p = run_python(code, env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=dp_work)
    assert p.returncode == 130, p.stderr
    assert p.stderr == "Error: interrupted; nothing was written\n"


def test_exit_code_130_is_an_error_class():
    from ckptfix.errors import InterruptedByUserError, all_error_classes

    assert InterruptedByUserError in all_error_classes() and InterruptedByUserError.exit_code == 130
    assert issubclass(InterruptedByUserError, KeyboardInterrupt)


def test_command_list_does_not_cut_demo_to_nothing():
    r = run_cli("--help", COLUMNS="80")
    line = next(x for x in r.out.splitlines() if x.strip().startswith("demo "))
    assert "End-to-end: train..." not in line and not line.endswith("...")


def test_a_closed_stdout_pipe_ends_quietly(tmp_path):
    """``ckptfix scan FOLDER | head -1``: the reader goes away; the command ends with exit 0 and no message, as
    for a closed pipe elsewhere (Click turned the EPIPE into a silent exit 1)."""
    import json
    import pickle
    import struct
    import subprocess
    import sys

    d = tmp_path / "fold"
    d.mkdir()
    head = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(head)) + head + bytes(4))
    for i in range(3000):  # ~80 KB of `file` lines: more than a pipe holds, so a write meets the closed pipe
        (d / f"x{i}.pt").write_bytes(pickle.dumps({"a": i}))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    p = subprocess.Popen(
        [sys.executable, "-m", "ckptfix", "scan", str(d)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
    )  # fmt: skip
    assert p.stdout is not None and p.stderr is not None
    first = p.stdout.readline()
    p.stdout.close()
    err = p.stderr.read()
    rc = p.wait(timeout=300)
    assert first.startswith(str(d).encode())
    assert rc == 0 and err == b"", (rc, err)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("args", [["inspect"], ["inspect", "--json"], ["scan"], ["--help"]], ids=" ".join)
@pytest.mark.parametrize("unbuffered", [False, True], ids=["buffered", "PYTHONUNBUFFERED"])
def test_a_full_standard_output_is_one_error_line_not_an_internal_error(args, unbuffered, tmp_path):
    """stdout redirected to a full disk: ``Error: cannot write the output to standard output ...``, exit 9 (the
    output errors' code), in a plain shell's environment with and without ``PYTHONUNBUFFERED`` (buffered, the
    interpreter would flush what the failed write left in stdout's buffer again at exit: exit 120)."""
    from tests.helpers import CkptFactory, plain_env

    argv = [*args, str(CkptFactory(tmp_path).plain().path)] if args != ["--help"] else args
    env = plain_env(tmp_path, **({"PYTHONUNBUFFERED": "1"} if unbuffered else {}))
    with open("/dev/full", "w") as full:
        p = subprocess.run(
            [sys.executable, "-m", "ckptfix", *argv],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=120,
        )
    assert p.returncode == OutputError.exit_code, p.stderr
    assert p.stderr.startswith("Error: cannot write the output to standard output: No space left on device")
    assert p.stderr.count("\n") == 1 and "internal error" not in p.stderr
