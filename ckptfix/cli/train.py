"""``ckptfix train``: train a small model in a chosen parallel mode and save realistic checkpoints.

The choices and defaults come from :mod:`ckptfix.train.config`.  Torch is imported inside the
command only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from ckptfix.cli._common import emit_json, info, json_option, table
from ckptfix.cli.group import cli
from ckptfix.display import shown_path
from ckptfix.train.config import (
    ALLREDUCES,
    DEVICES,
    DISTRIBUTED_MODES,
    HPARAMS,
    INITS,
    MODELS,
    MODES,
    SAVE_FORMATS,
    SAVE_STYLES,
    TrainConfig,
    TrainResult,
    default,
)

if TYPE_CHECKING:
    from ckptfix.train.bench import BenchResult


def _given(ctx: click.Context) -> set[str]:
    """The TrainConfig fields the user set on the command line (``compile_`` is ``compile``)."""
    out = set()
    for name in ctx.params:
        src = ctx.get_parameter_source(name)
        if src is not None and src != click.core.ParameterSource.DEFAULT:
            out.add(name.rstrip("_"))
    return out


def _data_path(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """``--data``: the word ``digits`` (the bundled real digits), or an existing file."""
    if value is None or value == "digits":
        return value
    return str(click.Path(exists=True, dir_okay=False).convert(value, param, ctx))


@cli.command("train")
@click.option(
    "--mode",
    type=click.Choice(MODES),
    default=default("mode"),
    show_default=True,
    help="single device; nn.DataParallel; DDP under torchrun; hand-written data parallelism; "
    "FSDP2 (fully_shard) under torchrun.",
)
@click.option(
    "--model",
    type=click.Choice(MODELS),
    default=default("model"),
    show_default=True,
    help="LeNet-5 (2 conv + avg-pool + 2 linear), a small ResNet with BatchNorm, or the "
    "hand-written multi-GPU tutorial's LeNet (plain parameter list, functional forward).",
)
@click.option(
    "--init",
    type=click.Choice(INITS),
    default=default("init"),
    show_default=True,
    help="--model tutorial: He-scaled weights N(0, sqrt(2/fan_in)), or the tutorial's N(0, 0.01) (which "
    "stays at chance for ~500 plain-SGD steps: 60 epochs of the bundled data).",
)
@click.option(
    "--out",
    "out",
    type=click.Path(file_okay=False),
    default=default("out"),
    show_default=True,
    help="Output directory (checkpoints, probe sidecars, checkpoints.json).",
)
@click.option(
    "--epochs",
    type=int,
    default=default("epochs"),
    show_default=True,
    help="Total epochs (a resumed run continues up to it).",
)
@click.option(
    "--batch-size",
    type=int,
    default=default("batch_size"),
    show_default=True,
    help="Batch size (per process in ddp/fsdp).",
)
@click.option(
    "--lr",
    type=float,
    default=default("lr"),
    show_default=True,
    help="SGD learning rate (on --resume: the checkpoint's unless given).",
)
@click.option(
    "--momentum",
    type=float,
    default=default("momentum"),
    show_default=True,
    help="SGD momentum; 0 is plain minibatch SGD (on --resume: the checkpoint's unless given).",
)
@click.option(
    "--weight-decay",
    type=float,
    default=default("weight_decay"),
    show_default=True,
    help="SGD weight decay (on --resume: the checkpoint's unless given).",
)
@click.option(
    "--seed", type=int, default=default("seed"), show_default=True, help="Seed for data, weights and shuffling."
)
@click.option("--device", type=click.Choice(DEVICES), default=default("device"), show_default=True)
@click.option("--nproc", type=int, default=None, help="ddp/fsdp: processes torchrun starts [GPU count, or 2 on CPU].")
@click.option("--replicas", type=int, default=None, help="manual: replicas [GPU count, or 2 on CPU].")
@click.option(
    "--allreduce",
    type=click.Choice(ALLREDUCES),
    default=default("allreduce"),
    show_default=True,
    help="manual: the hand-written gradient all-reduce.",
)
@click.option("--amp", is_flag=True, help="Mixed precision: fp16 autocast + GradScaler on CUDA, bf16 autocast on CPU.")
@click.option("--compile", "compile_", is_flag=True, help="torch.compile the model (keys gain _orig_mod.).")
@click.option(
    "--compile-backend",
    default=default("compile_backend"),
    show_default=True,
    help="torch.compile backend (eager keeps CPU runs to seconds; inductor for real speed).",
)
@click.option(
    "--save-style",
    type=click.Choice(SAVE_STYLES),
    default=default("save_style"),
    show_default=True,
    help="wrapped: the wrapper's state dict with its prefixes (what most scripts save); clean: the module's.",
)
@click.option(
    "--save-format",
    type=click.Choice(SAVE_FORMATS),
    default=None,
    help="pt: torch.save file; dcp: torch.distributed.checkpoint directory [pt; dcp for fsdp: sharded, "
    "each rank writes its own shards].",
)
@click.option("--legacy-format", is_flag=True, help="torch.save with _use_new_zipfile_serialization=False.")
@click.option(
    "--namespace-args",
    is_flag=True,
    help="Store 'args' as an argparse.Namespace (as many scripts do; breaks weights_only loading).",
)
@click.option(
    "--resume",
    type=click.Path(exists=True),
    default=None,
    help="Resume from any checkpoint ckptfix can load (any mode, prefix or format).",
)
@click.option("--force", is_flag=True, help="Overwrite files in --out that another run wrote.")
@click.option(
    "--data",
    default=None,
    callback=_data_path,
    metavar="PATH|digits",
    help="A .pt/.npz file with 'images' uint8 [N,28,28] and 'labels' int64 [N] instead of synthetic data; "
    "'digits': the bundled 1,797 real handwritten digits (UCI, 8x8 upsampled; ./digits for a file of that name).",
)
@click.option(
    "--train-samples", type=int, default=default("train_samples"), show_default=True, help="Synthetic training samples."
)
@click.option(
    "--test-samples", type=int, default=default("test_samples"), show_default=True, help="Synthetic test samples."
)
@click.option(
    "--show-split",
    is_flag=True,
    help="dp/manual: print every batch's per-replica sizes, as the DataParallel tutorial does.",
)
@click.option(
    "--name",
    default=None,
    help="File name stem [derived from the options, e.g. ddp-amp-clean; resumed runs add -resumed-from-X].",
)
@click.option(
    "--threads",
    type=int,
    default=None,
    help="torch intra-op threads for in-process modes [1 on CPU; torch's default on CUDA].",
)
@click.option(
    "--bench",
    is_flag=True,
    help="Benchmark single / dp / manual / ddp / fsdp (ddp+amp on CUDA; +amp rows with --amp) instead.",
)
@click.option(
    "-q",
    "--quiet",
    is_flag=True,
    help="No per-epoch progress on stderr; the results table (stdout) and warnings still print.",
)
@json_option
@click.pass_context
def train_cmd(ctx: click.Context, as_json: bool, bench: bool, compile_: bool, **kw: Any) -> int:
    """Train a small model in one of five parallel modes and save realistic checkpoints.

    Every epoch writes a wrapper dict (epoch, model_state_dict,
    optimizer_state_dict, scaler_state_dict with --amp, args) and
    OUT/checkpoints.json lists each file with its mode, devices, world size,
    save style, expected key prefix and the model's output on a fixed probe
    batch.

    \b
    Examples:
      ckptfix train --mode dp --out runs            # module.* keys, even on CPU
      ckptfix train --mode ddp --nproc 2 --out runs # torchrun, gloo on CPU
      ckptfix train --mode fsdp --nproc 2 --out runs  # FSDP2, sharded DCP
      ckptfix train --mode single --compile --out runs
      ckptfix train --mode single --resume runs/ddp_epoch1.pt --epochs 3
      ckptfix train --mode manual --model tutorial --lr 0.2 --momentum 0 --batch-size 256 --replicas 2
      ckptfix train --bench
    """
    from ckptfix.errors import TrainingError
    from ckptfix.train.bench import bench_from_config, check_bench_options
    from ckptfix.train.entry import check_options, train

    given = _given(ctx)
    cfg = TrainConfig(compile=compile_, explicit=tuple(h for h in HPARAMS if h in given), **kw)
    try:
        if bench:
            check_bench_options(cfg, given)
        else:
            check_options(cfg)
    except TrainingError as e:
        raise click.UsageError(str(e), ctx) from None
    if bench:
        _render_bench(bench_from_config(cfg, given), as_json)
    else:
        _render_train(train(cfg), as_json, quiet=cfg.quiet)
    return 0


def _render_train(res: TrainResult, as_json: bool, *, quiet: bool) -> None:
    if not res.checkpoints:  # a non-zero rank of the user's own torchrun: rank 0 reports
        return
    if as_json:
        emit_json(res.to_dict())
        return
    rows = [
        [c["path"], str(c["epoch"]), repr(c["expected_prefix"]), c["save_format"], f"{c['accuracy']:.1%}"]
        for c in res.checkpoints
    ]
    click.echo(table(rows, ["checkpoint", "epoch", "prefix", "format", "test acc"]))
    n = res.world_size if res.mode in DISTRIBUTED_MODES else len(res.devices)
    click.echo(
        f"{res.mode} on {n} x {res.devices[0]}: "
        f"{res.sec_per_epoch:.3f} s/epoch, {res.samples_per_sec:,.0f} samples/s, "
        f"final accuracy {res.final_accuracy:.1%}"
    )
    click.echo(f"manifest: {shown_path(res.manifest)}")
    if not quiet:
        info(f"done: {len(res.checkpoints)} checkpoint(s) in {shown_path(res.out_dir)}")


def _render_bench(res: BenchResult, as_json: bool) -> None:
    for note in res.notes:
        info(note)
    if res.skipped:
        info("left out: " + ", ".join(res.skipped))
    if as_json:
        emit_json(res.to_dict())
        return
    body = [
        [
            r.mode + (f" ({r.amp_dtype})" if r.amp_dtype else ""),
            r.devices,
            str(r.world_size),
            f"{r.sec_per_epoch:.3f}",
            f"{r.samples_per_sec:,.0f}",
            f"{r.final_accuracy:.1%}",
            f"{r.wall_seconds:.1f}",
        ]
        for r in res.rows
    ]
    click.echo(table(body, ["mode", "devices", "world size", "s/epoch", "samples/s", "final acc", "wall s"]))
    if res.out_dir:
        click.echo(f"checkpoints: {shown_path(res.out_dir)}")
