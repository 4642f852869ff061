"""The ``demo`` command: train every kind of checkpoint, break it, fix it, verify it."""

from __future__ import annotations

import click

from ckptfix.cli._common import emit_json, info, json_option
from ckptfix.cli.group import cli
from ckptfix.train.config import DEVICES
from ckptfix.train.demo import DEMO_DEVICE, DEMO_EPOCHS, DEMO_OUT


@cli.command("demo", short_help="Train every kind of checkpoint, then fix and verify each.")
@click.option("--out", default=DEMO_OUT, show_default=True, type=click.Path(), help="Work directory.")
@click.option(
    "--device",
    type=click.Choice(DEVICES),
    default=DEMO_DEVICE,
    show_default=True,
    help="Train on this device ('auto': CUDA when present).",
)
@click.option("--epochs", type=int, default=DEMO_EPOCHS, show_default=True, help="Epochs per training run.")
@click.option("--quick", is_flag=True, help="In-process modes only (single, dp, DCP, legacy): no torchrun, no compile.")
@json_option
def demo_cmd(out: str, device: str, epochs: int, quick: bool, as_json: bool) -> None:
    """End-to-end: train single/dp/ddp/manual/compile/DCP/legacy/fsdp checkpoints, show what plain torch
    says about each, fix them (load_anywhere, sanitize, strip-prefix, convert) and prove every fix with
    plain torch / safetensors loads and bit-identical probe outputs."""
    from ckptfix.train.demo import check, format_summary, run_demo

    res = run_demo(out, device=device, epochs=epochs, progress=None if as_json else info, quick=quick)
    if as_json:
        emit_json(res.to_dict())
    else:
        click.echo(format_summary(res))
    check(res)
