"""Checkpoint commands: inspect, scan, strip-prefix, add-prefix, align, sanitize (torch-free)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, TypeVar

import click

from ckptfix._startup import imports_quietly
from ckptfix.cli._common import ProgressBar, echo, emit_json, human_bytes, json_option, one_line
from ckptfix.cli.group import cli

if TYPE_CHECKING:
    from ckptfix.files.outputs import OutputOptions


_F = TypeVar("_F", bound=Callable[..., object])


def stats_option(f: _F) -> _F:
    """``--stats``: say on stderr how many bytes were read in how many requests (and add ``"stats"`` to --json)."""
    return click.option(
        "--stats",
        "show_stats",
        is_flag=True,
        help="Print the bytes read and requests made on stderr (a remote URL: what went over the network); "
        '--json gains a "stats" object.',
    )(f)


def _with_stats(show: bool, doc: dict | None, st: Any) -> None:
    """Print the ``--stats`` line (stderr) and add ``"stats"`` to a --json document."""
    if not show:
        return
    if doc is not None:
        doc["stats"] = st.to_json()
    echo(st.line(), err=True)


def _fmt_counts(d: dict) -> str:
    return ", ".join(f"{k} x{v}" for k, v in d.items()) or "-"


def limit_option(what: str, default: int) -> Callable[[_F], _F]:
    """``--limit N``: how many rows of a long listing the text shows (the rest counted; --json lists all)."""
    return click.option(
        "--limit",
        type=click.IntRange(min=0),
        default=default,
        show_default=True,
        metavar="N",
        help=f"Show the first N {what}, then how many more (0: all; --json always lists all).",
    )


@cli.command("inspect")
@click.argument("checkpoint", type=click.Path())
@click.option("--key", default=None, help="Where the state dict sits, e.g. 'model' or 'model/state_dict'.")
@click.option(
    "-v",
    "--keys",
    "list_keys",
    is_flag=True,
    help="List the tensors: name, shape, dtype, device (--json always has them).",
)
@click.option(
    "--filter",
    "pattern",
    metavar="PATTERN",
    default=None,
    help="List only the tensors whose names match (a glob such as 'layer1.*.weight', else a substring); "
    "implies --keys.",
)
@click.option(
    "--component",
    metavar="NAME",
    default=None,
    help="A diffusers pipeline or sentence-transformers folder: only this component (unet, 2_Dense), "
    "under its own tensor names.",
)
@limit_option("tensors", 50)
@json_option
@stats_option
def inspect_cmd(
    checkpoint: str,
    key: str | None,
    as_json: bool,
    show_stats: bool = False,
    list_keys: bool = False,
    pattern: str | None = None,
    limit: int = 50,
    component: str | None = None,
) -> None:
    """Summarise CHECKPOINT (a path or a URL: s3://, gs://, az://, hf://, https://) without loading tensors or
    running pickle code."""
    with imports_quietly():
        from ckptfix.files.remote.stats import collect
        from ckptfix.ops.inspect import inspect_checkpoint

    with collect() as st:
        r = inspect_checkpoint(checkpoint, key=key, tensor_filter=pattern, component=component)
    if as_json:
        doc = r.to_dict()
        _with_stats(show_stats, doc, st)
        emit_json(doc)
        return
    if r.state_dict_key is None:
        state = "no tensors (a valid torch file: arguments, scheduler or other state)"
    elif r.dtensor_shards is not None:
        where = "/".join(r.state_dict_key) or "(top level)"
        ds = r.dtensor_shards
        of = f" of rank {ds['rank']} of {ds['world']}" if ds["rank"] is not None else ""
        state = (
            f"{where}: {ds['shards']} DTensor shards{of} (an FSDP per-rank file: convert the folder with every "
            "rank's file to merge them)"
        )
    else:
        where = "/".join(r.state_dict_key) or "(top level)"
        state = f"{where}: {r.tensor_count} tensors, {r.parameter_count:,} values, {human_bytes(r.total_bytes)}"
        if r.unique_parameter_count != r.parameter_count or r.unique_bytes != r.total_bytes:
            state += (
                f" ({r.unique_parameter_count:,} values, {human_bytes(r.unique_bytes)} counting tied/shared "
                "tensors once)"
            )
    lines = [
        f"{r.path}",
        f"  format        {r.format}, {human_bytes(r.file_size)}",
        f"  state dict    {state}",
        f"  dtypes        {_fmt_counts(r.dtypes)}",
        f"  storage tags  {_fmt_counts(r.locations)}"
        + (f" (all storages in the file, {human_bytes(r.storage_bytes)})" if r.storage_bytes != r.unique_bytes else ""),
        f"  prefixes      {_fmt_counts(r.prefixes)}",
        f"  shared        {_shared_text(r.shared)}",
    ]
    if r.non_tensor_entries:
        lines.append("  other entries " + ", ".join(f"{k}: {v}" for k, v in list(r.non_tensor_entries.items())[:8]))
    if r.stubbed_globals:
        lines.append(f"  placeholders  {', '.join(r.stubbed_globals)}")
    lines.append(f"  weights_only  {'ok' if r.weights_only_ok else 'FAILS'} ({r.weights_only_reason})")
    for n in r.notes:
        lines.append(f"  note          {n}")
    lines += _framework_lines(r.framework, r.folder_scan)
    if list_keys or pattern is not None:
        lines += _tensor_lines(r.tensors, r.tensor_count, pattern, limit)
    echo("\n".join(one_line(line) for line in lines))  # a forged newline in a name cannot print a line of its own
    for n in r.notes:  # a partitioned (ZeRO-3) checkpoint's empty placeholders: said on stderr too
        if n.startswith("WARNING: "):
            echo(f"warning: {n[len('WARNING: ') :]}", err=True)
    _with_stats(show_stats, None, st)


def _shared_text(groups: list[list[str]], most: int = 8) -> str:
    """inspect's ``shared`` line: each group of names sharing a storage, at most ``most`` names of each shown."""

    def one(g: list[str]) -> str:
        return " = ".join(g[:most]) + (f" (+{len(g) - most} more)" if len(g) > most else "")

    return (
        "; ".join(one(g) for g in groups[:most])
        + (f"; ... {len(groups) - most} more groups" if len(groups) > most else "")
        or "-"
    )


def _tensor_lines(rows: list[dict], total: int, pattern: str | None, limit: int) -> list[str]:
    """``inspect --keys``: one line per tensor (name, shape as torch.Size holds it, dtype, device, what it shares)."""
    what = f"{len(rows)} of {total} match {pattern!r}" if pattern is not None else f"{total}"
    out = [f"  tensors       {what}"]
    shown = rows if limit == 0 else rows[:limit]
    if not shown:
        return out
    cells = [(t["name"], str(t["shape"]), t["dtype"], t["device"] or "-") for t in shown]
    widths = [max(len(c[i]) for c in cells) for i in range(3)]
    for (name, shape, dtype, device), t in zip(cells, shown, strict=True):
        line = f"    {name:<{widths[0]}}  {shape:<{widths[1]}}  {dtype:<{widths[2]}}  {device}"
        others, count = t["shared_with"], t.get("shared_count", len(t["shared_with"]))
        if others:
            line += f"  shares storage with {others[0]}" + (f" (+{count - 1})" if count > 1 else "")
        out.append(line)
    if len(rows) > len(shown):
        out.append(
            f"    ... {len(rows) - len(shown)} more (--limit 0 lists all, --filter PATTERN narrows, "
            "--json has every row)"
        )
    return out


def _framework_lines(fw: dict | None, folder_scan: dict | None = None) -> list[str]:
    """The framework, layout and one line per other file of a framework folder (inspect's text), then the
    scan verdict of every pickle-bearing file in it."""
    if not fw:
        return []
    verdicts = (folder_scan or {}).get("files", {})

    def flag(name: str) -> str:
        v = verdicts.get(name)
        if not v or v["verdict"] == "safe":
            return ""
        named = (v["dangerous"] + v["unknown"])[:3]
        return f" [scan: {v['verdict']}" + (f", {', '.join(named)}" if named else "") + "]"

    out = [f"  framework     {fw['framework']} ({fw['layout']}; checked with {fw['checked_versions']})"]
    for label, text in fw.get("details", []):  # a consolidated layout's own lines (ZeRO stage, ranks ...)
        out.append(f"  {label:<13} {text}")
    if fw.get("weights") is not None:
        out.append(f"  weights       {fw['weights']}{flag(fw['weights'])}")
    out += _component_lines(fw.get("components", []))
    for f in fw.get("files", []):
        size = f["summary"] or human_bytes(f["bytes"])
        out.append(f"  {f['role']:<13} {f['file']}: {size}{flag(f['file'])}")
    if folder_scan is not None:
        by: dict[str, list[str]] = {}
        for name, v in verdicts.items():
            by.setdefault(v["verdict"], []).append(name)
        parts = [
            f"{k}: {', '.join(by[k][:6])}{' ...' if len(by[k]) > 6 else ''}"
            for k in ("dangerous", "unknown", "malformed")
            if k in by
        ]
        safe = len(by.get("safe", []))
        out.append(f"  scan          {folder_scan['verdict']} ({'; '.join(parts + [f'{safe} file(s) safe'])})")
    return out


def _component_lines(comps: list[dict]) -> list[str]:
    """A folder of several models: one line per component (its weights per variant, their tensors and dtypes)."""
    out = []
    for c in comps:
        if c["problem"]:
            what = c["problem"]
        elif not c["variants"]:
            what = "no weights"
        else:
            what = "; ".join(
                f"{c['weights'][v]}: {n['tensors']} tensors, {n['parameters']:,} values, {_fmt_counts(n['dtypes'])}"
                for v, n in c["variants"].items()
            )
        out.append(f"  component     {c['name']} ({c['kind']}): {what}")
    return out


@cli.command("scan")
@click.argument("checkpoints", nargs=-1, required=True, type=click.Path(), metavar="CHECKPOINT...")
@limit_option("safe globals (every dangerous or unknown one is listed)", 20)
@json_option
@stats_option
def scan_cmd(checkpoints: tuple[str, ...], as_json: bool, show_stats: bool = False, limit: int = 20) -> None:
    """List every global each CHECKPOINT's pickles reference; exit 11 if any is dangerous or unknown.

    Reads pickle opcodes only: nothing is unpickled or executed.  With several files (as a
    pre-commit hook passes them) every file is scanned, the exit code is the highest of the
    files' codes and --json prints a list.
    """
    from ckptfix.cli._common import error_line
    from ckptfix.errors import CkptfixError

    with imports_quietly():
        from ckptfix.files.remote.stats import collect
        from ckptfix.ops.inspect import scan_checkpoint

    if len(checkpoints) == 1:
        with collect() as st:
            r = scan_checkpoint(checkpoints[0])
        if as_json:
            doc = r.to_dict()
            _with_stats(show_stats, doc, st)
            emit_json(doc)
        else:
            _render_scan(r, limit)
            _with_stats(show_stats, None, st)
        found = _scan_error(checkpoints[0], r)
        if found is not None:
            raise found
        return
    docs: list[dict] = []
    failed: list[CkptfixError] = []
    for path in checkpoints:
        try:
            with collect() as st:
                r = scan_checkpoint(path)
        except CkptfixError as e:
            docs.append({"path": path, "verdict": "error", "error": str(e), "exit_code": e.exit_code})
            err = e
        else:
            docs.append(r.to_dict())
            if not as_json:
                _render_scan(r, limit)
            _with_stats(show_stats, docs[-1], st)
            err = _scan_error(path, r)
        if err is not None:
            failed.append(err)
            msg = str(err)
            error_line(msg if msg.startswith(path) else f"{path}: {msg}")
    if as_json:
        emit_json(docs)
    if failed:
        worst = max(failed, key=lambda e: e.exit_code)
        summary = CkptfixError(f"{len(failed)} of {len(checkpoints)} files failed the scan (see the errors above)")
        summary.exit_code = worst.exit_code
        raise summary


def _render_scan(r, limit: int = 0) -> None:
    """scan's text: every dangerous or unknown global, then the safe ones up to ``limit`` (0: all) and a count."""
    # names from the file (a folder's file names, globals, error texts) are shown with their control
    # characters escaped: a forged newline in a name cannot print a line of its own
    echo(f"{one_line(r.path)}: {r.verdict} ({r.format}, {len(r.pickles)} pickle(s), {len(r.globals)} globals)")
    safe = [g for g, d in r.globals.items() if d["class"] == "safe"]
    hidden = set(safe[limit:]) if limit else set()
    for g, d in r.globals.items():
        if g not in hidden:
            echo(f"  {d['class']:<9} {one_line(g)}" + (f"  x{d['count']}" if d["count"] > 1 else ""))
    if hidden:
        mangled = sum(1 for g in hidden if g.startswith("__torch__."))
        what = f", {mangled} of them TorchScript classes (__torch__.*)" if mangled else ""
        echo(f"  ... {len(hidden)} more safe globals{what} (--limit 0 lists all, --json has every one)")
    from ckptfix.pickles.policy import needs_package

    packages = sorted({p for g in r.globals if (p := needs_package(g))})
    if packages:  # torchao's tensor classes: torch's weights-only loader allows them once torchao registered them
        echo(
            f"  note      {', '.join(packages)}'s globals are safe as torch.load(weights_only=True) takes them: "
            f"once `import {packages[0]}` has registered them (without it torch.load refuses them)"
        )
    for e in r.errors:
        echo(f"  malformed {one_line(e)}")
    for name, f in r.files.items():  # a folder: each file's own verdict
        named = (f["dangerous"] + f["unknown"])[:3]
        echo(f"  file      {one_line(name)}: {f['verdict']}" + (f" ({one_line(', '.join(named))})" if named else ""))


def _scan_error(checkpoint: str, r):
    """The error ``scan`` exits with for report ``r`` (None when the file is safe)."""
    from ckptfix.errors import CorruptCheckpointError, ScanFindingsError

    bad = [n for n, f in r.files.items() if f["verdict"] == ("dangerous" if r.dangerous else "unknown")]
    where = f" in {', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''}" if bad else ""
    if r.dangerous:
        if r.format in ("torch-tar", "torch-package"):  # ckptfix never loads these
            what = "a pre-0.4 tar checkpoint" if r.format == "torch-tar" else "a torch.package archive"
            return ScanFindingsError(
                f"{len(r.dangerous)} dangerous global(s) ({', '.join(r.dangerous[:3])}) in {what}: they run code "
                "when the file is loaded (torch.load, PackageImporter); load it only if you trust it"
            )
        return ScanFindingsError(
            f"{len(r.dangerous)} dangerous global(s) ({', '.join(r.dangerous[:3])}){where}: do not "
            f"load {'these files' if bad else 'this file'} with torch.load(weights_only=False); ckptfix loads "
            "it with them stubbed"
        )
    if r.unknown and r.format in ("torch-tar", "torch-package"):
        return ScanFindingsError(
            f"{len(r.unknown)} global(s) or record(s) the scan cannot clear ({', '.join(r.unknown[:3])}); "
            "load the file only if you trust it (ckptfix does not load this format)"
        )
    if r.unknown:
        return ScanFindingsError(
            f"{len(r.unknown)} global(s) outside torch's weights-only allowlist "
            f"({', '.join(r.unknown[:3])}){where}: load_anywhere stubs them; pass --allow-global NAME "
            "to rebuild one you trust"
        )
    if r.errors:
        return CorruptCheckpointError(f"{checkpoint}: the pickle is malformed ({r.errors[0]})")
    return None


# --------------------------------------------------------------------------- prefix surgery


def _write_options(f):
    f = click.option(
        "-o",
        "--output",
        type=click.Path(),
        default=None,
        help="Where to write (default: next to the input, e.g. model.stripped.pth; for a sharded index, a directory).",
    )(f)
    f = click.option("--in-place", is_flag=True, help="Replace the input atomically (temp file, fsync, rename).")(f)
    f = click.option("--no-backup", is_flag=True, help="With --in-place: do not keep CHECKPOINT.bak.")(f)
    f = click.option("--force", is_flag=True, help="Overwrite an existing output file.")(f)
    f = click.option(
        "--link",
        is_flag=True,
        help="DCP directories only: hard-link the data files into the output instead of copying them. "
        "Risk: input and output then share those files, so saving into the output (dcp.save) also "
        "changes the input.",
    )(f)
    f = click.option("--key", default=None, help="Where the state dict sits, e.g. 'model/state_dict'.")(f)
    f = click.option(
        "--map-location", default=None, help="Rewrite storage device tags: 'cpu', or 'cuda:7=cuda:0,cuda:1=cpu'."
    )(f)
    f = click.option(
        "--jobs",
        "-j",
        type=click.IntRange(min=0),
        default=1,
        show_default=True,
        help="Shards of a sharded index written in parallel (0: one per CPU); same output for any N.",
    )(f)
    return json_option(f)


def _render_rewrite(rep, as_json: bool, extra_line: str | None = None) -> None:
    from ckptfix.cli._common import info
    from ckptfix.display import shown_path

    if as_json:
        emit_json(rep.to_dict())
        return
    if extra_line:
        info(extra_line)
    for n in rep.notes:
        info(f"note: {n}")
    if rep.relocated:
        info("device tags: " + ", ".join(f"{a} -> {b}" for a, b in rep.relocated.items()))
    if rep.backup:
        info(f"backup: {shown_path(rep.backup)}")
    if rep.output:
        echo(shown_path(rep.output))


def _outputs(bar, output, in_place, no_backup, force, key, map_location, jobs, link=False) -> OutputOptions:
    """The library's :class:`~ckptfix.files.outputs.OutputOptions` from the options :func:`_write_options` adds."""
    from ckptfix.files.outputs import OutputOptions

    return OutputOptions(
        output=output,
        in_place=in_place,
        backup=not no_backup,
        force=force,
        key=key,
        map_location=map_location,
        progress=bar.update,
        jobs=jobs,
        link=link,
    )


@cli.command("strip-prefix")
@click.argument("checkpoint", type=click.Path())
@click.option("--prefix", default=None, help="Strip exactly this prefix (default: every wrapper layer all keys carry).")
@click.option("--partial", is_flag=True, help="Also strip wrapper prefixes that only some keys carry.")
@_write_options
def strip_prefix_cmd(
    checkpoint, prefix, partial, output, in_place, no_backup, force, link, key, map_location, jobs, as_json
) -> None:
    """Strip DataParallel/DDP 'module.', torch.compile '_orig_mod.', Lightning 'model.' ... from the keys.

    Writes CHECKPOINT's stem + '.stripped' next to it (printed on stdout) and never modifies the input
    unless --in-place is given.
    """
    from ckptfix.ops.rewrite.keys import strip_prefix_checkpoint

    with ProgressBar("stripping", enabled=not as_json) as bar:
        rep = strip_prefix_checkpoint(
            checkpoint,
            prefix,
            partial=partial,
            outputs=_outputs(bar, output, in_place, no_backup, force, key, map_location, jobs, link),
        )
    _render_rewrite(rep, as_json, rep.detail.get("summary"))


@cli.command("add-prefix")
@click.argument("checkpoint", type=click.Path())
@click.option("--prefix", required=True, help="The prefix to add, e.g. 'module.'.")
@_write_options
def add_prefix_cmd(
    checkpoint, prefix, output, in_place, no_backup, force, link, key, map_location, jobs, as_json
) -> None:
    """Add PREFIX to every key (load a plain checkpoint into a DataParallel/DDP-wrapped model)."""
    from ckptfix.ops.rewrite.keys import add_prefix_checkpoint

    with ProgressBar("adding", enabled=not as_json) as bar:
        rep = add_prefix_checkpoint(
            checkpoint,
            prefix,
            outputs=_outputs(bar, output, in_place, no_backup, force, key, map_location, jobs, link),
        )
    _render_rewrite(rep, as_json, rep.detail.get("summary"))


@cli.command("align")
@click.argument("checkpoint", type=click.Path())
@click.option(
    "--to",
    "target",
    required=True,
    help="What to match: another checkpoint (.pth/.safetensors) or 'package.module:factory'.",
)
@_write_options
def align_cmd(checkpoint, target, output, in_place, no_backup, force, link, key, map_location, jobs, as_json) -> None:
    """Rename CHECKPOINT's keys to match a target model or checkpoint; exit 10 unless it then matches exactly."""
    from ckptfix.ops.rewrite.keys import align_checkpoint

    with ProgressBar("aligning", enabled=not as_json) as bar:
        res = align_checkpoint(
            checkpoint,
            target,
            outputs=_outputs(bar, output, in_place, no_backup, force, key, map_location, jobs, link),
        )
    r = res.alignment
    if as_json:
        emit_json(res.to_dict())
    else:
        _render_rewrite(res.rewrite, False, r.summary())
        for k in r.missing[:20]:
            echo(f"  missing     {k}", err=True)
        for k in r.unexpected[:20]:
            echo(f"  unexpected  {k}", err=True)
        for m in r.shape_mismatches[:20]:
            echo(f"  shape       {m.to_dict()}", err=True)
    err = res.mismatch_error()
    if err is not None:
        raise err


@cli.command("sanitize")
@click.argument("checkpoint", type=click.Path())
@click.option(
    "-o",
    "--output",
    type=click.Path(),
    default=None,
    help="Where to write (default: next to the input, e.g. model.sanitized.pth).",
)
@click.option("--in-place", is_flag=True, help="Replace the input atomically (temp file, fsync, rename).")
@click.option("--no-backup", is_flag=True, help="With --in-place: do not keep CHECKPOINT.bak.")
@click.option("--force", is_flag=True, help="Overwrite an existing output file.")
@json_option
def sanitize_cmd(checkpoint, output, in_place, no_backup, force, as_json) -> None:
    """Make CHECKPOINT load with torch.load(weights_only=True): everything beside the tensors becomes plain data.

    argparse.Namespace -> dict, numpy arrays -> tensors, numpy scalars -> numbers, omegaconf -> dict/list,
    other objects -> dict of their state plus "__class__", classes/functions -> their names.  Tensors and
    storage sharing are copied unchanged; torch is not imported.  The report (stderr, or --json) lists
    what became what.
    """
    from ckptfix.cli._common import info
    from ckptfix.files.outputs import OutputOptions
    from ckptfix.ops.sanitize import sanitize_checkpoint

    with ProgressBar("sanitizing", enabled=not as_json) as bar:
        outputs = OutputOptions(
            output=output, in_place=in_place, force=force, backup=not no_backup, progress=bar.update
        )
        rep = sanitize_checkpoint(checkpoint, outputs=outputs)
    if as_json:
        emit_json(rep.to_dict())
        return
    info(rep.summary())
    for c in rep.changes[:50]:
        info(f"  {c.path}: {c.was} -> {c.now}")
    if len(rep.changes) > 50:
        info(f"  ... and {len(rep.changes) - 50} more (--json lists all)")
    for n in rep.notes:
        info(f"note: {n}")
    if rep.backup:
        info(f"backup: {rep.backup}")
    if rep.output:
        echo(rep.output)
