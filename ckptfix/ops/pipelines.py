"""``inspect`` and ``load_checkpoint`` of a folder of several models (diffusers pipeline, sentence-transformers).

The detection is :mod:`ckptfix.formats.pipelines` (``Resolved.extra["components"]``); each component's weights are an
ordinary checkpoint (a file or a sharded index), read by :func:`ckptfix.ops.inspect.inspect_file` and
:func:`ckptfix.ops.load.load_file`.  The whole folder's state dict names each tensor ``<prefix><name>``: the
component's name and a dot (``unet.conv_in.weight``; ``2.linear.weight`` and ``0.model.embeddings...`` for
a sentence-transformers model, as ``SentenceTransformer.state_dict()`` names them).  ``component=`` (``--component``)
picks one component, reported or loaded under its own names (as its ``from_pretrained`` sees them).
Converting is :mod:`ckptfix.ops.convert.pipelines`.
"""

from __future__ import annotations

import collections
import os
from typing import TYPE_CHECKING, Any

from ckptfix.errors import UnsupportedError
from ckptfix.formats.layouts import Resolved, check_inside, describe_files
from ckptfix.formats.pipelines import Component, components_of, find_component

if TYPE_CHECKING:
    from ckptfix.ops.inspect import InspectReport
    from ckptfix.ops.load import LoadedCheckpoint

__all__ = ["diff_refusal", "inspect_pipeline", "load_pipeline", "refuse_component"]


def refuse_component(path: str | os.PathLike, r: Resolved | None = None) -> None:
    """``--component`` given for an input of one model: :class:`~ckptfix.errors.OptionNotApplicableError`."""
    from ckptfix.errors import OptionNotApplicableError

    what = f"a {r.layout.framework} folder (one model)" if r is not None else "a single checkpoint"
    raise OptionNotApplicableError(
        f"{os.fspath(path)}: --component does not apply to {what}; it picks one model of a diffusers pipeline "
        "(model_index.json) or a sentence-transformers folder (modules.json)"
    )


def _chosen(r: Resolved, component: str | None) -> list[Component]:
    return [find_component(r, component)] if component is not None else components_of(r)


def _component_entry(r: Resolved, c: Component, reports: dict[str, Any]) -> dict[str, Any]:
    """One ``framework.components`` entry: the index's word on it and each variant's counts."""
    d = c.to_dict(r.path)
    d["variants"] = {
        v: {
            "format": str(rep.format),
            "tensors": rep.tensor_count,
            "parameters": rep.parameter_count,
            "bytes": rep.total_bytes,
            "dtypes": rep.dtypes,
        }
        for v, rep in reports.items()
    }
    return d


