"""Wrapper tensor subclasses read torch-free: torchao's quantized tensors as their inner tensors.

``torch.save`` writes a wrapper subclass (a tensor with no storage of its own, e.g. torchao's
``Int8Tensor``) as ``torch._tensor._rebuild_from_type_v2(torch._utils._rebuild_wrapper_subclass, cls,
(cls, dtype, size, stride, storage_offset, layout, device, requires_grad), state)``, where ``state`` is
the instance's ``__dict__``: its inner tensors (``qdata``, ``scale``, ``zero_point`` ...) as ordinary
tensor records and its attributes (``block_size``, ``act_quant_kwargs`` ...) as plain data and
placeholders.  For the classes in :data:`SUBCLASSES` the reader builds a :class:`SubclassRecord`: the
dense shape and dtype the wrapper stands for, the dtype its values are stored in, and every inner
tensor and attribute, so inspect shows what the file holds and convert can write the inner tensors.

Nothing is imported or called: the classes are known by their exact global names (the ones torchao
itself allowlists with ``torch.serialization.add_safe_globals``; :mod:`ckptfix.pickles.policy` lists
them), and the attribute objects stay inert placeholders.  :func:`encode_attribute` and
:func:`decode_attribute` translate those attributes to and from the JSON torchao writes into a
safetensors ``__metadata__`` (``torchao.prototype.safetensors``), table-driven by :data:`HELPERS`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from ckptfix.pickles.records import ELEMENT_SIZE, TensorRecord
from ckptfix.pickles.stub import Stub, global_name, stub_class, stub_dtype

#: the package that defines the classes below, and that must be imported for torch.load to take them
PACKAGE = "torchao"


@dataclass(frozen=True)
class SubclassSpec:
    """One torchao tensor subclass: its inner tensors and attributes (torchao's own class attributes).

    Attributes:
        module: the module the pickle names it under (``torchao.quantization``).
        name: the class name (``Int8Tensor``), also its ``_type`` in torchao's safetensors metadata.
        data: ``tensor_data_names`` (always present).
        optional_data: ``optional_tensor_data_names`` (None when absent).
        attributes: ``tensor_attribute_names``.
        optional_attributes: ``optional_tensor_attribute_names``.
        stored: how the values are stored: ``None`` (in ``qdata``'s dtype), ``"target_dtype"`` (in int8,
            holding the attribute's narrower dtype), or a dtype name (``"int4"``: two values per byte).
        dtype_from: where the dense dtype comes from when rebuilding: ``"dtype"`` (the attribute) or an
            inner tensor's name (its dtype).
    """

    module: str
    name: str
    data: tuple[str, ...]
    optional_data: tuple[str, ...] = ()
    attributes: tuple[str, ...] = ()
    optional_attributes: tuple[str, ...] = ()
    stored: str | None = None
    dtype_from: str = "dtype"

    @property
    def full_name(self) -> str:
        """``module.name`` as pickled."""
        return f"{self.module}.{self.name}"

    @property
    def data_names(self) -> tuple[str, ...]:
        """Every inner tensor name, required then optional (torchao's flatten order)."""
        return self.data + self.optional_data

    @property
    def attribute_names(self) -> tuple[str, ...]:
        """Every attribute, optional then required (the order torchao's metadata encoder writes)."""
        return self.optional_attributes + self.attributes


_Q = "torchao.quantization"

#: the torchao tensor subclasses read as their inner tensors (torchao 0.18's ALLOWED_TENSORS_SUBCLASSES of
#: ``torchao.quantization``), by their global name as pickled
SUBCLASSES: dict[str, SubclassSpec] = {
    s.full_name: s
    for s in (
        SubclassSpec(
            _Q,
            "Int8Tensor",
            ("qdata", "scale"),
            ("zero_point", "act_quant_scale", "act_quant_zero_point", "act_pre_scale"),
            ("block_size", "dtype"),
            ("act_quant_kwargs", "reduce_range"),
        ),
        SubclassSpec(
            _Q,
            "Float8Tensor",
            ("qdata", "scale"),
            (),
            (),
            ("block_size", "mm_config", "act_quant_kwargs", "kernel_preference", "dtype"),
        ),
        SubclassSpec(
            _Q,
            "IntxUnpackedToInt8Tensor",
            ("qdata", "scale", "zero_point"),
            (),
            ("target_dtype", "block_size", "dtype", "activation_quantization"),
            stored="target_dtype",
        ),
        SubclassSpec(
            _Q,
            "Int4Tensor",
            ("qdata", "scale", "zero_point"),
            ("act_pre_scale",),
            ("block_size", "shape"),
            ("activation_dtype",),
            stored="int4",
            dtype_from="scale",
        ),
        SubclassSpec(
            _Q,
            "Int4PlainInt32Tensor",
            ("qdata", "scale", "zero_point"),
            ("act_pre_scale",),
            ("block_size", "shape"),
            stored="int4",
            dtype_from="scale",
        ),
        SubclassSpec(
            _Q,
            "Int4TilePackedTo4dTensor",
            ("qdata", "scale_and_zero"),
            ("act_pre_scale",),
            ("block_size", "shape"),
            stored="int4",
            dtype_from="scale_and_zero",
        ),
    )
}

#: the name torchao's metadata gives each class (its ``_type``) -> the spec
BY_TYPE: dict[str, SubclassSpec] = {s.name: s for s in SUBCLASSES.values()}


@dataclass(frozen=True)
class Helper:
    """An attribute class torchao's metadata encodes (``{"_type": name, "_data": ...}``).

    Attributes:
        module: its module as pickled.
        name: its class name (the ``_type``).
        kind: ``"dataclass"`` (pickled ``cls.__new__(cls)`` + a ``__dict__`` state), ``"namedtuple"``
            (``cls.__new__(cls, *fields)``) or ``"enum"`` (``cls(value)``).
        fields: the dataclass / namedtuple fields, in order.
        members: an enum's ``value -> name``.
    """

    module: str
    name: str
    kind: str
    fields: tuple[str, ...] = ()
    members: tuple[tuple[Any, str], ...] = ()

    @property
    def full_name(self) -> str:
        """``module.name`` as pickled."""
        return f"{self.module}.{self.name}"


_W = "torchao.quantization.quantize_.workflows"

#: the attribute classes torchao's metadata names (torchao 0.18's ALLOWED_CLASSES that these tensors hold)
HELPERS: dict[str, Helper] = {
    h.full_name: h
    for h in (
        Helper(f"{_Q}.granularity", "PerRow", "dataclass", ("dim",)),
        Helper(f"{_Q}.granularity", "PerTensor", "dataclass", ()),
        Helper(
            f"{_Q}.quant_primitives",
            "MappingType",
            "enum",
            members=((1, "SYMMETRIC"), (2, "SYMMETRIC_NO_CLIPPING_ERR"), (3, "ASYMMETRIC")),
        ),
        Helper(
            f"{_Q}.quantize_.common.kernel_preference",
            "KernelPreference",
            "enum",
            members=(
                ("auto", "AUTO"),
                ("torch", "TORCH"),
                ("mslk", "MSLK"),
                ("emulated", "EMULATED"),
                ("triton", "TRITON"),
            ),
        ),
        Helper(
            f"{_W}.int8.int8_tensor",
            "QuantizeTensorToInt8Kwargs",
            "dataclass",
            ("granularity", "mapping_type", "reduce_range"),
        ),
        Helper(
            f"{_W}.float8.float8_tensor",
            "QuantizeTensorToFloat8Kwargs",
            "dataclass",
            ("float8_dtype", "granularity", "mm_config", "hp_value_lb", "hp_value_ub", "kernel_preference"),
        ),
        Helper(
            "torchao.float8.inference", "Float8MMConfig", "namedtuple", ("emulate", "use_fast_accum", "pad_inner_dim")
        ),
    )
}

_HELPER_BY_TYPE: dict[str, Helper] = {h.name: h for h in HELPERS.values()}

#: every global this module takes (for :mod:`ckptfix.pickles.policy`): the tensor classes and their attributes'
TORCHAO_GLOBALS: frozenset[str] = frozenset(SUBCLASSES) | frozenset(HELPERS)


# --------------------------------------------------------------------------- the record


@dataclass(eq=False)
class SubclassRecord(TensorRecord):
    """A torchao tensor subclass as the pickle holds it: the dense tensor it stands for, and its parts.

    ``shape``, ``stride`` and :attr:`numel` are the dense tensor's (the wrapper's); ``dtype`` is what its
    values are stored as (``int8``, ``float8_e4m3fn``, ``int4``); :attr:`dense_dtype` what it dequantizes
    to (``bfloat16``); :attr:`nbytes` the bytes of every inner tensor.  ``kind`` is ``"subclass"``.

    Attributes:
        spec: the class.
        dense_dtype: the wrapper's dtype.
        inner: inner tensor name -> its record (the ones present, not None), in the state's order.
        attributes: every other state entry (plain data and placeholders), in the state's order.
        device: the wrapper's device (``"cpu"``).
    """

    spec: SubclassSpec | None = None
    dense_dtype: str = "unknown"
    inner: dict[str, TensorRecord] = field(default_factory=dict)
    attributes: dict[str, Any] = field(default_factory=dict)
    device: str = "cpu"

    @property
    def nbytes(self) -> int:
        """Bytes of the inner tensors (what the file holds for it)."""
        return sum(t.nbytes for t in self.inner.values())

    @property
    def element_size(self) -> int:
        """Bytes per dense element (1 for int4 packed two per byte: rounded up)."""
        return ELEMENT_SIZE.get(self.dtype, 1)

    @property
    def location(self) -> str | None:
        """The inner ``qdata``'s storage tag (where the bytes were saved)."""
        first = next(iter(self.inner.values()), None)
        return first.location if first is not None else self.device

    @property
    def subclass(self) -> str:
        """The class's global name (``torchao.quantization.Int8Tensor``)."""
        return self.spec.full_name if self.spec else "?"

    def describe(self) -> str:
        """``torchao Int8Tensor: int8 qdata [32, 64] + scale, zero_point; dense bfloat16 [32, 64]``."""
        spec = self.spec
        assert spec is not None
        parts = [f"{n} {self.inner[n].dtype}{list(self.inner[n].shape)}" for n in self.inner]
        how = {
            "int4": "int4 packed two per byte",
            None: self.dtype,
        }.get(spec.stored, f"{self.dtype} values in int8")
        return f"torchao {spec.name} ({how}: {', '.join(parts)}) of a dense {self.dense_dtype} {list(self.shape)}"

    def __repr__(self) -> str:
        name = self.spec.name if self.spec else "?"
        return f"SubclassRecord({name}, {self.dtype}, shape={list(self.shape)}, dense={self.dense_dtype})"


def is_subclass_record(v: Any) -> bool:
    """Whether ``v`` is a torchao tensor read as its parts.

    Args:
        v: anything.

    Returns:
        True for a :class:`SubclassRecord`.
    """
    return isinstance(v, SubclassRecord)


def _shape_of(x: Any) -> tuple[int, ...] | None:
    if isinstance(x, Stub):  # torch.Size(...)
        x = x.args[0] if x.args else ()
    if isinstance(x, (tuple, list)) and len(x) <= 64 and all(type(v) is int and v >= 0 for v in x):
        return tuple(x)
    return None


def _device_of(x: Any) -> str:
    if isinstance(x, Stub) and x.full_name == "torch.device" and x.args and isinstance(x.args[0], str):
        return x.args[0] + (f":{x.args[1]}" if len(x.args) > 1 and isinstance(x.args[1], int) else "")
    return "cpu"


def build_record(new_type: Any, wrapper_args: Any, state: Any) -> SubclassRecord | None:
    """The :class:`SubclassRecord` of one ``_rebuild_from_type_v2(_rebuild_wrapper_subclass, ...)`` call.

    Args:
        new_type: the class the pickle names (a placeholder class).
        wrapper_args: ``(cls, dtype, size, stride, storage_offset, layout, device, requires_grad)``.
        state: the instance ``__dict__`` the pickle holds.

    Returns:
        The record, or None when the class is not one of :data:`SUBCLASSES` or the call is not shaped as
        torch writes it (the caller keeps its generic record).
    """
    if not (isinstance(new_type, type) and issubclass(new_type, Stub)):
        return None
    spec = SUBCLASSES.get(global_name(new_type))
    if spec is None or not isinstance(wrapper_args, tuple) or len(wrapper_args) < 8 or not isinstance(state, dict):
        return None
    dense = stub_dtype(wrapper_args[1])
    shape = _shape_of(wrapper_args[2])
    stride = _shape_of(wrapper_args[3])
    if dense is None or shape is None or stride is None or len(shape) != len(stride):
        return None
    inner: dict[str, TensorRecord] = {}
    attributes: dict[str, Any] = {}
    for k, v in state.items():
        if not isinstance(k, str):
            return None
        if k in spec.data_names:
            if v is None:
                continue
            if not isinstance(v, TensorRecord) or isinstance(v, SubclassRecord) or v.kind != "dense":
                return None
            inner[k] = v
        else:
            attributes[k] = v
    if any(n not in inner for n in spec.data):
        return None
    stored = inner[spec.data[0]].dtype
    if spec.stored == "target_dtype":
        stored = stub_dtype(attributes.get("target_dtype")) or stored
    elif spec.stored is not None:
        stored = spec.stored
    offset = wrapper_args[4] if type(wrapper_args[4]) is int else 0
    return SubclassRecord(
        None,
        offset,
        shape,
        stride,
        stored,
        bool(wrapper_args[7]) if isinstance(wrapper_args[7], bool) else False,
        "subclass",
        spec=spec,
        dense_dtype=dense,
        inner=inner,
        attributes=attributes,
        device=_device_of(wrapper_args[6]),
    )


# --------------------------------------------------------------------------- torchao's metadata JSON


class NotEncodable(ValueError):
    """An attribute value torchao's safetensors metadata has no encoding for."""


def _encode(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        return [_encode(x) for x in v]
    if isinstance(v, dict) and all(isinstance(k, str) for k in v):
        return {k: _encode(x) for k, x in v.items()}
    if isinstance(v, type) and issubclass(v, Stub):
        d = stub_dtype(v)
        if d is not None:
            return {"_type": "torch.dtype", "_data": d}
        raise NotEncodable(f"the class {global_name(v)}")
    if isinstance(v, Stub):
        if v.full_name == "torch.Size":
            return [_encode(x) for x in (v.args[0] if v.args else ())]
        h = HELPERS.get(v.full_name)
        if h is None:
            raise NotEncodable(f"a {v.full_name} object")
        if h.kind == "enum":
            value = v.args[0] if len(v.args) == 1 else None
            for val, name in h.members:
                if val == value and type(val) is type(value):
                    return {"_type": h.name, "_data": name}
            raise NotEncodable(f"{h.name}({value!r}), a value torchao {h.name} does not have")
        if h.kind == "namedtuple":
            if len(v.args) != len(h.fields):
                raise NotEncodable(f"a {h.name} with {len(v.args)} fields")
            return {"_type": h.name, "_data": {f: _encode(x) for f, x in zip(h.fields, v.args, strict=True)}}
        st = v.state if isinstance(v.state, dict) else {} if v.state is None else None
        if st is None or v.args:
            raise NotEncodable(f"a {h.name} not pickled as a dataclass")
        data = {f: _encode(st[f]) for f in h.fields if f in st}
        data.update({k: _encode(x) for k, x in st.items() if k not in data})
        return {"_type": h.name, "_data": data}
    raise NotEncodable(f"a {type(v).__name__}")


def encode_attribute(v: Any) -> Any:
    """One attribute value as torchao's ``TensorSubclassAttributeJSONEncoder`` writes it.

    Args:
        v: plain data, a dtype global, or a placeholder of one of :data:`HELPERS`.

    Returns:
        JSON-ready data (``{"_type": "PerRow", "_data": {"dim": -1}}``).

    Raises:
        NotEncodable: a value torchao's metadata cannot hold (named in the message).
    """
    return _encode(v)


def metadata_entry(rec: SubclassRecord) -> dict[str, Any]:
    """The ``__metadata__`` entry torchao's ``flatten_tensor_state_dict`` writes for this tensor (parsed).

    Args:
        rec: the tensor.

    Returns:
        ``{"_type": "Int8Tensor", "_data": {attributes}, "_tensor_data_names": [...]}``.

    Raises:
        NotEncodable: an attribute torchao's metadata cannot hold.
    """
    spec = rec.spec
    assert spec is not None
    data: dict[str, Any] = {}
    for name in spec.attribute_names:
        if name == "dtype" and name not in rec.attributes:
            data[name] = {"_type": "torch.dtype", "_data": rec.dense_dtype}
        elif name == "shape" and name not in rec.attributes:
            data[name] = list(rec.shape)
        else:
            data[name] = encode_attribute(rec.attributes.get(name))
    names = [n for n in spec.optional_data + spec.data if n in rec.inner]
    return {"_type": spec.name, "_data": data, "_tensor_data_names": names}


def flat_name(name: str, part: str) -> str:
    """The safetensors name of inner tensor ``part`` of ``name`` (``0.weight`` -> ``0._weight_qdata``).

    Args:
        name: the tensor's state-dict name (it must hold a dot: torchao splits at the last one).
        part: the inner tensor (``qdata``).

    Returns:
        ``module._attr_part``.
    """
    module, attr = name.rsplit(".", 1)
    return f"{module}._{attr}_{part}"


def decode_attribute(v: Any) -> Any:
    """The inverse of :func:`encode_attribute`: torchao's JSON back into what the pickle holds.

    Args:
        v: one decoded JSON value of a metadata entry's ``_data``.

    Returns:
        Plain data, a dtype placeholder class, or a placeholder object of one of :data:`HELPERS`
        (written back as the global it stands for).

    Raises:
        NotEncodable: a ``_type`` this module does not know.
    """
    if isinstance(v, list):
        return [decode_attribute(x) for x in v]
    if not (isinstance(v, dict) and "_type" in v and "_data" in v):
        if isinstance(v, dict):
            return {k: decode_attribute(x) for k, x in v.items()}
        return v
    t, data = v["_type"], v["_data"]
    if t == "torch.dtype":
        if not isinstance(data, str):
            raise NotEncodable(f"a torch.dtype {data!r}")
        return stub_class("torch", data)
    h = _HELPER_BY_TYPE.get(t) if isinstance(t, str) else None
    if h is None:
        raise NotEncodable(f"the type {t!r}")
    cls = stub_class(h.module, h.name)
    if h.kind == "enum":
        for val, name in h.members:
            if name == data:
                obj = cls(val)  # REDUCE cls(value): Stub.__init__ marks it a plain call
                return obj
        raise NotEncodable(f"{t}.{data}")
    if not isinstance(data, dict):
        raise NotEncodable(f"a {t} without fields")
    if h.kind == "namedtuple":
        return Stub.__new__(cls, *(decode_attribute(data.get(f)) for f in h.fields))
    obj = Stub.__new__(cls)
    obj.__dict__["_state"] = {k: decode_attribute(x) for k, x in data.items()}
    return obj


def spec_of_type(type_name: Any) -> SubclassSpec | None:
    """The spec torchao's metadata ``_type`` names.

    Args:
        type_name: ``"Int8Tensor"`` ...

    Returns:
        The spec, or None.
    """
    return BY_TYPE.get(type_name) if isinstance(type_name, str) else None


def dense_of(
    spec: SubclassSpec, data: Mapping[str, Any], inner: Mapping[str, TensorRecord]
) -> tuple[tuple[int, ...], str]:
    """The dense shape and dtype a tensor rebuilt from torchao's metadata has (as its class's ``__new__``).

    Args:
        spec: the class.
        data: the metadata entry's ``_data`` (decoded JSON).
        inner: its inner tensors.

    Returns:
        ``(shape, dtype name)``.

    Raises:
        NotEncodable: the entry lacks what the class needs.
    """
    shape: Any = data.get("shape")
    if shape is None:
        q = inner.get("qdata")
        if q is None:
            raise NotEncodable(f"a {spec.name} without qdata")
        shape = list(q.shape)
    if not (isinstance(shape, list) and all(type(s) is int and s >= 0 for s in shape)):
        raise NotEncodable(f"a {spec.name} shape {shape!r}")
    if spec.dtype_from == "dtype":
        d = data.get("dtype")
        dtype = d.get("_data") if isinstance(d, dict) else None
    else:
        t = inner.get(spec.dtype_from)
        dtype = t.dtype if t is not None else None
    if not isinstance(dtype, str):
        raise NotEncodable(f"a {spec.name} without its dtype")
    return tuple(shape), dtype


def subclass_notes(tensors: Mapping[str, Any]) -> list[str]:
    """Inspect's note on the torchao tensors of a state dict: which classes, how stored, what convert writes.

    Args:
        tensors: name -> tensor record.

    Returns:
        One note (none without torchao tensors).
    """
    subs = {n: t for n, t in tensors.items() if isinstance(t, SubclassRecord)}
    if not subs:
        return []
    counts: dict[str, int] = {}
    for t in subs.values():
        assert t.spec is not None
        counts[t.spec.name] = counts.get(t.spec.name, 0) + 1
    first_name, first = next(iter(subs.items()))
    kinds = ", ".join(f"{k} x{v}" for k, v in counts.items())
    return [
        f"{len(subs)} of {len(tensors)} tensors are torchao tensor subclasses ({kinds}), read as their inner "
        f"tensors: e.g. {first_name}: {first.describe()}; convert writes them in torchao's safetensors layout "
        "(inner tensors as MODULE._NAME_PART, the class in __metadata__), which transformers' TorchAoConfig "
        "loading and torchao's unflatten_tensor_state_dict read"
    ]


def flatten_named(named: list[tuple[str, Any]]) -> tuple[list[tuple[str, Any]], dict[str, str], dict[str, str]]:
    """Write torchao tensors as torchao's ``flatten_tensor_state_dict`` does: inner tensors, the class in metadata.

    Args:
        named: ``(name, tensor record)`` pairs of the output, in order.

    Returns:
        ``(pairs, metadata, written)``: every plain tensor as it was and each torchao tensor replaced by its inner
        tensors (``0._weight_qdata`` ...); the ``__metadata__`` entries torchao reads (one JSON entry per tensor
        name and ``tensor_names``; empty when there is no torchao tensor); ``{name: "Int8Tensor -> 0._weight_qdata,
        ..."}`` for the report.

    Raises:
        UnsupportedError: a torchao tensor whose name has no dot (torchao splits the module at the last one), an
            attribute torchao's metadata cannot hold, or a flattened name that collides with another tensor.
    """
    import json

    from ckptfix.errors import UnsupportedError

    if not any(isinstance(v, SubclassRecord) for _, v in named):
        return named, {}, {}
    out: list[tuple[str, Any]] = []
    meta: dict[str, str] = {}
    written: dict[str, str] = {}
    for name, v in named:
        if not isinstance(v, SubclassRecord):
            out.append((name, v))
            meta[name] = json.dumps({"_type": "Tensor"})
            continue
        assert v.spec is not None
        if "." not in name:
            raise UnsupportedError(
                f"tensor {name!r} is a torchao {v.spec.name} at the top level: torchao's safetensors layout names "
                "its parts MODULE._NAME_PART and needs a dotted name; add a prefix first (add-prefix) or drop it"
            )
        try:
            entry = metadata_entry(v)
        except NotEncodable as e:
            raise UnsupportedError(
                f"tensor {name!r} is a torchao {v.spec.name} whose attributes hold {e}, which torchao's safetensors "
                "metadata cannot hold; load it with torchao and save it with its own flatten_tensor_state_dict"
            ) from None
        parts = [(flat_name(name, part), t) for part, t in v.inner.items() if part in entry["_tensor_data_names"]]
        out.extend(parts)
        meta[name] = json.dumps(entry)
        written[name] = f"{v.spec.name} -> {', '.join(n for n, _ in parts)}"
    seen: set[str] = set()
    for n, _ in out:
        if n in seen:
            raise UnsupportedError(
                f"two tensors would both be written as {n!r} (a torchao tensor's part and another tensor); "
                "rename one first (strip-prefix / add-prefix) or drop it"
            )
        seen.add(n)
    meta["tensor_names"] = json.dumps([n for n, _ in named])
    return out, meta, written


def torchao_entries(meta: Mapping[str, str]) -> dict[str, str] | None:
    """The tensor entries of torchao's safetensors metadata, when the file has them.

    Args:
        meta: a safetensors file's ``__metadata__``.

    Returns:
        ``{tensor name: its class ("Int8Tensor", "Tensor")}`` in ``tensor_names`` order, or None when the
        metadata is not torchao's (no ``tensor_names``, or no entry naming a torchao tensor class).
    """
    import json

    raw = meta.get("tensor_names")
    if raw is None:
        return None
    try:
        names = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return None
    out: dict[str, str] = {}
    for n in names:
        try:
            entry = json.loads(meta.get(n, ""))
        except ValueError:
            return None
        t = entry.get("_type") if isinstance(entry, dict) else None
        if not isinstance(t, str):
            return None
        out[n] = t
    if not any(t in BY_TYPE for t in out.values()):
        return None
    return out


def layout_notes(meta: Mapping[str, str]) -> list[str]:
    """Inspect's note on a safetensors file in torchao's layout (transformers' TorchAoConfig, ckptfix convert).

    Args:
        meta: the file's ``__metadata__``.

    Returns:
        One note, or none when the metadata is not torchao's.
    """
    entries = torchao_entries(meta)
    if entries is None:
        return []
    counts: dict[str, int] = {}
    for t in entries.values():
        if t in BY_TYPE:
            counts[t] = counts.get(t, 0) + 1
    n = sum(counts.values())
    kinds = ", ".join(f"{k} x{v}" for k, v in counts.items())
    return [
        f"torchao's safetensors layout: {n} of {len(entries)} tensors are torchao tensor subclasses ({kinds}) stored "
        "as their inner tensors (MODULE._NAME_PART), the class in __metadata__; torchao's "
        "unflatten_tensor_state_dict (transformers' TorchAoConfig loading) or `ckptfix convert --to pt` (with "
        "torchao installed) rebuilds them"
    ]
