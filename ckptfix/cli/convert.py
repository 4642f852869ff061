"""``ckptfix convert``: checkpoint -> safetensors (and safetensors -> .pth). No torch at import time."""

from __future__ import annotations

from typing import Any

import click

from ckptfix._startup import imports_quietly
from ckptfix.cli._common import ProgressBar, echo, emit_json, human_bytes, info, json_option, warn
from ckptfix.cli.group import cli


@cli.command("convert")
@click.argument("src", type=click.Path())
@click.option(
    "-o",
    "--output",
    "output",
    type=click.Path(),
    help="Output path (default: SRC with .safetensors; SRC.pth for a safetensors input; DIR.dcp: a DCP checkpoint).",
)
@click.option(
    "--to",
    "to",
    type=click.Choice(["safetensors", "pt", "dcp"]),
    default=None,
    help="Output format when -o does not say (dcp: a torch.distributed.checkpoint directory; imports torch).",
)
@click.option(
    "--jobs",
    "-j",
    type=click.IntRange(min=0),
    default=1,
    show_default=True,
    help="Tensors/shards written in parallel (0: one per CPU); a local copy runs as N streams (at least 2 from "
    "64 MiB on 2+ CPUs); same output bytes for any N.",
)
@click.option(
    "--shards",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    metavar="K",
    help="DCP output: write it as K ranks would (K .distcp files, tensors split along dim 0).",
)
@click.option("--force", is_flag=True, help="Overwrite an existing output.")
@click.option("--strip-prefix", "strip", is_flag=True, help="Strip wrapper prefixes (module., _orig_mod., ...).")
@click.option(
    "--prefix",
    "prefix",
    default=None,
    metavar="PREFIX",
    help="Strip exactly this prefix from the keys that carry it, as strip-prefix --prefix (e.g. module. of an EMA).",
)
@click.option("--key", default=None, help="Where the state dict is in the checkpoint, e.g. model or model/state_dict.")
@click.option(
    "--max-shard-size",
    default=None,
    metavar="SIZE",
    help="Shard the output, e.g. 5GB (decimal: 5*10^9 bytes; 5GiB is binary; a bare number is bytes) "
    "-> stem-00001-of-0000N.safetensors + index.",
)
@click.option(
    "--keep",
    "keep",
    multiple=True,
    metavar="NAME",
    help="Of tied tensors, store this name (repeatable); default: what transformers keeps.",
)
@click.option(
    "--drop",
    "drop",
    multiple=True,
    metavar="PATTERN",
    help="Leave out tensors whose name or dotted path matches PATTERN (fnmatch; repeatable). Without it, "
    "a state dict holding tensors the output cannot (quantized packed params) is refused (exit 8); tensors "
    "outside the state dict (an EMA copy, callbacks) are left out and listed as excluded.",
)
@click.option(
    "--strict",
    "--keep-all",
    "strict",
    is_flag=True,
    help="Refuse (exit 8) when any tensor of the input, also outside the state dict, would be missing.",
)
@click.option("--include-optimizer", is_flag=True, help="Also write optimizer tensors, as optimizer.<path>.")
@click.option(
    "--restore-wrapper",
    is_flag=True,
    help="Back to torch: rebuild the checkpoint dict (epoch, hyper-parameters, ...) around the state dict.",
)
@click.option("--no-verify", is_flag=True, help="Skip re-reading the output and comparing it with the source.")
@click.option("--fsync", is_flag=True, help="fsync the output and its directory before returning.")
@click.option(
    "--allow-global",
    "allow_globals",
    multiple=True,
    metavar="NAME",
    help="Allow this pickle global when torch loading is needed (repeatable).",
)
@click.option("--trust", is_flag=True, help="Trust the file completely when torch loading is needed.")
@click.option(
    "--allow-expand",
    is_flag=True,
    help="Write outputs over 4x the input + 64 MiB (expanded / stride-0 tensors written densely).",
)
@click.option(
    "--tag",
    default=None,
    metavar="TAG",
    help="DeepSpeed ZeRO folder: the tag to consolidate (e.g. global_step14) instead of what 'latest' names.",
)
@click.option(
    "--dtype",
    type=click.Choice(["fp32", "bf16", "fp16"]),
    default=None,
    help="DeepSpeed ZeRO folder: write the floating tensors in this dtype (default fp32, as zero_to_fp32).",
)
@click.option(
    "--component",
    default=None,
    metavar="NAME",
    help="A diffusers pipeline or sentence-transformers folder: convert only this component (unet, 2_Dense), "
    "to its own folder, or to one file with -o NAME.safetensors.",
)
@click.option(
    "--stats",
    "show_stats",
    is_flag=True,
    help='Print the bytes read and requests made (a URL input) to stderr; --json gains a "stats" object.',
)
@click.option("--quiet", "-q", is_flag=True, help="Print nothing but errors.")
@json_option
def convert_cmd(
    src: str,
    output: str | None,
    to: str | None,
    jobs: int,
    shards: int,
    force: bool,
    strip: bool,
    prefix: str | None,
    key: str | None,
    max_shard_size: str | None,
    keep: tuple[str, ...],
    drop: tuple[str, ...],
    strict: bool,
    include_optimizer: bool,
    restore_wrapper: bool,
    no_verify: bool,
    fsync: bool,
    allow_globals: tuple[str, ...],
    trust: bool,
    allow_expand: bool,
    tag: str | None,
    dtype: str | None,
    component: str | None,
    quiet: bool,
    as_json: bool,
    show_stats: bool = False,
) -> None:
    """Convert SRC to safetensors without loading it (or a .safetensors back to .pth).

    \b
    ckptfix convert model.pth                      # -> model.safetensors
    ckptfix convert model.ckpt --strip-prefix -o out/model.safetensors
    ckptfix convert big.pth --max-shard-size 5GB   # -> big-00001-of-0000N.safetensors + index
    ckptfix convert model.safetensors -o model.pth
    ckptfix convert model.safetensors -o ckpt.pth --restore-wrapper   # epoch, ... too
    ckptfix convert run.dcp -o model.safetensors --jobs 4
    ckptfix convert model.safetensors -o start.dcp --shards 4  # DCP as 4 ranks (torch)
    ckptfix convert ds_ckpt/ -o model.safetensors  # DeepSpeed ZeRO 1/2/3 ('latest'; --tag, --dtype bf16)
    ckptfix convert sd_pipeline/ -o sd_st/         # diffusers pipeline: every component (--component unet)
    ckptfix convert s3://bucket/run/model.pt -o model.safetensors --jobs 8 --stats
    ckptfix convert model.pt -o s3://bucket/model.safetensors   # verified locally, then uploaded

    The input is never modified.  Tied/shared tensors are stored once and
    recorded in the metadata; ckptfix's loader restores them.
    """
    with imports_quietly():
        from ckptfix.ops.convert import ConvertOptions, OutputOptions, convert, parse_size

    if max_shard_size is not None:
        try:
            parse_size(max_shard_size)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--max-shard-size") from None

    import contextlib

    bar = ProgressBar("converting", enabled=not quiet and not as_json)
    outputs = OutputOptions(
        output=output, force=force, fsync=fsync, verify=not no_verify, jobs=jobs, key=key, progress=bar.update
    )
    options = ConvertOptions(
        to=to,
        strip_prefix=prefix if prefix else bool(strip),
        max_shard_size=max_shard_size or None,
        include_optimizer=include_optimizer,
        allow_globals=tuple(allow_globals or ()),
        trust=trust,
        keep=tuple(keep or ()),
        allow_expand=allow_expand,
        drop=tuple(drop or ()),
        strict=strict,
        restore_wrapper=restore_wrapper,
        shards=shards,
        tag=tag,
        dtype=dtype,
        component=component,
    )
    stats: Any = None
    counting: Any = contextlib.nullcontext()
    if show_stats:
        from ckptfix.files.remote.stats import collect

        counting = collect()
    try:  # an option the direction taken does not use is refused (exit 32), nothing written
        with counting as stats:
            report = convert(src, outputs=outputs, options=options)
    finally:
        bar.close()
    if as_json:
        doc = report.to_dict()
        if stats is not None:
            doc["stats"] = stats.to_json()
        emit_json(doc)
    elif not quiet:
        from ckptfix.display import shown_path

        for p in report.outputs:
            echo(shown_path(p))
        if report.index:
            echo(shown_path(report.index))
        _summary(report)
    if stats is not None:  # after everything else: what the command transferred
        echo(stats.line(), err=True)


