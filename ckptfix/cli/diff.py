"""``ckptfix diff A B``: what differs between two checkpoints (exit 0 equal, 1 differ, as cmp and diff)."""

from __future__ import annotations

import click

from ckptfix._startup import imports_quietly
from ckptfix.cli._common import echo, emit_json, json_option
from ckptfix.cli.group import cli


@cli.command("diff")
@click.argument("a", type=click.Path())
@click.argument("b", type=click.Path())
@click.option("--key-a", default=None, help="Where A's state dict sits (e.g. 'state_dict_ema'); found otherwise.")
@click.option("--key-b", default=None, help="Where B's state dict sits; found otherwise.")
@click.option("--no-align", is_flag=True, help="Compare the raw keys (no wrapper prefixes matched).")
@click.option(
    "--map",
    "maps",
    multiple=True,
    metavar="A_PREFIX=B_PREFIX",
    help="Replace this leading prefix of A's keys (repeatable; e.g. --map module.=model., --map =model.).",
)
@click.option("--atol", type=click.FloatRange(min=0), default=1e-8, show_default=True, help="Absolute tolerance.")
@click.option("--rtol", type=click.FloatRange(min=0), default=1e-5, show_default=True, help="Relative tolerance.")
@click.option(
    "--dtype-cast", is_flag=True, help="Compare tensors of different dtypes (fp32 vs bf16: the cast's error)."
)
@click.option("--keys-only", is_flag=True, help="Compare names, shapes and dtypes only (no tensor bytes read).")
@click.option(
    "--jobs",
    "-j",
    type=click.IntRange(min=0),
    default=1,
    show_default=True,
    help="Tensors compared in parallel (0: one per CPU).",
)
@click.option("-q", "--quiet", is_flag=True, help="Print the summary line only (the exit code says the rest).")
@json_option
@click.pass_context
def diff_cmd(
    ctx: click.Context,
    a: str,
    b: str,
    key_a: str | None,
    key_b: str | None,
    no_align: bool,
    maps: tuple[str, ...],
    atol: float,
    rtol: float,
    dtype_cast: bool,
    keys_only: bool,
    jobs: int,
    quiet: bool,
    as_json: bool,
) -> None:
    """Compare checkpoints A and B (any formats, folders or URLs): keys, shapes, dtypes, values, other entries.

    Keys are aligned first (module., _orig_mod., Lightning's model. ... on either side). Tensors are read
    piece by piece (memory stays flat); bit equality needs no torch, the statistics of the tensors that
    differ use torch when installed. Exit 0 when equal within --atol/--rtol, 1 when they differ.

    \b
    ckptfix diff model.pt model.safetensors
    ckptfix diff run/epoch1.pt run/epoch2.pt --json
    ckptfix diff model.pt model-bf16.safetensors --dtype-cast --rtol 1e-2
    """
    with imports_quietly():
        from ckptfix.ops.diff import diff, render

    r = diff(
        a,
        b,
        atol=atol,
        rtol=rtol,
        align=not no_align,
        maps=maps,
        key_a=key_a,
        key_b=key_b,
        dtype_cast=dtype_cast,
        keys_only=keys_only,
        jobs=jobs,
    )
    if as_json:
        emit_json(r.to_dict())
    else:
        echo("\n".join(render(r, quiet)))
    if not r.equal:
        ctx.exit(1)
