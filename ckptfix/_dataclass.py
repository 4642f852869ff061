"""``dataclass``: :func:`dataclasses.dataclass`, cheaper to create at import (start-up of every command).

:func:`dataclasses.dataclass` compiles source code for each method it adds, one ``exec`` per method
(Python 3.11: ``__init__``, ``__repr__``, ``__eq__``, and for a frozen class ``__setattr__``,
``__delattr__``, ``__hash__``): about a quarter of a millisecond per class, paid by every command that
imports the class.  This decorator lets the standard one build ``__init__`` only, and adds the others as
closures over the field names, compiled once with this module.  They do what the generated ones do: the
same repr text (``...`` for a recursive one), the same tuple comparison and hash, ``NotImplemented`` for
another class, the same hash rules, :class:`dataclasses.FrozenInstanceError` on assigning or deleting a
field of a frozen instance (its ``__init__`` assigns each field once, through ``__setattr__``).  A frozen
class with a dataclass base, ``__slots__``, an ``init=False`` field or its own ``__init__`` /
``__setattr__`` / ``__delattr__`` gets the standard frozen methods.  The class is a real dataclass
(:func:`dataclasses.fields`, :func:`~dataclasses.replace`, :func:`~dataclasses.asdict` work; its
``__dataclass_params__`` say what was asked for).  ``order=True`` or ``unsafe_hash=True`` go to the
standard decorator unchanged.
"""

from __future__ import annotations

import abc
import dataclasses
import reprlib
import sys
from operator import attrgetter
from types import CellType, CodeType, FunctionType, MemberDescriptorType
from typing import TYPE_CHECKING, Any, Callable, TypeVar, overload

if TYPE_CHECKING:
    from typing_extensions import dataclass_transform
else:  # what type checkers read; nothing at run time (typing has it from Python 3.11)

    def dataclass_transform(**_: Any) -> Callable[[T], T]:
        return lambda f: f


__all__ = ["dataclass"]

T = TypeVar("T")


def _getter(names: tuple[str, ...]) -> Callable[[Any], tuple[Any, ...]]:
    """The values of ``names`` as a tuple (what the generated methods compare and hash)."""
    if len(names) >= 2:
        return attrgetter(*names)
    if len(names) == 1:
        one = attrgetter(names[0])
        return lambda obj: (one(obj),)
    return lambda obj: ()


def _qualify(cls: type, fn: Any) -> Any:
    fn.__qualname__ = f"{cls.__qualname__}.{fn.__name__}"
    return fn


def _make_repr(cls: type, names: tuple[str, ...]) -> Any:
    def __repr__(self: Any) -> str:
        return self.__class__.__qualname__ + "(" + ", ".join(f"{n}={getattr(self, n)!r}" for n in names) + ")"

    return reprlib.recursive_repr()(_qualify(cls, __repr__))


def _make_eq(cls: type, names: tuple[str, ...]) -> Any:
    values = _getter(names)

    def __eq__(self: Any, other: Any) -> Any:
        if other.__class__ is self.__class__:
            return values(self) == values(other)
        return NotImplemented

    return _qualify(cls, __eq__)


def _make_hash(cls: type, names: tuple[str, ...]) -> Any:
    values = _getter(names)

    def __hash__(self: Any) -> int:
        return hash(values(self))

    return _qualify(cls, __hash__)


def _make_frozen(owner: type, names: tuple[str, ...]) -> tuple[Any, Any]:
    """``__setattr__`` / ``__delattr__`` of a frozen class whose ``__init__`` assigns each field once."""
    fields = frozenset(names)

    def __setattr__(self: Any, name: str, value: Any) -> None:
        if type(self) is owner or name in fields:
            if name in fields and name not in self.__dict__:  # the __init__ setting it (the only first time)
                object.__setattr__(self, name, value)
                return
            raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")
        super(owner, self).__setattr__(name, value)  # type: ignore[arg-type]

    def __delattr__(self: Any, name: str) -> None:
        if type(self) is owner or name in fields:
            raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}")
        super(owner, self).__delattr__(name)  # type: ignore[arg-type]

    return _qualify(owner, __setattr__), _qualify(owner, __delattr__)


