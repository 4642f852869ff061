"""Docs that cannot drift: every command has help and a reference section, the exit-code tables equal
``ckptfix/errors.py``, and the doctests of the pure modules run."""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import click
import pytest

from ckptfix.cli import cli, main
from ckptfix.cli.group import load_all
from ckptfix.errors import all_error_classes

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
ERRORS = {(int(c.exit_code), c.__name__) for c in all_error_classes()}


def _commands(group: click.Group = cli, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    load_all()  # the command modules are imported lazily
    out = []
    for name, cmd in sorted(group.commands.items()):
        out.append(prefix + (name,))
        if isinstance(cmd, click.Group):
            out += _commands(cmd, prefix + (name,))
    return out


def _gen_exit_codes():
    spec = importlib.util.spec_from_file_location("gen_exit_codes", REPO / "docs" / "gen_exit_codes.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _table_rows(text: str) -> set[tuple[int, str]]:
    """(code, class name) of every ``| code | `ClassName` | ... |`` row in ``text``."""
    return {(int(m.group(1)), m.group(2)) for m in re.finditer(r"^\|\s*(\d+)\s*\|\s*`(\w+)`\s*\|", text, re.M)}


def test_the_cli_has_the_commands_the_readme_promises():
    names = {c[0] for c in _commands()}
    assert {
        "inspect",
        "scan",
        "strip-prefix",
        "add-prefix",
        "align",
        "convert",
        "gpus",
        "pick-gpu",
        "doctor",
        "train",
        "demo",
    } <= names


@pytest.mark.parametrize("path", _commands(), ids=" ".join)
def test_every_command_has_help(path, capsys):
    assert main([*path, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"Usage: ckptfix {' '.join(path)}")
    cmd = cli
    for name in path:
        cmd = cmd.commands[name]  # type: ignore[attr-defined]
    assert (cmd.help or "").strip(), f"ckptfix {' '.join(path)} has no help text"


@pytest.mark.parametrize("path", _commands(), ids=" ".join)
def test_every_command_has_a_docs_section(path):
    """A Markdown heading naming ``ckptfix <command>`` in README.md or docs/."""
    name = re.escape("ckptfix " + " ".join(path))
    heading = re.compile(rf"^#+ .*{name}(?![\w-])", re.M)
    where = [p.relative_to(REPO) for p in DOCS if heading.search(p.read_text(encoding="utf-8"))]
    assert where, f"no heading for `ckptfix {' '.join(path)}` in README.md or docs/*.md"


def test_docs_exit_codes_is_generated_from_errors_py():
    gen = _gen_exit_codes()
    text = (REPO / "docs" / "exit-codes.md").read_text(encoding="utf-8")
    assert text == gen.render(), "docs/exit-codes.md is out of date: run python docs/gen_exit_codes.py"
    assert _table_rows(text) == ERRORS


def test_every_exit_code_is_distinct():
    codes = [code for code, _ in ERRORS]
    assert len(codes) == len(set(codes))


def test_readme_exit_codes_match_errors_py_or_link_to_the_generated_page():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    rows = _table_rows(readme)
    if rows:
        assert rows == ERRORS, "the README's exit-code table differs from ckptfix/errors.py"
    else:
        assert "docs/exit-codes.md" in readme


def _modules_with_examples() -> list[str]:
    """Every ckptfix module whose source holds a ``>>>`` example, by dotted name."""
    out = []
    for path in sorted((REPO / "ckptfix").rglob("*.py")):
        if ">>>" in path.read_text(encoding="utf-8"):
            parts = path.relative_to(REPO).with_suffix("").parts
            out.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


# pure functions of key names, text and nvidia-smi/CUDA_VISIBLE_DEVICES strings: their examples are the spec
PURE_MODULES = ("ckptfix.ops.prefixes", "ckptfix.text", "ckptfix.gpu.cvd", "ckptfix.gpu.parse")


def test_the_pure_modules_have_examples():
    assert set(PURE_MODULES) <= set(_modules_with_examples())


@pytest.mark.parametrize("module", _modules_with_examples())
def test_doctests_run(module):
    """Every ``>>>`` example in ckptfix runs and prints what it shows (or says ``# doctest: +SKIP``)."""
    res = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS, report=False)
    assert res.failed == 0, f"{module}: {res.failed} of {res.attempted} examples fail (python -m doctest -v)"
    if module in PURE_MODULES:
        assert res.attempted > 0


@pytest.mark.slow
def test_console_blocks_match_real_runs():
    """Every marked console block in README.md and docs/ is what the commands print today.

    Pages whose inputs (commands, the ckptfix sources they import, versions) match their stamp in
    docs/gen_docs.stamps.json are not run again (tests/test_gen_docs.py).  No wall-clock budget: a loaded
    machine is slow, not broken; gen_docs.py stops a block that hangs and names it."""
    gen = REPO / "docs" / "gen_docs.py"
    p = subprocess.run([sys.executable, str(gen), "--check"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-4000:]


def test_readme_console_blocks_are_all_regenerated():
    """No hand-written console block in the README: each has a ``<!-- run: -->`` marker."""
    lines = (REPO / "README.md").read_text(encoding="utf-8").split("\n")
    for i, line in enumerate(lines):
        if line.startswith("```console"):
            assert lines[i - 1].startswith("<!-- run:"), f"README.md:{i + 1}: console block without a run marker"


# ``pip install ckptfix`` / ``pip install "ckptfix[torch]"``: the package is not on PyPI yet, so such a line
# installs nothing today, or whatever someone later uploads under that name (issue #38)
_INDEX_INSTALL = re.compile(r"""pip install\s+["']?ckptfix(\[[\w,]+\])?["']?(?!\s*@)(?=[\s`"']|$)""", re.M)


def _shipped_texts() -> list[Path]:
    files = [*DOCS, REPO / ".pre-commit-hooks.yaml", *(REPO / "ckptfix").rglob("*.py")]
    files += [*(REPO / "benchmarks").rglob("*.py"), *(REPO / "examples").rglob("*")]
    return [f for f in files if f.is_file()]


def test_no_install_line_names_the_unpublished_package():
    found = []
    for f in _shipped_texts():
        text = f.read_text(encoding="utf-8", errors="replace")
        for m in _INDEX_INSTALL.finditer(text):
            found.append(f"{f.relative_to(REPO)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}")
    assert not found, "\n".join(found)


def test_the_install_docs_say_the_package_is_not_published_yet():
    for page in (REPO / "README.md", REPO / "docs" / "ci.md"):
        text = page.read_text(encoding="utf-8")
        assert "not published on PyPI yet" in text, page
        assert "pip install ." in text, page


_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub makes of a page's headings (lowercase, punctuation dropped, spaces -> '-')."""
    out: set[str] = set()
    in_code = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        title = line.lstrip("#").strip().lower()
        out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def test_every_relative_link_of_the_docs_resolves():
    """A link from a page names a file that exists, relative to that page, and a heading of it when it names one
    (docs/sections/checkpoints.md linked docs/sections/convert.md from docs/sections/: issue #38 item 7)."""
    broken = []
    for page in DOCS:
        text = page.read_text(encoding="utf-8")
        text = re.sub(r"```.*?```", "", text, flags=re.S)
        for target in _LINK.findall(text):
            if re.match(r"[a-z]+:", target) or target.startswith("<"):
                continue  # a URL, mailto:
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
