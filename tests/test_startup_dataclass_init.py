"""ckptfix._dataclass makes the plain ``__init__`` without compiling it (issue 25, start-up): the same function as
dataclasses.dataclass's, field for field (code, names, defaults, annotations, qualified name, errors)."""

from __future__ import annotations

import dataclasses
import inspect
import pickle
import sys
from dataclasses import field
from typing import ClassVar

import pytest

import ckptfix._dataclass as cd
from ckptfix._dataclass import dataclass as fast
from ckptfix._dataclass_inits import FACTORY_KEYS


def _bodies():
    """(name, maker, whether its __init__ is the plain one): maker(decorator) -> the class."""

    def none(deco):
        @deco
        class Empty:
            """No field."""

        return Empty

    def one(deco):
        @deco(frozen=True)
        class One:
            """One field."""

            a: int

        return One

    def defaults(deco):
        @deco
        class Defaults:
            """Defaults, a field() default, a ClassVar-free body."""

            a: int
            b: str = "x"
            c: float = field(default=1.5, repr=False)
            d: tuple = ()

            def method(self) -> int:
                return self.a

        return Defaults

    def wide(deco):
        @deco(frozen=True)
        class Wide:
            """Twenty-two fields, as InspectReport."""

            f0: int
            f1: int
            f2: int
            f3: int
            f4: int
            f5: int
            f6: int
            f7: int
            f8: int
            f9: int
            f10: int
            f11: int
            f12: int
            f13: int
            f14: int
            f15: int
            f16: int
            f17: int
            f18: int
            f19: int = 19
            f20: int = 20
            f21: int = 21

        return Wide

    def factory(deco):
        @deco
        class Factory:
            """A default_factory: a closure over it."""

            a: int
            c: list = field(default_factory=list)

        return Factory

    def factories(deco):
        @deco(frozen=True)
        class Factories:
            """Factories whose names sort apart from their order (the code's free variables are sorted)."""

            zed: list = field(default_factory=list)
            b: int = 2
            alpha: dict = field(default_factory=dict)
            mid: set = field(default_factory=set)
            last: str = "z"

        return Factories

    def late_factory(deco):
        @deco
        class LateFactory:
            """A plain field after a plain default, then a factory not precompiled."""

            a: int
            b: str = "b"
            c: int = 3
            d: bytearray = field(default_factory=bytearray)
            e: bytes = b""

        return LateFactory

    def classvar(deco):
        @deco
        class WithClassVar:
            """A ClassVar: the standard __init__."""

            a: int
            K: ClassVar[int] = 3

        return WithClassVar

    def post(deco):
        @deco
        class Post:
            """__post_init__: the standard __init__."""

            a: int

            def __post_init__(self) -> None:
                self.b = self.a + 1

        return Post

    def nodoc(deco):
        @deco
        class NoDoc:
            a: int

        return NoDoc

    return [
        ("none", none, True),
        ("one", one, True),
        ("defaults", defaults, True),
        ("wide", wide, True),
        ("factory", factory, True),
        ("factories", factories, True),
        ("late_factory", late_factory, True),
        ("classvar", classvar, False),
        ("post", post, False),
        ("nodoc", nodoc, False),
    ]


def _standard(cls=None, **kw):
    """dataclasses.dataclass, not frozen: ckptfix._dataclass's frozen classes assign their fields through their own
    ``__setattr__`` (the standard frozen ``__init__`` calls ``object.__setattr__``)."""
    kw["frozen"] = False
    return dataclasses.dataclass(**kw) if cls is None else dataclasses.dataclass(cls, **kw)


CODE = ("co_code", "co_varnames", "co_names", "co_consts", "co_argcount", "co_kwonlyargcount", "co_flags")
CODE += ("co_name", "co_filename", "co_firstlineno", "co_nlocals", "co_stacksize")
CODE += ("co_qualname",) if sys.version_info >= (3, 11) else ()
#: whether this Python's dataclasses compiles the text of ckptfix._dataclass.init_source (3.11's; elsewhere the
#: behaviour is compared, not the bytecode)
SAME_TEXT = sys.version_info[:2] == (3, 11)