def _own_frozen(cls: type, init: bool, slots: bool) -> bool:
    """Whether a frozen class can take :func:`_make_frozen`'s methods: its generated ``__init__`` sets every
    field (no ``init=False`` field, no own ``__init__``), it has a ``__dict__`` and no dataclass base (whose
    frozen rules dataclasses checks)."""
    d = cls.__dict__
    return (
        init
        and not slots
        and not {"__slots__", "__init__", "__setattr__", "__delattr__"} & d.keys()
        and not any(isinstance(v, dataclasses.Field) and not v.init for v in d.values())
        and not any(hasattr(b, "__dataclass_fields__") for b in cls.__mro__[1:])
    )


#: an ``__init__`` shape: (the number of fields, the positions of the ``default_factory`` fields in the order of
#: their names, which is the order of the code's free variables)
Key = tuple[int, tuple[int, ...]]

#: the ``__init__`` code of each shape made so far (:func:`_plain_init`, :func:`_init_code`)
_INIT_CODE: dict[Key, CodeType] = {}

#: the shapes with factories :func:`_plain_init` has made (:func:`package_keys`)
USED: set[Key] = set()

#: the shapes compiled at run time, not found in :mod:`ckptfix._dataclass_inits`
#: (``tests/test_startup_dataclass_init.py`` checks that no start-up command compiles one)
COMPILED: list[Key] = []


def _plain_fields(cls: type, init: bool, kw_only: bool, slots: bool, frozen: bool, own_frozen: bool) -> bool:
    """Whether the standard ``__init__`` of ``cls`` is the plain one :func:`_plain_init` makes without compiling:
    every field a parameter assigned as is or from its ``default_factory`` (no ``init=False``, keyword-only
    field, ``InitVar``, ``ClassVar``), no ``__post_init__``, no field named ``self``, no dataclass base, a
    docstring (the standard decorator writes one from the signature), no own ``__init__``, no slots and no
    standard frozen ``__setattr__``."""
    d = cls.__dict__
    if not init or kw_only or slots or (frozen and not own_frozen) or "__init__" in d or not d.get("__doc__"):
        return False
    if hasattr(cls, "__post_init__") or any(hasattr(b, "__dataclass_fields__") for b in cls.__mro__[1:]):
        return False
    for name, ann in d.get("__annotations__", {}).items():
        if not isinstance(ann, str) or name == "self" or "Var" in ann or "KW_ONLY" in ann:  # ClassVar, InitVar
            return False
        v = d.get(name)
        if isinstance(v, dataclasses.Field) and (not v.init or v.kw_only is True):
            return False
    return True


def init_key(fields: tuple[dataclasses.Field[Any], ...]) -> Key:
    """The shape of the ``__init__`` of ``fields`` (:data:`Key`)."""
    factories = [i for i, f in enumerate(fields) if f.default_factory is not dataclasses.MISSING]
    return len(fields), tuple(sorted(factories, key=lambda i: fields[i].name))


def _plain_init(cls: type) -> Any:
    """The ``__init__`` :func:`dataclasses.dataclass` makes for a class of plain fields (:func:`_plain_fields`),
    without compiling it: its code is the one compiled for any class of the same shape (:data:`Key`), with the
    names replaced (the same bytecode, names, defaults, annotations, closure and qualified name)."""
    missing = dataclasses.MISSING
    fields = dataclasses.fields(cls)
    seen_default = False
    for f in fields:  # dataclasses' own check and message
        if f.default is not missing or f.default_factory is not missing:
            seen_default = True
        elif seen_default:
            raise TypeError(f"non-default argument {f.name!r} follows default argument")
    names = tuple(f.name for f in fields)
    key = init_key(fields)
    if key[1]:
        USED.add(key)
    code = _init_code(key)
    closure = None
    if key[1]:
        free = ("_HAS_DEFAULT_FACTORY", *(f"_dflt_{names[i]}" for i in key[1]))
        code = code.replace(co_freevars=free)
        cells = [CellType(dataclasses._HAS_DEFAULT_FACTORY)]  # type: ignore[attr-defined]
        cells += [CellType(fields[i].default_factory) for i in key[1]]
        closure = tuple(cells)
    code = code.replace(co_varnames=("self", *names), co_names=names)
    mod = sys.modules.get(cls.__module__)
    fn = FunctionType(code, mod.__dict__ if mod else {}, None, None, closure)
    defaults = []
    for f in fields:
        if f.default is not missing:
            defaults.append(f.default)
        elif f.default_factory is not missing:
            defaults.append(dataclasses._HAS_DEFAULT_FACTORY)  # type: ignore[attr-defined]
    fn.__defaults__ = tuple(defaults) or None
    fn.__annotations__ = {**{f.name: f.type for f in fields}, "return": None}
    fn.__qualname__ = f"{cls.__qualname__}.__init__"
    return fn