def inspect_pipeline(
    r: Resolved, key: str | None = None, tensor_filter: str | None = None, component: str | None = None
) -> InspectReport:
    """``inspect`` of a multi-model folder: every component's tensors (or one component's, ``component=``).

    Args:
        r: the resolved folder (``extra["components"]``).
        key: refused (a component is chosen with ``component``).
        tensor_filter: as for :func:`~ckptfix.ops.inspect.inspect_checkpoint` (on the names shown).
        component: one component's name (``unet``) or folder.

    Returns:
        An :class:`~ckptfix.ops.inspect.InspectReport` whose ``framework["components"]`` lists every component
        (its folder, kind, weights per variant with their counts).

    Raises:
        UnsupportedError: ``key`` given, or a component's weights link outside the folder.
        KeyConflictError: no such component.
    """
    from ckptfix.formats import Format
    from ckptfix.ops.inspect import InspectReport, _rows, inspect_file

    if key is not None:
        raise UnsupportedError(
            f"{r.path}: --key does not apply to a {r.layout.framework} folder (several models); "
            "pick one with --component NAME"
        )
    comps = _chosen(r, component)
    one = component is not None
    per: dict[str, dict[str, Any]] = {}
    mains: list[tuple[Component, Any]] = []
    for c in comps:
        reports = {v: inspect_file(check_inside(r, p)) for v, p in c.weights.items()}
        per[c.name] = _component_entry(r, c, reports)
        main = next((v for v, p in c.weights.items() if p == c.main), None)
        if main is not None:
            mains.append((c, reports[main]))
    if one and not mains:
        c = comps[0]
        raise UnsupportedError(
            f"{r.path}: component {c.name!r} ({c.kind}) has no weights"
            + (f" ({c.problem})" if c.problem else " (a configuration only)")
        )
    names: list[str] = []
    info: dict[str, tuple[list[int], str, str | None]] = {}
    shared: list[list[str]] = []
    dtypes: collections.Counter[str] = collections.Counter()
    locations: collections.Counter[str] = collections.Counter()
    prefixes: dict[str, int] = {}
    non_tensor: dict[str, str] = {}
    globals_: dict[str, str] = {}
    stubbed: set[str] = set()
    bad: list[str] = []
    for c, rep in mains:
        pre = "" if one else c.prefix
        for row in rep.tensors:
            n = pre + row["name"]
            names.append(n)
            info[n] = (row["shape"], row["dtype"], row["device"])
        shared += [[pre + n for n in g] for g in rep.shared]
        dtypes.update(rep.dtypes)
        locations.update(rep.locations)
        for p, k in rep.prefixes.items():
            prefixes[pre + p] = prefixes.get(pre + p, 0) + k
        non_tensor.update({pre + k: v for k, v in rep.non_tensor_entries.items()})
        globals_.update(rep.globals)
        stubbed |= set(rep.stubbed_globals)
        if not rep.weights_only_ok:
            bad.append(f"{c.name}: {rep.weights_only_reason}")
    first = mains[0][1] if mains else None
    fmts = sorted({str(rep.format) for _, rep in mains})
    describe_files(r)
    fw = r.to_dict()
    fw["components"] = [per[c.name] for c in comps]
    if one:
        fw["component"] = comps[0].name
    with_w = [c.name for c, _ in mains]
    without = [c.name for c in comps if c.name not in with_w]
    notes = []
    if not one:
        notes.append(
            f"{r.layout.framework}: {len(mains)} component(s) with weights ({', '.join(with_w) or 'none'})"
            + (f", {len(without)} without ({', '.join(without)})" if without else "")
            + "; tensors named <component>.<name>; --component NAME shows one under its own names"
        )
    if len(fmts) > 1:
        notes.append("components in several formats: " + ", ".join(f"{c.name} {rep.format}" for c, rep in mains))
    main_paths = [c.main for c, _ in mains if c.main]
    return InspectReport(
        path=r.path if not one else os.path.join(r.path, comps[0].rel),
        format=first.format if first is not None else Format.SAFETENSORS,
        file_size=sum(rep.file_size for _, rep in mains),
        state_dict_key=[] if mains else None,
        tensor_count=sum(rep.tensor_count for _, rep in mains),
        parameter_count=sum(rep.parameter_count for _, rep in mains),
        unique_parameter_count=sum(rep.unique_parameter_count for _, rep in mains),
        total_bytes=sum(rep.total_bytes for _, rep in mains),
        unique_bytes=sum(rep.unique_bytes for _, rep in mains),
        storage_bytes=sum(rep.storage_bytes for _, rep in mains),
        dtypes=dict(sorted(dtypes.items())),
        locations=dict(sorted(locations.items())),
        prefixes=prefixes,
        shared=shared,
        non_tensor_entries=non_tensor,
        globals=dict(sorted(globals_.items())),
        stubbed_globals=sorted(stubbed),
        weights_only_ok=not bad,
        weights_only_reason="; ".join(bad)
        or (
            f"every component's weights load with torch.load(weights_only=True) ({len(main_paths)} file(s))"
            if any(not p.endswith(".safetensors") for p in main_paths)
            else f"safetensors ({len(main_paths)} component(s)): no pickle"
        ),
        notes=notes,
        framework=fw,
        tensors=_rows(names, info, shared, tensor_filter),
        tensor_filter=tensor_filter,
    )


def load_pipeline(r: Resolved, **kw: Any) -> LoadedCheckpoint:
    """``load_checkpoint(FOLDER)`` of a multi-model folder: every component's tensors, named ``<prefix><name>``.

    ``key=`` picks one component (its name or folder) and gives its state dict under its own names;
    ``checkpoint`` is ``{component: its state dict}``; ``model=`` aligns the whole (or the chosen) state dict.

    Returns:
        A :class:`~ckptfix.ops.load.LoadedCheckpoint` (``format`` the layout's name).
    """
    from ckptfix.ops.load import LoadedCheckpoint, _aligned, load_file

    name = kw.pop("key", None)
    model = kw.pop("model", None)
    comps = _chosen(r, name)
    sd: dict[str, Any] = collections.OrderedDict()
    per: dict[str, Any] = {}
    stubbed: set[str] = set()
    locations: collections.Counter[str] = collections.Counter()
    for c in comps:
        if c.main is None:
            if name is not None:
                raise UnsupportedError(f"{r.path}: component {c.name!r} ({c.kind}) has no weights")
            continue
        lc = load_file(check_inside(r, c.main), **kw)
        per[c.name] = lc.state_dict
        pre = "" if name is not None else c.prefix
        for k, v in lc.state_dict.items():
            sd[pre + str(k)] = v
        stubbed |= set(lc.stubbed_globals)
        locations.update(lc.locations)
    alignment = None
    if model is not None:
        sd, alignment = _aligned(r.path, sd, model)
    return LoadedCheckpoint(
        path=r.path,
        state_dict=sd,
        checkpoint=per,
        format=r.layout.name,  # type: ignore[arg-type]  # a framework layout, not a file Format
        stubbed_globals=sorted(stubbed),
        locations=dict(locations),
        alignment=alignment,
    )


def diff_refusal(r: Resolved, path: str) -> UnsupportedError:
    """What ``diff`` says of a multi-model folder: compare one component's weights (named with its path)."""
    c = next((c for c in components_of(r) if c.main), None)
    hint = f"ckptfix diff {c.main} OTHER/{os.path.relpath(c.main, r.path)}" if c and c.main else "ckptfix diff A B"
    return UnsupportedError(
        f"{path}: a {r.layout.framework} folder holds several models; compare one component's weights: {hint}"
    )
