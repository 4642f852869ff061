"""ckptfix.gpu.parse reads nvidia-smi's values by hand, not with regular expressions (issue 25, start-up: compiling
them cost ``gpus`` and ``pick-gpu`` about 0.8 ms): each scanner answers what its pattern answered, on every string.

The oracles are the patterns the parsers used before, matched with :mod:`re`.
"""

from __future__ import annotations

import random
import re

import pytest

from ckptfix.gpu import parse

NUM = re.compile(r"^([-+]?\d+(?:\.\d*)?|[-+]?\.\d+)\s*([A-Za-z%/]*)$")
FIELD_NUMBERS = {
    "index": r"\d+",
    "memory.total": r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)",
    "utilization.gpu": r"[-+]?\d+",
    "compute_cap": r"\d+\.\d+",
}
OTHER = {
    "uuid": re.compile(r"^(GPU|MIG)-[\w./-]+$"),
    "pci.bus_id": re.compile(r"^[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]$"),
    "mig.mode.current": re.compile(r"^(Enabled|Disabled)$", re.I),
    "driver_version": re.compile(r"^\d+(\.\d+)+$"),
}
TO_MIB = {"": 1.0, "mib": 1.0, "mb": 1.0, "m": 1.0, "gib": 1024.0, "gb": 1024.0, "g": 1024.0, "kib": 1 / 1024}
TO_MIB["kb"] = 1 / 1024


def parse_number_oracle(text: str | None, *, mib: bool = False) -> float | None:
    if text is None:
        return None
    m = NUM.match(text.strip())
    if not m:
        return None
    try:
        v = float(m.group(1))
    except ValueError:
        return None
    if mib:
        factor = TO_MIB.get(m.group(2).lower())
        if factor is None:
            return None
        v *= factor
    return v


def number_unit_oracle(number: str, value: str) -> tuple[str, str] | None:
    m = re.match(rf"^({number})\s*([A-Za-z%]*)$", value)
    return (m.group(1), m.group(2)) if m else None


def norm_header_oracle(cell: str) -> str:
    return re.sub(r"\s*\[[^\]]*\]\s*$", "", cell.strip()).strip().lower()


def compute_cap_oracle(text: str | None) -> tuple[int, int] | None:
    m = re.match(r"^\s*(\d+)\.(\d+)\s*$", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


#: what the random strings are made of: the characters the patterns care about, a few others, and non-ASCII
#: digits, spaces and letters that re's \d, \s, \w and re.I take
ALPHABET = list("0123456789+-. :%/[]_,abcdefABCDEFgiklmnsMGKiBWCz\t\n\x1c") + [
    "\u0663",  # ARABIC-INDIC DIGIT THREE: \d
    "\u00a0",  # NO-BREAK SPACE: \s
    "\u017f",  # LATIN SMALL LETTER LONG S: "s" under re.I
    "\u0131",  # LATIN SMALL LETTER DOTLESS I: "i" under re.I
    "\u212a",  # KELVIN SIGN
    "\u00e9",
    "\u00b2",  # SUPERSCRIPT TWO: isdigit(), not \d
]

SAMPLES = [
    "130013 MiB",
    "130013",
    "100 %",
    "11.17 W",
    "8.0",
    "8.",
    ".5",
    "-.5",
    "+3",
    "5.x",
    "5 M B",
    "5 MiB\n",
    "1e3",
    "GPU-4e9e74b7-abc",
    "MIG-1/2/3",
    "GPU-",
    "00000000:3A:00.0",
    "3A:00.0",
    "0000:3a:00.7",
    "0000:3a:00.8",
    "Enabled",
    "DISABLED",
    "Di\u017fabled",
    "Enabled\n",
    "570.124.06",
    "570.",
    "570",
    "memory.total [MiB]",
    "memory.total [MiB] [x]",
    "a[x[y]",
    "a[b]c]",
    "a [x] ",
    "[x]",
    " 8.0 \n",
    "\u0663.\u0663",
    "12\u00a0MiB",
]


def _strings(n: int, seed: int) -> list[str]:
    rnd = random.Random(seed)
    out = list(SAMPLES)
    for _ in range(n):
        out.append("".join(rnd.choice(ALPHABET) for _ in range(rnd.randint(0, 9))))
        # near misses of real values: one character changed, added or dropped
        s = list(rnd.choice(SAMPLES))
        k = rnd.randrange(len(s) + 1)
        op = rnd.randrange(3)
        if op == 0 and k < len(s):
            s[k] = rnd.choice(ALPHABET)
        elif op == 1:
            s.insert(k, rnd.choice(ALPHABET))
        elif k < len(s):
            del s[k]
        out.append("".join(s))
    return out


STRINGS = _strings(6000, 25)


def test_parse_number_answers_as_its_pattern():
    for s in STRINGS:
        for mib in (False, True):
            got, want = parse.parse_number(s, mib=mib), parse_number_oracle(s, mib=mib)
            assert got == want or (got != got and want != want), (s, mib)  # nan == nan


@pytest.mark.parametrize("column", sorted(FIELD_NUMBERS))
def test_field_numbers_answer_as_their_patterns(column):
    kind = parse._NUMBER_KINDS[FIELD_NUMBERS[column]]
    for s in STRINGS:
        want = number_unit_oracle(FIELD_NUMBERS[column], s)
        if s.isascii() and "\n" not in s:
            assert parse._number_and_unit(s, kind, False) == want, s
        err = parse._field_error(column, s)
        if want is None:
            assert err is not None and err.startswith("not "), s
        else:
            assert (err is None) == (want[1].lower() in parse._FIELD_FORMATS[column][1]), s


@pytest.mark.parametrize("column", sorted(OTHER))
def test_other_fields_answer_as_their_patterns(column):
    for s in STRINGS:
        want = OTHER[column].match(s) is not None
        if s.isascii() and "\n" not in s:
            assert parse._fits_other(column, s) == want, s
        assert (parse._field_error(column, s) is None) == want, s


def test_header_names_and_compute_capabilities_answer_as_their_patterns():
    for s in STRINGS:
        assert parse._norm_header(s) == norm_header_oracle(s), s
        assert parse._compute_cap(s) == compute_cap_oracle(s), s
    assert parse._compute_cap(None) is None


def test_the_strings_reach_every_answer():
    """The random strings are no vacuous check: each pattern matches some of them and refuses others."""
    for pattern in [NUM, *OTHER.values()]:
        hits = sum(bool(pattern.match(s)) for s in STRINGS)
        assert 0 < hits < len(STRINGS), pattern
    for number in FIELD_NUMBERS.values():
        hits = sum(number_unit_oracle(number, s) is not None for s in STRINGS)
        assert 0 < hits < len(STRINGS), number
    assert sum(norm_header_oracle(s) != s.strip().lower() for s in STRINGS) > 10