def _init_code(key: Key) -> CodeType:
    """The code of the ``__init__`` dataclasses compiles for fields of shape ``key`` (field names ``_0``,
    ``_1``...): from :mod:`ckptfix._dataclass_inits` (compiled with the package: up to :data:`MAX_PRECOMPILED`
    fields without factories, and the shapes of ckptfix's own records), else compiled here."""
    if not _INIT_CODE:
        from ckptfix._dataclass_inits import OUTER

        for k, outer in OUTER.items():  # as compiled from "<string>", its second line
            _INIT_CODE[k] = _inner(outer).replace(co_filename="<string>", co_firstlineno=2)
    code = _INIT_CODE.get(key)
    if code is None:
        ns: dict[str, Any] = {}
        exec(compile(init_source(key), "<string>", "exec", dont_inherit=True), {}, ns)  # not this module's __future__
        code = _INIT_CODE[key] = _inner(ns["__create_fn__"].__code__)
        COMPILED.append(key)
    return code


def _inner(outer: CodeType) -> CodeType:
    return next(c for c in outer.co_consts if isinstance(c, CodeType))


#: the field counts without factories :mod:`ckptfix._dataclass_inits` holds (0 to this)
MAX_PRECOMPILED = 24


def init_source(key: Key) -> str:
    """The text dataclasses (Python 3.11) compiles for the ``__init__`` of fields of shape ``key``, named ``_0``,
    ``_1``...: a factory's free variable is named by its rank (``_dflt__r00``...), so that the names sort, as the
    compiler orders free variables, as the real ones do; a default's value is not in the code."""
    n, factories = key
    rank = {i: r for r, i in enumerate(factories)}
    names = [f"_{i}" for i in range(n)]
    first_default = min(factories, default=n)
    params, body = ["self"], []
    for i, x in enumerate(names):
        if i in rank:
            params.append(f"{x}:_type_{x}=_HAS_DEFAULT_FACTORY")
            body.append(f"  self.{x}=_dflt__r{rank[i]:02d}() if {x} is _HAS_DEFAULT_FACTORY else {x}")
        else:
            params.append(f"{x}:_type_{x}" + ("=MISSING" if i > first_default else ""))
            body.append(f"  self.{x}={x}")
    factory_vars = [f"_dflt__r{r:02d}" for r in range(len(factories))]
    local_vars = ", ".join(
        [*(f"_type_{x}" for x in names), "MISSING", "_HAS_DEFAULT_FACTORY", "__dataclass_builtins_object__"]
        + factory_vars
        + ["_return_type"]
    )
    txt = f" def __init__({','.join(params)})->_return_type:\n" + ("\n".join(body) or "  pass")
    return f"def __create_fn__({local_vars}):\n{txt}\n return __init__"


def inits_module_text(factory_keys: tuple[Key, ...]) -> str:
    """The text of :mod:`ckptfix._dataclass_inits`: the shapes without factories up to :data:`MAX_PRECOMPILED`
    fields, and ``factory_keys`` (``tests/test_startup_dataclass_init.py`` checks the file, and that the
    start-up commands compile no shape)."""
    head = (
        "# ruff: noqa\n# fmt: off\n# mypy: ignore-errors\n"
        '"""Generated by ckptfix._dataclass.inits_module_text() (do not edit): the code of the ``__init__``\n'
        "dataclasses compiles for each shape of fields (ckptfix._dataclass.Key), compiled with the package, not per\n"
        'class at start-up.\n"""\n\n'
        f"FACTORY_KEYS = {factory_keys!r}\n"
        "OUTER = {}\n"
    )
    keys = [(n, ()) for n in range(MAX_PRECOMPILED + 1)] + list(factory_keys)
    parts = [f"{init_source(k)}\nOUTER[{k!r}] = __create_fn__.__code__\n" for k in keys]
    return head + "".join(parts)


