"""ckptfix._dataclass.dataclass makes the same classes as dataclasses.dataclass (cheaper to create: start-up)."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import field

import pytest

from ckptfix._dataclass import dataclass as fast


def _pair(**kw):
    """The same class body made by both decorators."""

    def body(deco):
        @deco(**kw)
        class Rec:
            """A record."""

            a: int
            b: str = "x"
            c: list = field(default_factory=list)
            hidden: int = field(default=0, repr=False)
            loose: float = field(default=0.0, compare=False)
            h: int = field(default=1, hash=False)

        return Rec

    return body(dataclasses.dataclass), body(fast)


@pytest.mark.parametrize("frozen", [False, True])
def test_the_same_repr_eq_hash_and_errors(frozen):
    Std, Fast = _pair(frozen=frozen)
    s, f = Std(1, "y", [2], hidden=5, loose=0.5, h=3), Fast(1, "y", [2], hidden=5, loose=0.5, h=3)
    assert repr(s) == repr(f) and (s == Std(1, "y", [2], hidden=5, loose=9.0, h=3)) == (
        f == Fast(1, "y", [2], hidden=5, loose=9.0, h=3)
    )
    assert repr(f) == f"{Fast.__qualname__}(a=1, b='y', c=[2], loose=0.5, h=3)"
    assert (
        f == Fast(1, "y", [2], hidden=5, loose=9.0, h=3) != Fast(1, "y", [2], hidden=6)
    )  # compare=False: not compared
    assert f != Fast(2, "y", [2])
    assert (f == s) is False and f.__eq__(s) is NotImplemented and f.__eq__(1) is NotImplemented
    assert dataclasses.fields(f) == tuple(dataclasses.fields(Fast))
    assert [x.name for x in dataclasses.fields(Fast)] == [x.name for x in dataclasses.fields(Std)]
    assert dataclasses.asdict(f) == dataclasses.asdict(s)
    assert dataclasses.replace(f, a=7).a == 7
    assert copy.deepcopy(f) == f and copy.copy(f) == f
    assert Fast.__eq__.__qualname__.endswith("Rec.__eq__") and Fast.__repr__.__qualname__.endswith("Rec.__repr__")
    if frozen:
        with pytest.raises(dataclasses.FrozenInstanceError):
            f.a = 2  # type: ignore[misc]
        f, g = Fast(1, "y", (2,), hidden=5), Fast(1, "y", (2,), hidden=5, loose=3.0, h=99)  # type: ignore[arg-type]
        assert hash(f) == hash(g)  # hash=False and compare=False fields are not hashed
        assert hash(f) == hash(Std(1, "y", (2,), hidden=5)) == hash((1, "y", (2,), 5))  # type: ignore[arg-type]
    else:
        assert Fast.__hash__ is None and Std.__hash__ is None
        f.a = 3
        assert f.a == 3


def test_no_fields_one_field_and_recursion():
    @fast(frozen=True)
    class Empty:
        pass

    @fast(frozen=True)
    class One:
        x: int

    @fast
    class Node:
        child: object = None

    assert Empty() == Empty() and hash(Empty()) == hash(()) and repr(Empty()).endswith("Empty()")
    assert One(1) == One(1) != One(2) and hash(One(1)) == hash((1,))
    n = Node()
    n.child = n
    assert repr(n).endswith("Node(child=...)")


def test_what_the_class_defines_itself_is_kept():
    @fast(frozen=True)
    class Own:
        x: int

        def __repr__(self) -> str:
            return "own"

        def __eq__(self, other: object) -> bool:
            return True

        def __hash__(self) -> int:
            return 5

    @fast
    class EqOnly:
        x: int

        def __eq__(self, other: object) -> bool:
            return False

    @fast(eq=False)
    class NoEq:
        x: int

    @fast(repr=False)
    class NoRepr:
        x: int

    assert repr(Own(1)) == "own" and Own(1) == Own(2) and hash(Own(1)) == 5
    assert EqOnly(1) != EqOnly(1) and EqOnly.__hash__ is None
    a = NoEq(1)
    assert a == a and a != NoEq(1) and isinstance(hash(a), int)
    assert repr(NoRepr(1)).startswith("<")


def test_slots_kw_only_inheritance_and_order():
    @fast(frozen=True, slots=True)
    class Slotted:
        x: int

    @fast(kw_only=True)
    class Kw:
        x: int

    @fast(frozen=True)
    class Base:
        x: int

    @fast(frozen=True)
    class Child(Base):
        y: int = 0

    @fast(order=True, frozen=True)
    class Ordered:
        x: int

    assert "__slots__" in Slotted.__dict__ and Slotted(1) == Slotted(1) and hash(Slotted(1)) == hash((1,))
    assert Kw(x=1).x == 1
    with pytest.raises(TypeError):
        Kw(1)  # type: ignore[misc]
    assert (
        repr(Child(1, 2)).endswith("Child(x=1, y=2)") and Child(1, 2) != Base(1) and hash(Child(1, 2)) == hash((1, 2))
    )
    assert Ordered(1) < Ordered(2)
    with pytest.raises(TypeError):

        @fast(frozen=False)
        class Thawed(Base):  # dataclasses' own rule: no non-frozen class from a frozen one
            z: int = 0


def test_frozen_instances_stay_frozen_and_params_say_what_was_asked():
    @fast(frozen=True)
    class F:
        x: int
        y: list = field(default_factory=list)

        def __post_init__(self) -> None:
            object.__setattr__(self, "extra", 1)  # what frozen classes do in __post_init__

    class Sub(F):  # not a dataclass: may have attributes of its own
        pass

    f = F(1)
    for attempt in (lambda: setattr(f, "x", 2), lambda: setattr(f, "y", []), lambda: setattr(f, "new", 1)):
        with pytest.raises(dataclasses.FrozenInstanceError):
            attempt()
    for name in ("x", "extra", "new"):
        with pytest.raises(dataclasses.FrozenInstanceError):
            delattr(f, name)
    assert (f.x, f.y, f.extra) == (1, [], 1)
    s = Sub(2)
    s.new = 3
    del s.new
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.x = 5
    with pytest.raises(dataclasses.FrozenInstanceError):
        del s.x
    for std, ours in [(dataclasses.dataclass(frozen=True), fast(frozen=True)), (dataclasses.dataclass, fast)]:

        class A:
            x: int

        class B:
            x: int

        assert repr(std(A).__dataclass_params__) == repr(ours(B).__dataclass_params__)


def test_frozen_classes_the_closures_cannot_serve_keep_the_standard_methods():
    @fast(frozen=True)
    class Late:
        x: int
        y: int = field(init=False, default=0)  # not set by __init__: a first assignment must still fail

    @fast(frozen=True)
    class Base:
        x: int

    @fast(frozen=True)
    class Child(Base):
        y: int = 0

    for obj, name in ((Late(1), "y"), (Child(1), "y"), (Child(1), "x")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, name, 5)
    with pytest.raises(TypeError):

        @fast(frozen=True)
        class Own:
            x: int

            def __setattr__(self, name: str, value: object) -> None:
                pass


def test_real_records_pickle_copy_and_replace():
    import copy
    import pickle

    from ckptfix.gpu.records import GpuProcess, SmiGpu

    g = SmiGpu(0, uuid="GPU-1", processes=(GpuProcess("GPU-1", 7, "python", 100),))
    assert pickle.loads(pickle.dumps(g)) == g == copy.deepcopy(g) == copy.copy(g)
    assert hash(pickle.loads(pickle.dumps(g))) == hash(g)
    h = dataclasses.replace(g, index=1)
    assert h.index == 1 and h != g and g.index == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.index = 3  # type: ignore[misc]