@pytest.mark.parametrize(("name", "make", "plain"), _bodies(), ids=[b[0] for b in _bodies()])
def test_the_same_init_as_the_standard_decorator(name, make, plain):
    Std, Fast = make(_standard), make(fast)
    s, f = Std.__init__, Fast.__init__
    if SAME_TEXT or not plain:  # the text _dataclass_inits holds is Python 3.11's dataclasses'
        for attr in CODE:
            assert getattr(f.__code__, attr) == getattr(s.__code__, attr), attr
        # the same lines; the columns (co_positions) follow the field names' lengths in a source text that does
        # not exist ("<string>": no traceback shows it)
        assert list(f.__code__.co_lines()) == list(s.__code__.co_lines())
    assert f.__defaults__ == s.__defaults__ and f.__kwdefaults__ == s.__kwdefaults__
    assert f.__annotations__ == s.__annotations__
    assert f.__qualname__ == s.__qualname__ and f.__name__ == s.__name__ and f.__module__ == s.__module__
    assert f.__globals__ is s.__globals__
    assert str(inspect.signature(Fast)) == str(inspect.signature(Std))
    assert Fast.__doc__ == Std.__doc__ and Fast.__match_args__ == Std.__match_args__
    assert Fast.__dataclass_params__.init is True
    n = len(dataclasses.fields(Std))
    args = list(range(n))
    assert repr(Fast(*args)).split("(", 1)[1] == repr(Std(*args)).split("(", 1)[1]
    with pytest.raises(TypeError) as es:
        Std(*args, 99)
    with pytest.raises(TypeError) as ef:
        Fast(*args, 99)
    assert str(ef.value) == str(es.value)
    # plain ones are made without compiling (one code per shape, shared), their closure holds the factories
    key = cd.init_key(dataclasses.fields(Std))
    assert (key in cd._INIT_CODE and f.__code__.co_code == cd._INIT_CODE[key].co_code) or not plain
    assert f.__code__.co_freevars == s.__code__.co_freevars
    assert [c.cell_contents for c in f.__closure__ or ()] == [c.cell_contents for c in s.__closure__ or ()]
    if key[1]:  # each instance a fresh value from the factory
        required = [i for i, x in enumerate(dataclasses.fields(Std)) if x.default is x.default_factory]
        a, b, c = Fast(*required), Fast(*required), Std(*required)
        for i in key[1]:
            name = dataclasses.fields(Std)[i].name
            assert getattr(a, name) == getattr(c, name) and getattr(a, name) is not getattr(b, name)
    # the fields, params and match args are the standard decorator's (made without it)
    for x, y in zip(dataclasses.fields(Fast), dataclasses.fields(Std), strict=True):
        for slot in dataclasses.Field.__slots__:
            assert getattr(x, slot) == getattr(y, slot), (x.name, slot)
    for slot in type(Std.__dataclass_params__).__slots__:
        if slot != "frozen":  # _standard is never frozen
            assert getattr(Fast.__dataclass_params__, slot) == getattr(Std.__dataclass_params__, slot), slot
    skip = {"__dict__", "__weakref__", "__dataclass_params__", "__dataclass_fields__", "__hash__"}  # (frozen)
    for k in (set(vars(Std)) & set(vars(Fast))) - skip:  # __match_args__, __doc__, the defaults left on the class
        if not callable(vars(Std)[k]):
            assert vars(Fast)[k] == vars(Std)[k], k
    assert set(vars(Std)) ^ set(vars(Fast)) <= {"__setattr__", "__delattr__"}
    bare = make(lambda c=None, **k: (lambda x: x) if c is None else c)
    assert cd._plain_fields(bare, True, False, False, False, False) == plain


def test_a_default_before_a_plain_field_is_refused_as_dataclasses_does():
    def make(deco):
        @deco
        class Bad:
            """Wrong order."""

            a: int = 1
            b: int  # type: ignore[misc]

        return Bad

    with pytest.raises(TypeError) as es:
        make(dataclasses.dataclass)
    with pytest.raises(TypeError) as ef:
        make(fast)
    assert str(ef.value) == str(es.value)


