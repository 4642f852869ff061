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

import dataclasses
import reprlib
import sys
from operator import attrgetter
from types import CodeType, FunctionType
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


#: the ``__init__`` code of a class of n plain fields (:func:`_plain_init`, :func:`_init_code`)
_INIT_CODE: dict[int, CodeType] = {}


def _plain_fields(cls: type, init: bool, kw_only: bool, slots: bool, frozen: bool, own_frozen: bool) -> bool:
    """Whether the standard ``__init__`` of ``cls`` is the plain one :func:`_plain_init` makes without compiling:
    every field a parameter assigned as is (no ``default_factory``, ``init=False``, keyword-only field,
    ``InitVar``, ``ClassVar``), no ``__post_init__``, no field named ``self``, no dataclass base, a docstring
    (the standard decorator writes one from the signature), no own ``__init__``, no slots and no standard
    frozen ``__setattr__``."""
    d = cls.__dict__
    if not init or kw_only or slots or (frozen and not own_frozen) or "__init__" in d or not d.get("__doc__"):
        return False
    if hasattr(cls, "__post_init__") or any(hasattr(b, "__dataclass_fields__") for b in cls.__mro__[1:]):
        return False
    for name, ann in d.get("__annotations__", {}).items():
        if not isinstance(ann, str) or name == "self" or "Var" in ann or "KW_ONLY" in ann:  # ClassVar, InitVar
            return False
        v = d.get(name)
        if isinstance(v, dataclasses.Field) and (
            not v.init or v.kw_only is True or v.default_factory is not dataclasses.MISSING
        ):
            return False
    return True


def _plain_init(cls: type) -> Any:
    """The ``__init__`` :func:`dataclasses.dataclass` makes for a class of plain fields (:func:`_plain_fields`),
    without compiling it: its code is the one compiled for any class with as many fields, with the names
    replaced (the same bytecode, names, defaults, annotations and qualified name)."""
    fields = dataclasses.fields(cls)
    seen_default = False
    for f in fields:  # dataclasses' own check and message
        if f.default is not dataclasses.MISSING:
            seen_default = True
        elif seen_default:
            raise TypeError(f"non-default argument {f.name!r} follows default argument")
    names = tuple(f.name for f in fields)
    code = _init_code(len(names))
    mod = sys.modules.get(cls.__module__)
    fn = FunctionType(code.replace(co_varnames=("self", *names), co_names=names), mod.__dict__ if mod else {})
    fn.__defaults__ = tuple(f.default for f in fields if f.default is not dataclasses.MISSING) or None
    fn.__annotations__ = {**{f.name: f.type for f in fields}, "return": None}
    fn.__qualname__ = f"{cls.__qualname__}.__init__"
    return fn


def _init_code(n: int) -> CodeType:
    """The code of the ``__init__`` dataclasses compiles for n plain fields (field names ``_0``, ``_1``...): from
    :mod:`ckptfix._dataclass_inits` (compiled with the package, up to :data:`MAX_PRECOMPILED` fields), else compiled."""
    if not _INIT_CODE:
        from ckptfix._dataclass_inits import OUTER

        for i, outer in enumerate(OUTER):  # as compiled from "<string>", its second line
            _INIT_CODE[i] = _inner(outer).replace(co_filename="<string>", co_firstlineno=2)
    code = _INIT_CODE.get(n)
    if code is None:
        ns: dict[str, Any] = {}
        exec(compile(init_source(n), "<string>", "exec", dont_inherit=True), {}, ns)  # not this module's __future__
        code = _INIT_CODE[n] = _inner(ns["__create_fn__"].__code__)
    return code


def _inner(outer: CodeType) -> CodeType:
    return next(c for c in outer.co_consts if isinstance(c, CodeType))


#: the field counts :mod:`ckptfix._dataclass_inits` holds (0 to this)
MAX_PRECOMPILED = 24


def init_source(n: int) -> str:
    """The text dataclasses (Python 3.11) compiles for the ``__init__`` of n plain fields named ``_0``, ``_1``..."""
    names = [f"_{i}" for i in range(n)]
    args = ",".join(["self", *(f"{x}:_type_{x}" for x in names)])
    body = "\n".join(f"  self.{x}={x}" for x in names) or "  pass"
    local_vars = ", ".join([*(f"_type_{x}" for x in names), "MISSING", "_HAS_DEFAULT_FACTORY"])
    txt = f" def __init__({args})->_return_type:\n{body}"
    return f"def __create_fn__({local_vars}, __dataclass_builtins_object__, _return_type):\n{txt}\n return __init__"


def inits_module_text() -> str:
    """The text of :mod:`ckptfix._dataclass_inits` (``tests/test_startup_dataclass_init.py`` checks the file)."""
    head = (
        "# ruff: noqa\n# fmt: off\n# mypy: ignore-errors\n"
        '"""Generated by ckptfix._dataclass.inits_module_text() (do not edit): the code of the ``__init__``\n'
        "dataclasses compiles for 0, 1, ... plain fields, compiled with the package, not per class at start-up.\n"
        '"""\n\n'
        "OUTER = []\n"
    )
    parts = [f"{init_source(n)}\nOUTER.append(__create_fn__.__code__)\n" for n in range(MAX_PRECOMPILED + 1)]
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
