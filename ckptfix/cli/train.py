"""``ckptfix train``: train a small model in a chosen parallel mode and save realistic checkpoints.

Torch is imported inside the command only.
"""

from __future__ import annotations

import click

from ckptfix.cli import cli
from ckptfix.cli._common import emit_json, info, json_option, table

_MODES = ["single", "dp", "ddp", "manual"]


@cli.command("train")
@click.option("--mode", type=click.Choice(_MODES), default="single", show_default=True,
              help="single device; nn.DataParallel; DDP under torchrun; hand-written data parallelism.")
@click.option("--model", type=click.Choice(["lenet", "resnet"]), default="lenet", show_default=True,
              help="LeNet (2 conv + avg-pool + 2 linear) or a small ResNet with BatchNorm.")
@click.option("--out", "out", type=click.Path(file_okay=False), default="ckptfix-train", show_default=True,
              help="Output directory (checkpoints, probe sidecars, checkpoints.json).")
@click.option("--epochs", type=int, default=2, show_default=True, help="Total epochs (a resumed run continues up to it).")
@click.option("--batch-size", type=int, default=64, show_default=True, help="Batch size (per process in ddp).")
@click.option("--lr", type=float, default=0.05, show_default=True, help="SGD learning rate (momentum 0.9).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for data, weights and shuffling.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--nproc", type=int, default=None, help="ddp: processes torchrun starts [GPU count, or 2 on CPU].")
@click.option("--replicas", type=int, default=None, help="manual: replicas [GPU count, or 2 on CPU].")
@click.option("--allreduce", type=click.Choice(["ring", "naive"]), default="ring", show_default=True,
              help="manual: the hand-written gradient all-reduce.")
@click.option("--amp", is_flag=True, help="Mixed precision: fp16 autocast + GradScaler on CUDA, bf16 autocast on CPU.")
@click.option("--compile", "compile_", is_flag=True, help="torch.compile the model (keys gain _orig_mod.).")
@click.option("--compile-backend", default="eager", show_default=True,
              help="torch.compile backend (eager keeps CPU runs to seconds; inductor for real speed).")
@click.option("--save-style", type=click.Choice(["wrapped", "clean"]), default="wrapped", show_default=True,
              help="wrapped: the wrapper's state dict with its prefixes (what most scripts save); clean: the module's.")
@click.option("--save-format", type=click.Choice(["pt", "dcp"]), default="pt", show_default=True,
              help="pt: torch.save file; dcp: torch.distributed.checkpoint directory (one shard per rank).")
@click.option("--legacy-format", is_flag=True, help="torch.save with _use_new_zipfile_serialization=False.")
@click.option("--namespace-args", is_flag=True,
              help="Store 'args' as an argparse.Namespace (as many scripts do; breaks weights_only loading).")
@click.option("--resume", type=click.Path(exists=True), default=None,
              help="Resume from any checkpoint ckptfix can load (any mode, prefix or format).")
@click.option("--data", type=click.Path(exists=True, dir_okay=False), default=None,
              help="A .pt/.npz file with 'images' uint8 [N,28,28] and 'labels' int64 [N] instead of synthetic data.")
@click.option("--train-samples", type=int, default=2048, show_default=True, help="Synthetic training samples.")
@click.option("--test-samples", type=int, default=512, show_default=True, help="Synthetic test samples.")
@click.option("--show-split", is_flag=True, help="dp: print per-replica batch sizes, as the DataParallel tutorial does.")
@click.option("--name", default=None, help="File name stem [derived from the options, e.g. ddp-amp-clean].")
@click.option("--threads", type=int, default=None, help="torch intra-op threads for in-process modes.")
@click.option("--bench", is_flag=True, help="Benchmark single / dp / manual / ddp (and ddp+amp on CUDA) instead.")
@click.option("-q", "--quiet", is_flag=True, help="No progress on stderr.")
@json_option
def train_cmd(as_json: bool, bench: bool, compile_: bool, **kw: object) -> int:
    """Train a small model in one of four parallel modes and save realistic checkpoints.

    Every epoch writes a wrapper dict (epoch, model_state_dict,
    optimizer_state_dict, scaler_state_dict with --amp, args) and
    OUT/checkpoints.json lists each file with its mode, devices, world size,
    save style, expected key prefix and the model's output on a fixed probe
    batch.

    \b
    Examples:
      ckptfix train --mode dp --out runs            # module.* keys, even on CPU
      ckptfix train --mode ddp --nproc 2 --out runs # torchrun, gloo on CPU
      ckptfix train --mode single --compile --out runs
      ckptfix train --mode single --resume runs/ddp_epoch1.pt --epochs 3
      ckptfix train --bench
    """
    from ckptfix.train.config import TrainConfig

    cfg = TrainConfig(compile=compile_, **kw)  # type: ignore[arg-type]
    if bench:
        from ckptfix.train.bench import bench as run_bench, format_table

        rows = run_bench(
            out=None, device=cfg.device, epochs=cfg.epochs, nproc=cfg.nproc, quiet=cfg.quiet,
            model=cfg.model, batch_size=cfg.batch_size, lr=cfg.lr, seed=cfg.seed,
            train_samples=cfg.train_samples, test_samples=cfg.test_samples, data=cfg.data,
            **({"threads": cfg.threads} if cfg.threads else {}),
        )
        if as_json:
            emit_json({"bench": [r.to_dict() for r in rows]})
        else:
            click.echo(format_table(rows))
        return 0

    from ckptfix.train import train
    from ckptfix.train.ddp import under_torchrun

    res = train(cfg)
    if under_torchrun() and not res.checkpoints:  # a non-zero rank of the user's own torchrun: rank 0 reports
        return 0
    if as_json:
        emit_json(res.to_dict())
        return 0
    rows = [
        [c["path"], str(c["epoch"]), repr(c["expected_prefix"]), c["save_format"], f"{c['accuracy']:.1%}"]
        for c in res.checkpoints
    ]
    click.echo(table(rows, ["checkpoint", "epoch", "prefix", "format", "test acc"]))
    click.echo(
        f"{res.mode} on {res.world_size if res.mode == 'ddp' else len(res.devices)} x {res.devices[0]}: "
        f"{res.sec_per_epoch:.3f} s/epoch, {res.samples_per_sec:,.0f} samples/s, final accuracy {res.final_accuracy:.1%}"
    )
    click.echo(f"manifest: {res.manifest}")
    if not cfg.quiet:
        info(f"done: {len(res.checkpoints)} checkpoint(s) in {res.out_dir}")
    return 0