def _set_params(cls: type, **actual: bool) -> None:
    """``__dataclass_params__`` as the standard decorator would have set it (the flags asked for)."""
    p = cls.__dataclass_params__  # type: ignore[attr-defined]
    try:
        q = object.__new__(type(p))
        for name in type(p).__slots__:
            object.__setattr__(q, name, getattr(p, name))
        for name, value in actual.items():
            object.__setattr__(q, name, value)
    except (AttributeError, TypeError):  # another Python's params: left as they are
        return
    cls.__dataclass_params__ = q  # type: ignore[attr-defined]


#: the Pythons whose ``dataclasses._process_class`` :func:`_fast_class` repeats (checked against it by
#: ``tests/test_startup_dataclass.py``); another Python gets the standard decorator for every class
_FAST_PYTHONS = ((3, 10), (3, 11), (3, 12), (3, 13))


def _fast_class(cls: type, *, repr: bool, eq: bool, frozen: bool, match_args: bool) -> bool:
    """Make ``cls`` a dataclass of plain fields (:func:`_plain_fields`) without :func:`dataclasses.dataclass`:
    the same fields, params and ``__match_args__`` its ``_process_class`` sets for such a class (its methods are
    added by :func:`_process`), at a tenth of the cost (it reads every annotation again to rule out ``ClassVar``
    and ``InitVar``, which a plain class has not).  False (the class untouched) where this Python is not one
    whose decorator this repeats."""
    if sys.version_info[:2] not in _FAST_PYTHONS or not hasattr(dataclasses, "_FIELD"):
        return False
    d = cls.__dict__
    annotations = d.get("__annotations__", {})
    fields = {}
    missing = dataclasses.MISSING
    for name, ann in annotations.items():
        default = getattr(cls, name, missing)
        if isinstance(default, dataclasses.Field):
            f = default
        else:
            if isinstance(default, MemberDescriptorType):  # a slot of a base: no default
                default = missing
            f = dataclasses.field(default=default)  # type: ignore[arg-type]
        f.name, f.type = name, ann
        f._field_type = dataclasses._FIELD  # type: ignore[attr-defined]
        if f.kw_only is missing:
            f.kw_only = False
        if f.default.__class__.__hash__ is None:
            raise ValueError(f"mutable default {type(f.default)} for field {name} is not allowed: use default_factory")
        fields[name] = f
    for name, value in d.items():  # dataclasses' own check and message
        if isinstance(value, dataclasses.Field) and name not in annotations:
            raise TypeError(f"{name!r} is a field but has no type annotation")
    flags = {"init": True, "repr": repr, "eq": eq, "order": False, "unsafe_hash": False, "frozen": frozen}
    flags.update(match_args=match_args, kw_only=False, slots=False, weakref_slot=False)  # (recorded from 3.12)
    params_type = getattr(dataclasses, "_DataclassParams", None)
    slots = getattr(params_type, "__slots__", ())
    if not slots or not set(slots) <= flags.keys():  # another Python's params
        return False
    params = object.__new__(params_type)  # type: ignore[arg-type]
    for name in slots:
        object.__setattr__(params, name, flags[name])
    for f in fields.values():
        if isinstance(d.get(f.name), dataclasses.Field):
            if f.default is missing:
                delattr(cls, f.name)
            else:
                setattr(cls, f.name, f.default)
    cls.__dataclass_params__ = params  # type: ignore[attr-defined]
    cls.__dataclass_fields__ = fields  # type: ignore[attr-defined]
    if match_args and "__match_args__" not in d:
        cls.__match_args__ = tuple(fields)  # type: ignore[attr-defined,misc]
    abc.update_abstractmethods(cls)
    return True