def _summary(r: Any) -> None:
    n = f"{r.tensors} tensor{'s' if r.tensors != 1 else ''}"
    if r.aliases and r.direction == "to-safetensors":
        n += f" (+{len(r.aliases)} alias{'es' if len(r.aliases) != 1 else ''})"
    parts = [n, human_bytes(r.bytes), "verified" if r.verified else "not verified", f"{r.seconds:.2f} s"]
    from ckptfix.display import shown_path

    info(f"converted {shown_path(r.source)} ({r.source_format}): " + ", ".join(parts))
    if getattr(r, "unnamed", ""):
        info(f"the file holds {r.unnamed}")
    if r.key_path:
        where = "taken from" if r.direction == "to-safetensors" else "put back under"
        info(f"state dict {where} {'/'.join(r.key_path)}")
    if r.aliases:
        what = "stored once" if r.direction == "to-safetensors" else "restored as shared"
        rule = f" (kept by {r.tied_rule})" if getattr(r, "tied_rule", None) else ""
        info(
            f"{len(r.aliases)} shared tensor(s) {what}{rule}: "
            + ", ".join(f"{a} -> {s}" for a, s in list(r.aliases.items())[:5])
            + (" ..." if len(r.aliases) > 5 else "")
        )
    subs = getattr(r, "subclasses", {})
    if subs:
        how = (
            "written as their inner tensors in torchao's safetensors layout (the class in __metadata__)"
            if r.direction == "to-safetensors"
            else "rebuilt as torchao tensors (torch.load needs torchao imported)"
        )
        info(
            f"{len(subs)} torchao tensor(s) {how}: "
            + ", ".join(f"{n} ({c})" for n, c in list(subs.items())[:2])
            + (" ..." if len(subs) > 2 else "")
        )
    if r.renamed:
        info(f"stripped prefixes from {r.renamed} key(s)")
    if getattr(r, "kept_names", ""):
        info(r.kept_names)
    if r.excluded:
        detail = getattr(r, "excluded_detail", {})
        info("excluded: " + ", ".join(f"{e} ({detail.get(e, '--include-optimizer')})" for e in r.excluded))
    if getattr(r, "dropped", None):
        info(
            f"dropped on request (--drop): {len(r.dropped)} tensor(s): "
            + ", ".join(r.dropped[:5])
            + (" ..." if len(r.dropped) > 5 else "")
        )
    for name, c in getattr(r, "components", {}).items():
        outs = ", ".join(shown_path(p) for p in c["outputs"]) or "no weights (copied as it is)"
        info(f"component {name} ({c['kind']}): {outs}" + (f"; {c['problem']}" if c.get("problem") else ""))
    for f, why in getattr(r, "not_converted", {}).items():
        warn(f"not converted: {f} ({why})")
    if r.copied_views:
        info(f"{len(r.copied_views)} view(s) sharing a storage written as separate copies")
    if r.converted:
        info(
            f"{len(r.converted)} non-tensor entr(y/ies) kept in the metadata as plain data: "
            + ", ".join(f"{p} ({c})" for p, c in list(r.converted.items())[:3])
            + (" ..." if len(r.converted) > 3 else "")
        )
    if r.skipped:
        warn(
            f"{len(r.skipped)} non-tensor entr(y/ies) not representable in metadata: "
            + ", ".join(list(r.skipped)[:5])
            + (" ..." if len(r.skipped) > 5 else "")
        )
