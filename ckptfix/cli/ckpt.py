"""Checkpoint commands: inspect, scan (torch-free)."""

from __future__ import annotations

import click

from ckptfix.cli import cli
from ckptfix.cli._common import emit_json, human_bytes, json_option


def _fmt_counts(d: dict) -> str:
    return ", ".join(f"{k} x{v}" for k, v in d.items()) or "-"


@cli.command("inspect")
@click.argument("checkpoint", type=click.Path())
@click.option("--key", default=None, help="Where the state dict sits, e.g. 'model' or 'model/state_dict'.")
@json_option
def inspect_cmd(checkpoint: str, key: str | None, as_json: bool) -> None:
    """Summarise CHECKPOINT without loading tensors or running pickle code."""
    from ckptfix.inspecting import inspect_checkpoint

    r = inspect_checkpoint(checkpoint, key=key)
    if as_json:
        emit_json(r.to_dict())
        return
    where = "/".join(r.state_dict_key) or "(top level)"
    lines = [
        f"{r.path}",
        f"  format        {r.format}, {human_bytes(r.file_size)}",
        f"  state dict    {where}: {r.tensor_count} tensors, {r.parameter_count:,} values, "
        f"{human_bytes(r.total_bytes)}",
        f"  dtypes        {_fmt_counts(r.dtypes)}",
        f"  locations     {_fmt_counts(r.locations)}",
        f"  prefixes      {_fmt_counts(r.prefixes)}",
        f"  shared        {'; '.join(' = '.join(g) for g in r.shared) or '-'}",
    ]
    if r.non_tensor_entries:
        lines.append("  other entries " + ", ".join(f"{k}: {v}" for k, v in list(r.non_tensor_entries.items())[:8]))
    if r.stubbed_globals:
        lines.append(f"  placeholders  {', '.join(r.stubbed_globals)}")
    lines.append(f"  weights_only  {'ok' if r.weights_only_ok else 'FAILS'} ({r.weights_only_reason})")
    for n in r.notes:
        lines.append(f"  note          {n}")
    click.echo("\n".join(lines))


@cli.command("scan")
@click.argument("checkpoint", type=click.Path())
@json_option
def scan_cmd(checkpoint: str, as_json: bool) -> None:
    """List every global CHECKPOINT's pickles reference; exit 11 if any is dangerous or unknown.

    Reads pickle opcodes only: nothing is unpickled or executed.
    """
    from ckptfix.errors import CorruptCheckpointError, ScanFindingsError
    from ckptfix.inspecting import scan_checkpoint

    r = scan_checkpoint(checkpoint)
    if as_json:
        emit_json(r.to_dict())
    else:
        click.echo(f"{r.path}: {r.verdict} ({r.format}, {len(r.pickles)} pickle(s), {len(r.globals)} globals)")
        for g, d in r.globals.items():
            click.echo(f"  {d['class']:<9} {g}" + (f"  x{d['count']}" if d["count"] > 1 else ""))
        for e in r.errors:
            click.echo(f"  malformed {e}")
    if r.dangerous:
        raise ScanFindingsError(f"{len(r.dangerous)} dangerous global(s) ({', '.join(r.dangerous[:3])}): do not "
                                "load this file with torch.load(weights_only=False); ckptfix loads it with them "
                                "stubbed")
    if r.unknown:
        raise ScanFindingsError(f"{len(r.unknown)} global(s) outside torch's weights-only allowlist "
                                f"({', '.join(r.unknown[:3])}): load_anywhere stubs them; pass --allow-global NAME "
                                "to rebuild one you trust")
    if r.errors:
        raise CorruptCheckpointError(f"{checkpoint}: the pickle is malformed ({r.errors[0]})")