def _process(
    cls: type,
    *,
    init: bool,
    repr: bool,
    eq: bool,
    frozen: bool,
    match_args: bool,
    kw_only: bool,
    slots: bool,
    weakref_slot: bool,
) -> type:
    # what dataclasses reads before it changes the class (its own checks, in the same order)
    own_repr = repr and "__repr__" not in cls.__dict__
    own_eq = eq and "__eq__" not in cls.__dict__
    class_hash = cls.__dict__.get("__hash__", dataclasses.MISSING)
    has_explicit_hash = not (class_hash is dataclasses.MISSING or (class_hash is None and "__eq__" in cls.__dict__))
    own_frozen = frozen and _own_frozen(cls, init, slots)
    plain_init = _plain_fields(cls, init, kw_only, slots, frozen, own_frozen)
    extra = {"weakref_slot": True} if weakref_slot else {}  # (a parameter from Python 3.11)
    fast = plain_init and not weakref_slot and _fast_class(cls, repr=repr, eq=eq, frozen=frozen, match_args=match_args)
    if not fast:
        cls = dataclasses.dataclass(
            cls,
            init=init and not plain_init,
            repr=False,
            eq=False,
            frozen=frozen and not own_frozen,
            match_args=match_args,
            kw_only=kw_only,
            slots=slots,
            **extra,
        )
    fields = dataclasses.fields(cls)
    if plain_init:
        cls.__init__ = _plain_init(cls)  # type: ignore[misc]
    if own_repr:
        cls.__repr__ = _make_repr(cls, tuple(f.name for f in fields if f.repr))  # type: ignore[method-assign]
    if own_eq:
        cls.__eq__ = _make_eq(cls, tuple(f.name for f in fields if f.compare))  # type: ignore[method-assign]
    if eq and not has_explicit_hash:  # dataclasses' table for unsafe_hash=False
        if frozen:
            names = tuple(f.name for f in fields if (f.compare if f.hash is None else f.hash))
            cls.__hash__ = _make_hash(cls, names)  # type: ignore[method-assign]
        else:
            cls.__hash__ = None  # type: ignore[assignment]
    if own_frozen:
        cls.__setattr__, cls.__delattr__ = _make_frozen(cls, tuple(f.name for f in fields))  # type: ignore[method-assign]
    if not fast:
        _set_params(cls, init=init, repr=repr, eq=eq, frozen=frozen)
    return cls


@overload
def dataclass(cls: type[T], /) -> type[T]: ...


@overload
def dataclass(
    *,
    init: bool = True,
    repr: bool = True,
    eq: bool = True,
    order: bool = False,
    unsafe_hash: bool = False,
    frozen: bool = False,
    match_args: bool = True,
    kw_only: bool = False,
    slots: bool = False,
    weakref_slot: bool = False,
) -> Callable[[type[T]], type[T]]: ...


@dataclass_transform(field_specifiers=(dataclasses.field, dataclasses.Field))
def dataclass(
    cls: type[T] | None = None,
    /,
    *,
    init: bool = True,
    repr: bool = True,
    eq: bool = True,
    order: bool = False,
    unsafe_hash: bool = False,
    frozen: bool = False,
    match_args: bool = True,
    kw_only: bool = False,
    slots: bool = False,
    weakref_slot: bool = False,
) -> Any:
    """:func:`dataclasses.dataclass` with the same parameters and the same classes, cheaper to create."""

    def wrap(c: type[T]) -> type[T]:
        if order or unsafe_hash:
            extra = {"weakref_slot": True} if weakref_slot else {}
            return dataclasses.dataclass(
                c,
                init=init,
                repr=repr,
                eq=eq,
                order=order,
                unsafe_hash=unsafe_hash,
                frozen=frozen,
                match_args=match_args,
                kw_only=kw_only,
                slots=slots,
                **extra,
            )
        return _process(
            c,
            init=init,
            repr=repr,
            eq=eq,
            frozen=frozen,
            match_args=match_args,
            kw_only=kw_only,
            slots=slots,
            weakref_slot=weakref_slot,
        )

    return wrap if cls is None else wrap(cls)


def package_keys() -> list[Key]:
    """The shapes with factories of every record of ckptfix (every module imported; one whose optional dependency
    is missing is skipped): what :mod:`ckptfix._dataclass_inits` precompiles."""
    import importlib
    import os
    import pkgutil

    for m in pkgutil.walk_packages([os.path.dirname(os.path.abspath(__file__))], "ckptfix."):
        if not m.name.endswith("__main__"):
            try:
                importlib.import_module(m.name)
            except ModuleNotFoundError as e:  # an optional dependency (torch, fsspec...), not ckptfix's own
                if (e.name or "ckptfix").split(".")[0] == "ckptfix":
                    raise
    return sorted(USED)


if __name__ == "__main__":  # python -m ckptfix._dataclass: regenerate ckptfix/_dataclass_inits.py
    import ckptfix._dataclass as this  # the records register with the imported module, not __main__

    text = this.inits_module_text(tuple(this.package_keys()))
    with open(__file__.replace("_dataclass.py", "_dataclass_inits.py"), "w", encoding="utf-8") as out:
        out.write(text)
