"""The non-tensor part of a checkpoint (epoch, step, hyper-parameters, optimizer state) as JSON.

Placeholders of classes (numpy arrays, ``argparse.Namespace``, omegaconf ...) are written as the
plain data ``ckptfix sanitize`` would write; what cannot be represented is listed in the report's
``skipped``.  Optimizer tensors are written only with ``include_optimizer``.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from ckptfix.formats.statedict import contains_tensors, module_state
from ckptfix.ops.convert.report import ConvertReport
from ckptfix.pickles import Stub, global_name, is_tensor_like

_OPTIMIZER_KEYS = ("opt", "opt_state", "opt_state_dict")


def is_optimizer_key(k: Any) -> bool:
    """Is ``k`` a checkpoint's optimizer entry (``optimizer``, ``optim_state``, ``opt`` ...)?

    Args:
        k: a top-level checkpoint key.

    Returns:
        True for optimizer keys.
    """
    return isinstance(k, str) and ("optim" in k.lower() or k.lower() in _OPTIMIZER_KEYS)


_OMIT = object()


class _Extras:
    """Turns the non-tensor part of a checkpoint into JSON, noting what it cannot represent."""

    def __init__(
        self, sd_node: Any, report: ConvertReport, max_nodes: int | None = None, max_chars: int | None = None
    ) -> None:
        self.sd_node = sd_node
        self.report = report
        self.opt_tensors: list[tuple[str, Any]] = []
        #: ``(path, tensor)`` of every tensor met outside the state dict that has no place in the output
        self.unwritten: list[tuple[str, Any]] = []
        self._seen: set[int] = set()
        if max_nodes is None:
            from ckptfix.pickles.opcodes import PickleLimits

            max_nodes = PickleLimits.from_env().max_items
        self.max_nodes = max_nodes
        if max_chars is None:
            from ckptfix.formats.stmeta import MAX_EXTRA_JSON

            max_chars = MAX_EXTRA_JSON
        #: characters of strings past which the JSON is not kept (stmeta drops a larger one anyway): the walk
        #: goes on for the tensors it finds, without counting, and the caller drops the JSON (``too_big``)
        self.max_chars = max_chars
        self.too_big = False
        #: values the JSON holds so far, a shared object counted once per place it appears
        self.nodes = 0
        #: characters of strings the JSON holds so far, counted the same way
        self.chars = 0
        #: id -> (JSON of a container already rendered, the values and characters it holds); a shared
        #: object is rendered once, and its counts added again at each further place (JSON repeats it)
        self._memo: dict[int, tuple[Any, int, int]] = {}
        self._keep: list[Any] = []  # keeps memoized sources alive so their ids stay unique

    def _count(self, n: int, path: str, chars: int = 0) -> None:
        self.nodes += n
        self.chars += chars
        if self.chars > self.max_chars and not self.too_big:
            self.too_big = True
            self.report.skipped["<extra>"] = (
                f"the non-tensor entries (at {path or 'the top level'}) expand to more than {self.max_chars:,} "
                "characters of JSON (a string shared many times over, which JSON repeats at each place); "
                "too large to keep"
            )
        if self.nodes > self.max_nodes:
            from ckptfix.errors import ResourceLimitError

            raise ResourceLimitError(
                f"the non-tensor entries (at {path or 'the top level'}) expand to more than {self.max_nodes:,} "
                "values when written out as JSON (one object shared many times over, which JSON must "
                "repeat); nothing was written. Set CKPTFIX_MAX_PICKLE_ITEMS to a larger count for a "
                "file you trust, or convert only the weights with --key"
            )

    def value(self, v: Any, path: str, opt: bool = False, depth: int = 0) -> Any:
        """``v`` as JSON data, or the ``_OMIT`` marker; raises past the node budget (see :meth:`_value`)."""
        hit = self._memo.get(id(v))
        if hit is not None:
            self._count(hit[1], path, hit[2])
            return hit[0]
        before, chars = self.nodes, self.chars
        self._count(1, path, len(v) if type(v) is str else 0)
        r = self._value(v, path, opt, depth)
        if r is not _OMIT and isinstance(v, (Mapping, list, tuple, set, frozenset)) and id(v) not in self._seen:
            self._memo[id(v)] = (r, self.nodes - before, self.chars - chars)
            self._keep.append(v)
        return r

    def _value(self, v: Any, path: str, opt: bool = False, depth: int = 0) -> Any:
        """``v`` as JSON data, or the ``_OMIT`` marker (the reason recorded in the report).

        Args:
            v: the value.
            path: its dotted path in the checkpoint.
            opt: inside the optimizer state (tensors are kept as ``{"__tensor__": name}``).
            depth: nesting depth (32 at most).

        Returns:
            JSON-ready data (non-finite floats as ``{"__float__": repr}``), or ``_OMIT``.
        """
        if v is self.sd_node:
            return _OMIT
        if v is None or isinstance(v, (bool, int, str)):
            return v
        if isinstance(v, float):
            if math.isfinite(v):
                return v
            return {"__float__": repr(v)}
        if is_tensor_like(v):
            if opt:
                name = "optimizer." + path
                self.opt_tensors.append((name, v))
                return {"__tensor__": name}
            self.unwritten.append((path, v))
            return _OMIT
        if depth > 32 or id(v) in self._seen:
            self._skip(path, "nested too deep or recursive")
            return _OMIT
        if isinstance(v, (Stub, type, slice, range, frozenset)) or callable(v):
            # placeholders of instances *and* of classes (numpy arrays, {"dtype": int}, omegaconf, Namespace ...)
            return self._plain(v, path, opt, depth)
        self._seen.add(id(v))
        try:
            if isinstance(v, Mapping) or (hasattr(v, "items") and hasattr(v, "keys") and not isinstance(v, type)):
                out = {}
                for k, x in list(v.items()):
                    if not isinstance(k, (str, int, float, bool)) and k is not None:
                        if opt and (contains_tensors(x) or contains_tensors(k)):  # nobody could name them: refuse
                            from ckptfix.errors import UnsupportedError

                            raise UnsupportedError(
                                f"{path}: optimizer tensors under a {type(k).__name__} key ({k!r}), which a tensor "
                                "name cannot hold; convert without --include-optimizer"
                            )
                        sub = f"{path}.{k!r}" if path else repr(k)
                        self._skip(sub, f"a {type(k).__name__} key")
                        if contains_tensors(k):  # a tensor used as a key ({tensor(3): 1}) is held too: counted
                            self.value(k, sub + ".<key>", False, depth + 1)
                        self.value(x, sub, opt, depth + 1)  # not kept, but the tensors it holds are counted
                        continue
                    sub = f"{path}.{k}" if path else str(k)
                    r = self.value(x, sub, opt, depth + 1)
                    if r is not _OMIT:
                        out[str(k)] = r
                        self._count(0, sub, len(str(k)))
                return out
            if isinstance(v, (list, tuple, set, frozenset)):
                seq = list(v)
                if isinstance(v, (set, frozenset)):
                    try:
                        seq = sorted(seq)
                    except TypeError:
                        pass
                res = []
                for i, x in enumerate(seq):
                    r = self.value(x, f"{path}.{i}" if path else str(i), opt, depth + 1)
                    res.append(None if r is _OMIT else r)
                return res
        finally:
            self._seen.discard(id(v))
        self._skip(path, f"a {type(v).__name__} (not representable as JSON)")
        return _OMIT

    def _plain(self, v: Any, path: str, opt: bool, depth: int) -> Any:
        """A placeholder (or class, function, frozenset ...) as the plain data ``sanitize`` would write, as JSON."""
        from ckptfix.ops.plaindata import LOSSY, Plainer, normalise_global  # (a plain state dict never needs it)

        pl = Plainer(arrays="list", sep=".")
        plain = pl.convert(v, path)
        if isinstance(v, type) and issubclass(v, Stub):
            self.report.placeholders[path] = "class " + normalise_global(global_name(v))
        elif isinstance(v, Stub):
            self.report.placeholders[path] = normalise_global(global_name(type(v)))
        for c in pl.changes:
            self.report.converted[c.path] = f"{c.was} -> {c.now}"
        for p, why in pl.lossy.items():
            self._skip(p, why)
        if plain is LOSSY:
            return _OMIT
        return self.value(_strip_lossy(plain), path, opt, depth + 1)

    def _skip(self, path: str, why: str) -> None:
        if len(self.report.skipped) < 200:
            self.report.skipped[path] = why


def _kind_of(v: Any) -> str:
    from ckptfix.ops.plaindata import normalise_global

    if isinstance(v, type):
        return "class " + (normalise_global(global_name(v)) if issubclass(v, Stub) else v.__qualname__)
    return normalise_global(global_name(type(v))) if isinstance(v, Stub) else type(v).__name__


def _strip_lossy(v: Any) -> Any:
    """``v`` without the markers of values too large for JSON (already listed in ``skipped``)."""
    from ckptfix.ops.plaindata import LOSSY

    if isinstance(v, dict):
        return {k: _strip_lossy(x) for k, x in v.items() if x is not LOSSY}
    if isinstance(v, list):
        return [None if x is LOSSY else _strip_lossy(x) for x in v]
    return v


def split_checkpoint(
    obj: Any,
    key_path: tuple[str, ...],
    sd: Mapping[str, Any],
    include_optimizer: bool,
    report: ConvertReport,
    node: Any = None,
    unwritten: list[tuple[str, Any]] | None = None,
) -> tuple[dict[str, Any], list[tuple[str, Any]]]:
    """Everything outside the state dict as JSON, and the optimizer tensors to write.

    Args:
        obj: the whole checkpoint.
        key_path: where the state dict sits in ``obj``.
        sd: the state dict.
        include_optimizer: keep optimizer entries (their tensors become ``optimizer.<path>``).
        report: gets ``excluded``, ``skipped``, ``placeholders`` and ``converted``.
        node: the object holding the state dict, when not ``sd`` itself (it is not repeated in the JSON).
        unwritten: gets ``(path, tensor)`` of every tensor outside the state dict (and outside an
            included optimizer) that the output has no place for: the caller refuses or drops them.

    Returns:
        ``(extra, optimizer tensors)``: the JSON object of the representable non-tensor entries,
        and ``(name, tensor)`` pairs.
    """
    ex = _Extras(sd if node is None else node, report)
    extra: dict[str, Any] = {}
    if not key_path and module_state(obj) is not None and not isinstance(obj, dict):
        return extra, []  # a whole pickled module: its state dict is all there is to keep
    if not key_path:
        for k, v in sd.items():  # a state dict with some non-tensor values mixed in
            if not is_tensor_like(v):
                r = ex.value(v, str(k))
                if r is not _OMIT:
                    extra[str(k)] = r
        if unwritten is not None:
            unwritten += ex.unwritten
        return ({} if ex.too_big else extra), []
    if not (isinstance(obj, Mapping) or hasattr(obj, "items")) or isinstance(obj, type):
        return extra, []
    for k, v in sd.items():  # non-tensor values inside a nested state dict: no place in the file
        if not is_tensor_like(v):
            path = ".".join((*key_path, str(k)))
            ex.value(v, path)  # only to find the tensors it holds (ex.unwritten); nothing of it is kept
            ex._skip(path, f"a non-tensor value inside the state dict ({_kind_of(v)})")
    for k, v in list(obj.items()):
        if is_optimizer_key(k) and k != key_path[0]:
            if not include_optimizer:
                report.excluded.append(str(k))
                continue
            r = ex.value(v, str(k), opt=True)
        else:
            r = ex.value(v, str(k))
        if r is not _OMIT:
            extra[str(k)] = r
    if unwritten is not None:
        unwritten += ex.unwritten
    return ({} if ex.too_big else extra), ex.opt_tensors


def optimizer_extras(
    src: str, obj: Any, include_optimizer: bool, report: ConvertReport, name: str
) -> tuple[dict[str, Any], list[tuple[str, Any]]]:
    """An optimizer state saved on its own (``optimizer.pt``, ``optimizer.bin``) as metadata and tensors.

    Args:
        src: the file (for the message).
        obj: its object (``{"state": ..., "param_groups": ...}`` or a DeepSpeed partition).
        include_optimizer: write its tensors; without it the optimizer is refused (it is not model weights).
        report: gets ``skipped``, ``placeholders``, ``converted``.
        name: the entry name: tensors become ``<name>.<path>`` and the metadata holds ``{name: ...}``.

    Returns:
        ``(extra, tensors)`` as :func:`split_checkpoint`.

    Raises:
        NoModelWeightsError: ``include_optimizer`` is False.
    """
    if not include_optimizer:
        from ckptfix.errors import NoModelWeightsError

        raise NoModelWeightsError(
            f"{src}: an optimizer state, not model weights; pass --include-optimizer (include_optimizer=True) "
            f"to write its tensors as {name}.state.<param>.<name>, or convert the model file beside it"
        )
    ex = _Extras(None, report)
    r = ex.value(obj, name, opt=True)
    for i, (n, t) in enumerate(ex.opt_tensors):  # _Extras names them optimizer.<path>; the path starts at name
        ex.opt_tensors[i] = (n[len("optimizer.") :], t)
    r = _rename_refs(r, len("optimizer."))
    return ({name: r} if r is not _OMIT and not ex.too_big else {}), ex.opt_tensors


def _rename_refs(v: Any, cut: int) -> Any:
    if isinstance(v, dict):
        if set(v) == {"__tensor__"}:
            return {"__tensor__": v["__tensor__"][cut:]}
        return {k: _rename_refs(x, cut) for k, x in v.items()}
    if isinstance(v, list):
        return [_rename_refs(x, cut) for x in v]
    return v


def plain_extras(obj: Any) -> dict[str, Any]:
    """A mapping's JSON-representable entries (what convert keeps of a checkpoint's non-tensor part).

    Args:
        obj: a mapping read from a checkpoint (a Lightning ``meta.pt``).

    Returns:
        entry -> JSON data; entries that cannot be represented (and tensors) are left out.
    """
    ex = _Extras(None, ConvertReport(source="", outputs=[]))
    out: dict[str, Any] = {}
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            r = ex.value(v, str(k))
            if r is not _OMIT:
                out[str(k)] = r
    return {} if ex.too_big else out
