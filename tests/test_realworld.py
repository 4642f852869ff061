"""The real-world differential corpus (benchmarks/realworld.py), one test per manifest file.

Opt-in: downloads ~600 MB of wheels and sdists once (cached under /tmp/ckptfix-realworld).  Run with
``CKPTFIX_REALWORLD=1 pytest -m realworld tests/test_realworld.py``.  Ground truth is plain torch.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import realworld  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")
opt_in = [
    pytest.mark.realworld,
    pytest.mark.skipif(
        not os.environ.get("CKPTFIX_REALWORLD"), reason="downloads PyPI packages; set CKPTFIX_REALWORLD=1"
    ),
]

ENTRIES = realworld.load_manifest()


def test_manifest_is_well_formed():
    with open(realworld.MANIFEST, encoding="utf-8") as f:
        doc = json.load(f)
    files = doc["files"]
    assert len(files) >= 40 and len({x["package"] for x in files}) >= 15
    for x in files:
        assert len(x["sha256"]) == 64 and x["size"] > 0 and x["version"] and x["path"] and x["dist"]


@opt_in[0]
@opt_in[1]
@pytest.mark.parametrize("entry", ENTRIES, ids=[f"{e.package}-{e.version}:{e.path}" for e in ENTRIES])
def test_every_command_agrees_with_torch(entry, tmp_path):
    r = realworld.check(entry, os.environ.get("CKPTFIX_REALWORLD_CACHE", realworld.DEFAULT_CACHE), str(tmp_path))
    failed = {c: v for c, v in r.results.items() if v.startswith("FAIL")}
    assert not failed, failed
