"""CPython's own unpicklers as oracles: which globals would they import from a pickle?

``c_imports``: the C unpickler (what ``torch.load`` uses) with ``find_class``
overridden to record the names as written and hand back a harmless class.
``py_imports``: the pure-Python ``pickle._Unpickler`` running its *own*
``find_class`` (so its protocol-dependent ``_compat_pickle`` mapping is the
stdlib's code, not ours), with ``__import__`` and ``sys.modules`` in the
``pickle`` module's namespace swapped for recorders while it runs, so nothing
is imported and nothing is called.
"""

from __future__ import annotations

import io
import pickle
import sys
import types


class _HMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _harmless_class()


class Harmless(metaclass=_HMeta):
    """Stands for every global: any call, attribute, item or state is accepted and ignored."""

    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        pass

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return Harmless

    def append(self, x):
        pass

    def extend(self, xs):
        pass

    def add(self, x):
        pass

    def __setitem__(self, k, v):
        pass

    def __call__(self, *args, **kwargs):
        return Harmless()

    def __hash__(self):
        return 0


def _harmless_class():
    return type("H", (Harmless,), {})


def c_imports(data: bytes, encoding: str = "ASCII") -> list[tuple[str, str]]:
    """Names (as written) the C unpickler asks for, in order, until it stops."""
    seen: list[tuple[str, str]] = []

    class Rec(pickle.Unpickler):
        def find_class(self, module, name):
            seen.append((module, name))
            return _harmless_class()

        def persistent_load(self, pid):
            return Harmless()

    try:
        Rec(io.BytesIO(data), encoding=encoding).load()
    except Exception:  # noqa: BLE001 - the oracle only reports what was asked for before any error
        pass
    return seen


class _FakeModule(types.ModuleType):
    def __init__(self, name, log):
        super().__init__(name)
        object.__setattr__(self, "_log", log)

    def __getattr__(self, attr):
        self._log.append(("getattr", self.__name__, attr))
        return _harmless_class()


class _FakeSys:
    def __init__(self, log):
        self.log = log

    @property
    def modules(self):
        log = self.log

        class M(dict):
            def __getitem__(self, k):
                return _FakeModule(k, log)

        return M()

    @staticmethod
    def audit(*a):
        pass

    def __getattr__(self, name):
        return getattr(sys, name)


def py_imports(data: bytes, encoding: str = "ASCII") -> list[tuple[str, str]]:
    """Resolved (module, name) the pure-Python unpickler would import, by its own find_class."""
    log: list[tuple] = []
    out: list[tuple[str, str]] = []

    class Rec(pickle._Unpickler):  # type: ignore[name-defined]
        def find_class(self, module, name):
            start = len(log)
            try:
                super().find_class(module, name)
            finally:
                imported = [e[1] for e in log[start:] if e[0] == "import"]
                attrs = [e[2] for e in log[start:] if e[0] == "getattr"]
                if imported:
                    first = attrs[0] if attrs else name
                    rest = name.split(".", 1)[1] if ("." in name and self.proto >= 4) else None
                    out.append((imported[0], first + ("." + rest if rest else "")))
            return _harmless_class()

        def persistent_load(self, pid):
            return Harmless()

    def fake_import(module, *a, **kw):
        log.append(("import", module))

    saved = pickle.__dict__.get("__import__"), pickle.sys
    pickle.__import__ = fake_import
    pickle.sys = _FakeSys(log)
    try:
        try:
            Rec(io.BytesIO(data), encoding=encoding).load()
        except Exception:  # noqa: BLE001
            pass
    finally:
        if saved[0] is None:
            del pickle.__import__
        else:  # pragma: no cover
            pickle.__import__ = saved[0]
        pickle.sys = sys
    return out
