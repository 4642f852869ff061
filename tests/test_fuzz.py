"""Seeded mutation fuzz: every container, every command, in one bounded subprocess.

Small valid files of every container (torch zip, legacy, safetensors, sharded index + .bin shards,
TorchScript, bare pickle), each holding a payload that would ``touch`` a canary file if unpickled
for real, are mutated (byte flips, truncations, splices, and for zip archives re-zipped mutations
of data.pkl with valid CRCs) and run through inspect, scan, strip-prefix, add-prefix, convert and
load_anywhere in process.  Asserted: only ckptfix's own errors escape (no other exception type, no
exit 1), no process is ever started (audit hook) and the canary never appears, no mutant hangs
(a 300 s alarm per call: only a hang, never a slow machine), and the whole loop stays inside a 3 GiB
address-space limit with a bounded peak RSS.

A fixed number of mutants (``CKPTFIX_FUZZ_MUTANTS``, default 600), not a time box: the same seed
(``CKPTFIX_FUZZ_SEED``) tests the same mutants on a quiet and on a loaded machine.
``CKPTFIX_FUZZ_SECONDS`` (default 0) keeps going for that long after them, for a longer local run.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from safetensors.torch import save_file

BUDGET_S = float(os.environ.get("CKPTFIX_FUZZ_SECONDS", "0"))
MUTANTS = int(os.environ.get("CKPTFIX_FUZZ_MUTANTS", "600"))
SEED = int(os.environ.get("CKPTFIX_FUZZ_SEED", "20261123"))


class _Canary:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def _seeds(d: Path, canary: str) -> dict[str, list[str]]:
    """container -> the files that make it (the first is what commands are given)."""
    d.mkdir()
    obj = {
        "state_dict": {
            "module.w": torch.randn(4, 3),
            "module.b": torch.arange(3, dtype=torch.int64),
            "module.t": torch.randn(3, 5).t(),
            "module.e": torch.zeros(1).expand(4, 2),
        },
        "epoch": 3,
        "hp": {"lr": 0.1, "betas": (0.9, 0.99)},
        "evil": _Canary(canary),
    }
    out: dict[str, list[str]] = {}
    torch.save(obj, d / "zip.pth")
    out["zip"] = [str(d / "zip.pth")]
    torch.save(obj, d / "legacy.pth", _use_new_zipfile_serialization=False)
    out["legacy"] = [str(d / "legacy.pth")]
    save_file(
        {"module.w": torch.randn(4, 3), "module.b": torch.arange(3)},
        str(d / "m.safetensors"),
        metadata={"format": "pt"},
    )
    out["safetensors"] = [str(d / "m.safetensors")]
    sh = d / "sharded"
    sh.mkdir()
    torch.save({"module.w": torch.randn(4, 3), "evil": _Canary(canary)}, sh / "pytorch_model-00001-of-00002.bin")
    torch.save({"module.b": torch.arange(3.0)}, sh / "pytorch_model-00002-of-00002.bin")
    (sh / "pytorch_model.bin.index.json").write_text(
        json.dumps(
            {
                "metadata": {"total_size": 60},
                "weight_map": {
                    "module.w": "pytorch_model-00001-of-00002.bin",
                    "module.b": "pytorch_model-00002-of-00002.bin",
                },
            }
        )
    )
    out["sharded"] = [
        str(sh / "pytorch_model.bin.index.json"),
        str(sh / "pytorch_model-00001-of-00002.bin"),
        str(sh / "pytorch_model-00002-of-00002.bin"),
    ]
    m = torch.jit.script(torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU()))
    torch.jit.save(m, str(d / "ts.pt"))
    out["torchscript"] = [str(d / "ts.pt")]
    (d / "bare.pkl").write_bytes(pickle.dumps({"w": [1, 2.5, "x"], "evil": _Canary(canary)}, protocol=4))
    out["pickle"] = [str(d / "bare.pkl")]
    return out


DRIVER = textwrap.dedent(r"""
    import io, json, os, random, resource, shutil, signal, sys, time, traceback, zipfile
    sys.path.insert(0, sys.argv[1])
    import torch  # noqa: F401 - imported before the memory limit is set
    from ckptfix import load_anywhere
    from ckptfix.cli import main
    from ckptfix.ops.convert import convert_to_safetensors
    from ckptfix.errors import CkptfixError
    from ckptfix.ops.inspect import inspect_checkpoint, scan_checkpoint

    seeds, canary, work = json.loads(sys.argv[2]), sys.argv[3], sys.argv[4]
    budget, seed, mutants = float(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7])
    rng = random.Random(seed)
    spawned = []
    armed = [False]

    def hook(event, args):
        if armed[0] and event in ("os.system", "subprocess.Popen", "os.posix_spawn", "os.exec", "os.spawn",
                                  "os.fork", "os.forkpty", "pty.spawn"):
            spawned.append(event)
            raise RuntimeError("process start refused by the fuzz audit hook")

    class Hang(Exception):
        pass

    def on_alarm(*_):
        raise Hang()

    signal.signal(signal.SIGALRM, on_alarm)

    def flip(b):
        b = bytearray(b)
        for _ in range(rng.randint(1, 8)):
            if b:
                b[rng.randrange(len(b))] = rng.randrange(256)
        return bytes(b)

    def truncate(b):
        return b[:rng.randrange(len(b))] if b else b

    def splice(b):
        if not b:
            return b
        i, j = sorted(rng.randrange(len(b)) for _ in range(2))
        k = rng.randrange(len(b))
        seg = b[i:min(j, i + 256)]
        return b[:k] + seg * rng.choice((1, 1, 2, 16)) + b[k + rng.choice((0, 0, len(seg))):]

    def interesting(b):  # integers torch and pickle care about, at a random place
        if len(b) < 8:
            return flip(b)
        k = rng.randrange(len(b) - 8)
        v = rng.choice((0, 1, 0x7f, 0xff, 0xffff, 0x7fffffff, 0xffffffff, 2**62, 2**63 - 1, 2**64 - 1))
        return b[:k] + v.to_bytes(8, "little")[:rng.choice((1, 2, 4, 8))] + b[k + 1:]

    MUTATORS = (flip, flip, truncate, splice, interesting)

    def peak_rss_mib():  # VmHWM: this process's own peak (ru_maxrss includes the parent's, inherited)
        import re
        return int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read()).group(1)) // 1024

    def mutate_zip(b):
        try:
            with zipfile.ZipFile(io.BytesIO(b)) as zf:
                members = [(i.filename, zf.read(i)) for i in zf.infolist()]
        except Exception:
            return rng.choice(MUTATORS)(b)
        pk = [i for i, (n, _) in enumerate(members) if n.endswith(".pkl")]
        i = rng.choice(pk)
        name, data = members[i]
        members[i] = (name, rng.choice(MUTATORS)(data))
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w") as zf:
            for n, d in members:
                zf.writestr(zipfile.ZipInfo(n), d)
        return out.getvalue()

    originals = {c: [open(p, "rb").read() for p in files] for c, files in seeds.items()}
    failures, counts = [], {}
    out_dir = os.path.join(work, "out")

    def run_all(path):
        os.makedirs(out_dir, exist_ok=True)
        calls = (
            ("inspect", lambda: inspect_checkpoint(path)),
            ("scan", lambda: scan_checkpoint(path)),
            ("strip-prefix", lambda: main(["strip-prefix", path, "-o", os.path.join(out_dir, "s.pth"), "--force"])),
            ("add-prefix", lambda: main(["add-prefix", path, "--prefix", "m.", "-o",
                                         os.path.join(out_dir, "a.pth"), "--force"])),
            ("convert", lambda: convert_to_safetensors(path, os.path.join(out_dir, "c.safetensors"), force=True)),
            ("load_anywhere", lambda: load_anywhere(path)),
        )
        bad = []
        for name, call in calls:
            signal.alarm(300)
            try:
                rv = call()
                if name in ("strip-prefix", "add-prefix") and rv == 1:
                    bad.append((name, "exit 1 (internal error)"))
            except CkptfixError:
                pass
            except Hang:
                bad.append((name, "still running after 300 s (hung)"))
            except BaseException as e:
                bad.append((name, "".join(traceback.format_exception_only(type(e), e)).strip()[:500]))
            finally:
                signal.alarm(0)
            if os.path.exists(canary):
                bad.append((name, "CODE RAN: the canary exists"))
                os.unlink(canary)
        shutil.rmtree(out_dir, ignore_errors=True)
        return bad

    # warm-up on the valid seeds (imports, caches), then arm the hook and the memory limit
    sys.addaudithook(hook)
    for c, files in seeds.items():
        run_all(files[0])
    # 3 GiB beyond what the process already maps: a CUDA build of torch maps several GiB of libraries once
    # it is imported, so a fixed cap measured the build, not what ckptfix allocates for a mutant
    with open('/proc/self/status') as st:
        vm = next((int(line.split()[1]) << 10 for line in st if line.startswith('VmSize:')), 0)
    limit = vm + (3 << 30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    armed[0] = True
    n = 0
    t_end = None
    while True:
        if n >= mutants:  # then, with CKPTFIX_FUZZ_SECONDS, keep going that long
            t_end = time.monotonic() + budget if t_end is None else t_end
            if time.monotonic() >= t_end:
                break
        c = rng.choice(sorted(seeds))
        files = seeds[c]
        k = 0 if c != "sharded" else rng.randrange(len(files))
        b = originals[c][k]
        zipish = c in ("zip", "torchscript") or (c == "sharded" and k > 0)
        if zipish and rng.random() < 0.5:
            m = mutate_zip(b)
        else:
            m = rng.choice(MUTATORS)(b)
        with open(files[k], "wb") as f:
            f.write(m)
        bad = run_all(files[0])
        with open(files[k], "wb") as f:
            f.write(b)
        counts[c] = counts.get(c, 0) + 1
        n += 1
        if bad:
            keep = os.path.join(work, f"failure-{len(failures)}-{c}-{os.path.basename(files[k])}")
            with open(keep, "wb") as f:
                f.write(m)
            failures.append({"container": c, "file": keep, "problems": bad})
            if len(failures) >= 20:
                break
    print(json.dumps({"mutants": n, "per_container": counts, "failures": failures, "spawned": spawned,
                      "maxrss_mib": peak_rss_mib()}))
""")


def test_mutation_fuzz(tmp_path):
    canary = str(tmp_path / "canary")
    seeds = _seeds(tmp_path / "seeds", canary)
    work = tmp_path / "work"
    work.mkdir()
    repo = str(Path(__file__).resolve().parents[1])
    r = subprocess.run(
        [sys.executable, "-c", DRIVER, repo, json.dumps(seeds), canary, str(work)]
        + [str(BUDGET_S), str(SEED), str(MUTANTS)],
        capture_output=True,
        text=True,
        timeout=BUDGET_S + 3600,  # only a hang
    )
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert not res["failures"], json.dumps(res["failures"][:5], indent=1)
    assert not res["spawned"] and not os.path.exists(canary)
    assert res["mutants"] >= MUTANTS and len(res["per_container"]) == len(seeds), res
    assert res["maxrss_mib"] < 1024, res
