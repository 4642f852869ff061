"""``ckptfix demo``: the end-to-end run on the bundled trainer's checkpoints.

Trains briefly in every mode (single, DataParallel, DDP through torchrun,
hand-written all-reduce, torch.compile, DCP, plus a legacy-format file with
``argparse.Namespace`` args and a copy re-tagged as saved on ``cuda:1``), then
for each checkpoint does what a user would: show the failure plain torch hits,
``inspect``, ``strip-prefix``, ``convert`` to safetensors, ``load_anywhere`` into
a plain model, and prove the probe-batch outputs match exactly.  Finally it runs
``gpus`` / ``pick-gpu`` / ``doctor`` as subprocesses.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from ckptfix.errors import DemoFailedError


@dataclass
class DemoRow:
    checkpoint: str
    problem: str
    fix: str
    verified: bool
    detail: str = ""
    steps: dict[str, Any] = field(default_factory=dict)


@dataclass
class DemoResult:
    out_dir: str
    device: str
    rows: list[DemoRow]
    gpu_commands: list[dict[str, Any]]
    seconds: float

    @property
    def ok(self) -> bool:
        return all(r.verified for r in self.rows) and all(g["ok"] for g in self.gpu_commands)

    def to_dict(self) -> dict[str, Any]:
        return {"out_dir": self.out_dir, "device": self.device, "ok": self.ok, "seconds": round(self.seconds, 1),
                "rows": [asdict(r) for r in self.rows], "gpu_commands": self.gpu_commands}


def _configs(device: str) -> list[dict[str, Any]]:
    return [
        {"mode": "single"},
        {"mode": "dp"},
        {"mode": "ddp", "nproc": 2},
        {"mode": "manual", "replicas": 2},
        {"mode": "single", "compile": True},
        {"mode": "single", "save_format": "dcp"},
        {"mode": "dp", "legacy_format": True, "namespace_args": True},
    ]


def _plain_failure(path: str, model: Any) -> str:
    """What plain torch does with the file, in one line ('none' when it just works)."""
    import re
    import warnings

    import torch

    if os.path.isdir(path):
        return "a DCP directory: torch.load cannot open it"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            obj = torch.load(path, weights_only=True)
    except Exception as e:  # noqa: BLE001 - we show the user's failure
        msg = str(e)
        if "CUDA device" in msg:
            return "torch.load: saved on CUDA, no CUDA here"
        m = re.search(r"Unsupported global: GLOBAL ([\w.]+)", msg)
        if m:
            return f"weights_only refuses {m.group(1)}"
        return f"torch.load: {_first(msg, 60)}"
    sd = obj.get("model_state_dict", obj) if isinstance(obj, dict) else obj
    try:
        res = model.load_state_dict(sd, strict=False)
    except Exception as e:  # noqa: BLE001
        return f"load_state_dict: {_first(str(e), 60)}"
    if res.missing_keys or res.unexpected_keys:
        ex = (res.unexpected_keys or res.missing_keys)[0]
        return f"{len(res.missing_keys)} missing / {len(res.unexpected_keys)} unexpected keys ({ex!r})"
    return "none (plain torch works)"


def _first(s: str, n: int = 90) -> str:
    line = next((ln.strip() for ln in s.splitlines() if ln.strip()), "")
    return line if len(line) <= n else line[: n - 3] + "..."


def run_demo(out_dir: str = "ckptfix-demo", *, device: str = "cpu", epochs: int = 1,
             progress: Callable[[str], None] | None = None) -> DemoResult:
    """Train, break, fix and verify every kind of checkpoint; see the module docstring."""
    import torch

    from ckptfix.convert import convert_to_safetensors
    from ckptfix.inspecting import inspect_checkpoint
    from ckptfix.loading import load_checkpoint
    from ckptfix.prefixes import strip_prefix_report
    from ckptfix.rewrite import rewrite_checkpoint
    from ckptfix.train import TrainConfig, train, verify_probe
    from ckptfix.train.models import build_model

    say = progress or (lambda m: None)
    t0 = time.perf_counter()
    os.makedirs(out_dir, exist_ok=True)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    cfgs = _configs(device)
    entries: list[tuple[dict[str, Any], str]] = []
    total = len(cfgs)
    for i, c in enumerate(cfgs, 1):
        cfg = TrainConfig(out=out_dir, epochs=epochs, device=device, quiet=True, train_samples=1024,
                          test_samples=256, **c)
        say(f"[{i}/{total}] training {cfg.run_name()} on {device} ...")
        res = train(cfg)
        for e in res.checkpoints[-1:]:
            entries.append((e, out_dir))
    # a copy that looks saved on cuda:1 (the "fewer GPUs than the saver" case), re-tagged without torch
    first = entries[0][0]
    src = os.path.join(out_dir, first["path"])
    tagged = os.path.join(out_dir, "single-saved-on-cuda1.pt")
    if os.path.exists(tagged):
        os.unlink(tagged)
    rewrite_checkpoint(src, lambda sd: (sd, {}), output=tagged, map_location="cpu=cuda:1")
    entries.append(({**first, "path": os.path.basename(tagged), "mode": first["mode"] + " (cuda:1 tags)"}, out_dir))

    rows: list[DemoRow] = []
    for i, (e, d) in enumerate(entries, 1):
        path = os.path.join(d, e["path"])
        name = e["path"]
        say(f"[{i}/{len(entries)}] fixing {name} ...")
        steps: dict[str, Any] = {}
        fixes: list[str] = []
        ok = True
        detail = ""
        try:
            model = build_model(e["model"], 0)
            problem = _plain_failure(path, model)
            rep = inspect_checkpoint(path)
            steps["inspect"] = {"format": rep.format, "prefixes": rep.prefixes, "locations": rep.locations,
                                "weights_only_ok": rep.weights_only_ok}
            # 1. load_anywhere straight from the original
            lc = load_checkpoint(path, model=build_model(e["model"], 0))
            r1 = verify_probe(e, d, lc.state_dict)
            steps["load_anywhere"] = r1
            fixes.append("load_anywhere")
            ok &= bool(r1["exact"])
            # 2. strip-prefix on disk (files only), then plain torch loads it
            if not os.path.isdir(path):
                stripped = os.path.join(d, "fixed", os.path.splitext(name)[0] + ".stripped.pt")
                os.makedirs(os.path.dirname(stripped), exist_ok=True)
                if os.path.exists(stripped):
                    os.unlink(stripped)
                srep = rewrite_checkpoint(path, lambda sd: strip_prefix_report(sd), output=stripped,
                                          map_location="cpu" if any(k.startswith("cuda") for k in rep.locations)
                                          else None)
                target = srep.output or path
                lc2 = load_checkpoint(target, model=build_model(e["model"], 0))
                r2 = verify_probe(e, d, lc2.state_dict)
                steps["strip-prefix"] = {"output": srep.output, "renamed": srep.renamed, **r2}
                if srep.output:
                    fixes.append("strip-prefix")
                ok &= bool(r2["exact"])
            # 3. convert to safetensors (prefixes stripped on the way), load it back
            st = os.path.join(d, "fixed", os.path.splitext(os.path.basename(name))[0] + ".safetensors")
            os.makedirs(os.path.dirname(st), exist_ok=True)
            crep = convert_to_safetensors(path, st, strip_prefix=True, force=True)
            lc3 = load_checkpoint(st, model=build_model(e["model"], 0))
            r3 = verify_probe(e, d, lc3.state_dict)
            steps["convert"] = {"output": st, "verified": getattr(crep, "verified", None), **r3}
            fixes.append("convert")
            ok &= bool(r3["exact"])
        except Exception as exc:  # noqa: BLE001 - the demo reports every failure in its table
            ok = False
            problem = locals().get("problem", "?")
            detail = f"{type(exc).__name__}: {_first(str(exc), 200)}"
        rows.append(DemoRow(checkpoint=name, problem=problem, fix=", ".join(fixes), verified=ok, detail=detail,
                            steps=steps))

    gpu_cmds = []
    for args in (["gpus"], ["pick-gpu"], ["doctor"]):
        say(f"running ckptfix {' '.join(args)} ...")
        p = subprocess.run([sys.executable, "-m", "ckptfix", *args], capture_output=True, text=True, timeout=120)
        clean = "Traceback" not in p.stderr and p.returncode in (0, 20, 21)
        msg = _first(p.stderr if p.returncode else p.stdout, 110)
        gpu_cmds.append({"command": "ckptfix " + " ".join(args), "exit_code": p.returncode, "ok": clean,
                         "message": msg})
    return DemoResult(out_dir=out_dir, device=device, rows=rows, gpu_commands=gpu_cmds,
                      seconds=time.perf_counter() - t0)


def format_summary(res: DemoResult) -> str:
    from ckptfix.cli._common import table

    rows = [[r.checkpoint, r.problem[:70], r.fix, "yes" if r.verified else "NO"] for r in res.rows]
    out = [table(rows, ["checkpoint", "problem found", "fix applied", "verified"])]
    out.append("")
    out.append(table([[g["command"], str(g["exit_code"]), g["message"][:80], "yes" if g["ok"] else "NO"]
                      for g in res.gpu_commands], ["command", "exit", "message", "clean"]))
    out.append("")
    out.append(f"{'all verified' if res.ok else 'FAILURES'} in {res.seconds:.0f} s; files in {res.out_dir}/")
    for r in res.rows:
        if r.detail:
            out.append(f"  {r.checkpoint}: {r.detail}")
    return "\n".join(out)


def check(res: DemoResult) -> None:
    if not res.ok:
        bad = [r.checkpoint for r in res.rows if not r.verified] + [g["command"] for g in res.gpu_commands
                                                                    if not g["ok"]]
        raise DemoFailedError(f"{len(bad)} step(s) did not verify: {', '.join(bad)}; see the table above")