def test_real_records_with_the_plain_init_still_pickle():
    from ckptfix.formats.base import Member

    m = Member("a", 1, 2, 3, False)
    assert pickle.loads(pickle.dumps(m)) == m and dataclasses.replace(m, name="b").name == "b"


def test_the_precompiled_inits_are_the_generated_text_and_compile_the_same():
    path = cd.__file__.replace("_dataclass.py", "_dataclass_inits.py")
    with open(path, encoding="utf-8") as f:
        assert f.read() == cd.inits_module_text(FACTORY_KEYS), "regenerate: python -m ckptfix._dataclass"
    cd._init_code((0, ()))  # loads them
    keys = [(n, ()) for n in range(cd.MAX_PRECOMPILED + 1)] + list(FACTORY_KEYS)
    for key in keys:
        ns: dict = {}
        exec(compile(cd.init_source(key), "<string>", "exec", dont_inherit=True), {}, ns)
        fresh = cd._inner(ns["__create_fn__"].__code__)
        for attr in (*CODE, "co_freevars"):
            assert getattr(cd._INIT_CODE[key], attr) == getattr(fresh, attr), (key, attr)
        assert cd._INIT_CODE[key].co_linetable == fresh.co_linetable


def test_every_record_of_the_package_has_a_precompiled_init():
    """Every shape ckptfix's own records have is in _dataclass_inits (none compiled at run time, by any command);
    a new one fails here until the file is regenerated (``python -m ckptfix._dataclass``)."""
    import subprocess

    from tests.helpers import ROOT

    child = "import ckptfix._dataclass as cd\nprint(repr(cd.package_keys()))\n"
    p = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    compiled = eval(p.stdout)
    assert set(compiled) <= set(FACTORY_KEYS), "regenerate: python -m ckptfix._dataclass"


def test_more_fields_than_precompiled_compile_once():
    n = cd.MAX_PRECOMPILED + 3
    ns: dict = {"__annotations__": {f"x{i}": "int" for i in range(n)}, "__doc__": "Wide.", "__module__": __name__}
    Wide = fast(type("Wide", (), ns))
    Std = _standard(type("Wide", (), dict(ns, __annotations__=dict(ns["__annotations__"]))))
    assert (n, ()) in cd._INIT_CODE and (
        Wide.__init__.__code__.co_code == Std.__init__.__code__.co_code or not SAME_TEXT
    )
    assert repr(Wide(*range(n))).endswith(f"x{n - 1}={n - 1})")


def test_the_start_up_records_have_docstrings():
    """A record without a docstring gets one written from ``inspect.signature`` by dataclasses (0.1-1 ms), and
    its ``__init__`` compiled: every record the four start-up commands make has a docstring."""
    import subprocess
    import sys

    from tests.helpers import ROOT

    child = (
        "import importlib, ckptfix._dataclass as cd\n"
        "made = []\n"
        "process = cd._process\n"
        "def spy(cls, **kw):\n"
        "    made.append((cls.__qualname__, cls.__dict__.get('__doc__')))  # before dataclasses writes one\n"
        "    return process(cls, **kw)\n"
        "cd._process = spy\n"
        "for m in ['ckptfix.cli.ckpt', 'ckptfix.cli.gpu', 'ckptfix.gpu.pick', 'ckptfix.ops.scan',\n"
        "          'ckptfix.ops.inspect', 'ckptfix.ops.prefixes.rename', 'ckptfix.formats.hfarch']:\n"
        "    importlib.import_module(m)\n"
        "assert not cd.COMPILED, cd.COMPILED  # every start-up record's __init__ precompiled\n"
        "print(len(made), *[name for name, doc in made if not doc])\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", child],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT)},
    )
    assert p.returncode == 0, p.stderr
    count, *undocumented = p.stdout.split()
    assert int(count) > 20 and undocumented == []
