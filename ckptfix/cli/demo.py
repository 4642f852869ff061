"""The ``demo`` command: train every kind of checkpoint, break it, fix it, verify it."""

from __future__ import annotations

import click

from ckptfix.cli import cli
from ckptfix.cli._common import emit_json, info, json_option


@cli.command("demo")
@click.option("--out", default="ckptfix-demo", show_default=True, type=click.Path(), help="Work directory.")
@click.option("--device", type=click.Choice(["cpu", "cuda", "auto"]), default="cpu", show_default=True,
              help="Train on this device ('auto': CUDA when present).")
@click.option("--epochs", default=1, show_default=True, help="Epochs per training run.")
@json_option
def demo_cmd(out: str, device: str, epochs: int, as_json: bool) -> None:
    """End-to-end: train single/dp/ddp/manual/compile/DCP/legacy checkpoints, then inspect, strip-prefix,
    convert and load_anywhere each one and prove the model's outputs match exactly."""
    from ckptfix.demo import check, format_summary, run_demo

    res = run_demo(out, device=device, epochs=epochs, progress=None if as_json else info)
    if as_json:
        emit_json(res.to_dict())
    else:
        click.echo(format_summary(res))
    check(res)
