"""``ckptfix demo``: the end-to-end run on the bundled trainer's checkpoints.

Trains briefly in every mode (single, DataParallel, DDP through torchrun,
hand-written all-reduce, torch.compile, DCP, FSDP2 with a sharded DCP, plus a
legacy-format file with ``argparse.Namespace`` args and a copy re-tagged as
saved on ``cuda:1``), then for each checkpoint does what a user would:

* the problem column is what plain torch says: the first line of the real
  error of ``torch.load(path, weights_only=True)`` (a DCP directory too), or of
  ``model.load_state_dict(sd, strict=True)`` on what it returned;
* every fix is proven with plain tools only: the fixed file is read back with
  ``torch.load(weights_only=True)`` (``sanitize``, ``strip-prefix``) or
  ``safetensors.torch.load_file`` (``convert``), loaded into a fresh model with
  ``load_state_dict(strict=True)``, and the model's outputs on the probe batch
  must be bit-identical to the ones recorded at training time.
  ``load_anywhere`` (the in-memory fix) is proven the same way on the state
  dict it returns.

Finally it runs ``gpus`` / ``pick-gpu`` / ``doctor`` as subprocesses.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from ckptfix.errors import DemoFailedError

DEMO_OUT = "ckptfix-demo"  # the work directory
DEMO_DEVICE = "cpu"  # train on the CPU unless asked: the demo must run anywhere
DEMO_EPOCHS = 1  # epochs per training run


@dataclass
class DemoRow:
    """One checkpoint: what plain torch says about it, the fixes applied, whether all verified."""

    checkpoint: str
    problem: str
    fix: str
    verified: bool
    detail: str = ""
    steps: dict[str, Any] = field(default_factory=dict)


@dataclass
class DemoResult:
    """The whole demo: one row per checkpoint and the GPU commands' outcomes."""

    out_dir: str
    device: str
    rows: list[DemoRow]
    gpu_commands: list[dict[str, Any]]
    seconds: float

    @property
    def ok(self) -> bool:
        """True when every fix verified and every GPU command ran cleanly."""
        return all(r.verified for r in self.rows) and all(g["ok"] for g in self.gpu_commands)

    def to_dict(self) -> dict[str, Any]:
        """The result as a JSON-ready dict (``ckptfix demo --json``)."""
        return {
            "out_dir": self.out_dir,
            "device": self.device,
            "ok": self.ok,
            "seconds": round(self.seconds, 1),
            "rows": [asdict(r) for r in self.rows],
            "gpu_commands": self.gpu_commands,
        }


def _configs(device: str, quick: bool = False) -> list[dict[str, Any]]:
    if quick:  # in-process modes only: no torchrun, no torch.compile
        return [
            {"mode": "single"},
            {"mode": "dp"},
            {"mode": "single", "save_format": "dcp"},
            {"mode": "dp", "legacy_format": True, "namespace_args": True},
        ]
    return [
        {"mode": "single"},
        {"mode": "dp"},
        {"mode": "ddp", "nproc": 2},
        {"mode": "manual", "replicas": 2},
        {"mode": "single", "compile": True},
        {"mode": "single", "save_format": "dcp"},
        {"mode": "dp", "legacy_format": True, "namespace_args": True},
        {"mode": "fsdp", "nproc": 2},
    ]


def _first(s: str, n: int = 90) -> str:
    line = next((ln.strip() for ln in s.splitlines() if ln.strip()), "")
    return line if len(line) <= n else line[: n - 3] + "..."


def _error_line(e: BaseException, n: int = 200) -> str:
    """The first informative line of a real error (``load_state_dict``'s first line is only a heading)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    if len(lines) > 1 and lines[0].endswith(":") and lines[0].startswith("Error(s) in loading state_dict"):
        lines = lines[1:]
    # torch's weights_only refusal opens with advice; the line naming the refused global is the news
    named = [ln for ln in lines if "Unsupported global" in ln]
    if named:
        lines = named
    line = lines[0] if lines else type(e).__name__
    line = f"{type(e).__name__}: {line}"
    return line if len(line) <= n else line[: n - 3] + "..."


def _plain_torch_load(path: str) -> Any:
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.load(path, map_location=None, weights_only=True)


def plain_problem(path: str, model: Any) -> str:
    """What plain torch does with ``path``: the first line of its real error, or that it just works.

    ``torch.load(path, weights_only=True)`` (a directory too), then on the state dict it returns
    ``model.load_state_dict(sd, strict=True)``.

    Returns:
        ``"torch.load: <error>"``, ``"load_state_dict: <error>"`` or ``"none (plain torch loads it)"``.
    """
    try:
        obj = _plain_torch_load(path)
    except Exception as e:  # noqa: BLE001 - the user's failure is what we show
        return f"torch.load: {_error_line(e)}"
    sd = obj.get("model_state_dict", obj) if isinstance(obj, dict) else obj
    try:
        model.load_state_dict(sd, strict=True)
    except Exception as e:  # noqa: BLE001
        return f"load_state_dict: {_error_line(e)}"
    return "none (plain torch loads it)"


def prove_plain(entry: dict[str, Any], out_dir: str, state_dict: Any) -> dict[str, Any]:
    """Plain-torch proof: a fresh model, ``load_state_dict(strict=True)``, probe outputs bit-identical.

    ``state_dict`` comes from ``torch.load(weights_only=True)`` / ``safetensors.torch.load_file``
    (or :func:`ckptfix.load_anywhere`, the in-memory fix).

    Returns:
        ``{"exact": bool, "max_abs_diff": float | None, "error": str | None}``.
    """
    import torch

    from ckptfix.train.models import build_model
    from ckptfix.train.probe import probe_output

    side = torch.load(os.path.join(out_dir, entry["probe"]["file"]), map_location="cpu", weights_only=True)
    model = build_model(entry["model"], 0)
    try:
        model.load_state_dict(state_dict, strict=True)
    except Exception as e:  # noqa: BLE001
        return {"exact": False, "max_abs_diff": None, "error": f"load_state_dict: {_error_line(e)}"}
    got = probe_output(model, side["input"])
    return {
        "exact": bool(torch.equal(got, side["output"])),
        "max_abs_diff": float((got.double() - side["output"].double()).abs().max()),
        "error": None,
    }


def _model_sd(obj: Any) -> Any:
    return obj.get("model_state_dict", obj) if isinstance(obj, dict) else obj


def run_demo(
    out_dir: str = DEMO_OUT,
    *,
    device: str = DEMO_DEVICE,
    epochs: int = DEMO_EPOCHS,
    progress: Callable[[str], None] | None = None,
    quick: bool = False,
) -> DemoResult:
    """Train, break, fix and verify every kind of checkpoint; see the module docstring.

    Args:
        out_dir: The work directory (created; its files are replaced).
        device: ``cpu``, ``cuda`` or ``auto``.
        epochs: Epochs per training run.
        progress: Called with one line per step (None: silent).
        quick: Only the in-process modes (single, dp, DCP, legacy + Namespace args) and the
            cuda:1-tagged copy: no torchrun, no torch.compile.

    Returns:
        One row per checkpoint and the GPU commands' outcomes; a failed fix is a row that does
        not verify, not an exception.

    Raises:
        TrainingError: a training run fails.
    """
    import torch

    say = progress or (lambda m: None)
    t0 = time.perf_counter()
    os.makedirs(out_dir, exist_ok=True)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    entries = _train_checkpoints(out_dir, device, epochs, quick, say)
    fixed_dir = os.path.join(out_dir, "fixed")
    os.makedirs(fixed_dir, exist_ok=True)
    rows: list[DemoRow] = []
    for i, e in enumerate(entries, 1):
        say(f"[{i}/{len(entries)}] fixing {e['path']} ...")
        rows.append(_Fixes(e, out_dir, fixed_dir).run())
    gpu_cmds = _gpu_commands(say)
    return DemoResult(
        out_dir=out_dir, device=device, rows=rows, gpu_commands=gpu_cmds, seconds=time.perf_counter() - t0
    )


def _train_checkpoints(
    out_dir: str, device: str, epochs: int, quick: bool, say: Callable[[str], None]
) -> list[dict[str, Any]]:
    """Train every configuration; the last checkpoint entry of each, plus a copy tagged as saved on cuda:1."""
    from ckptfix.ops.rewrite import rewrite_checkpoint
    from ckptfix.train.config import TrainConfig
    from ckptfix.train.entry import train

    cfgs = _configs(device, quick)
    entries: list[dict[str, Any]] = []
    total = len(cfgs)
    for i, c in enumerate(cfgs, 1):
        cfg = TrainConfig(
            out=out_dir, epochs=epochs, device=device, quiet=True, train_samples=1024, test_samples=256, force=True, **c
        )
        if cfg.mode == "fsdp":
            cfg.save_format = "dcp"
        say(f"[{i}/{total}] training {cfg.run_name()} on {device} ...")
        res = train(cfg)
        entries.extend(res.checkpoints[-1:])
    # a copy that looks saved on cuda:1 (the "fewer GPUs than the saver" case), re-tagged without torch
    first = entries[0]
    src = os.path.join(out_dir, first["path"])
    tagged = os.path.join(out_dir, "single-saved-on-cuda1.pt")
    if os.path.exists(tagged):
        os.unlink(tagged)
    rewrite_checkpoint(src, lambda sd: (sd, {}), output=tagged, map_location="cpu=cuda:1")
    entries.append({**first, "path": os.path.basename(tagged), "mode": first["mode"] + " (cuda:1 tags)"})
    return entries


def _gpu_commands(say: Callable[[str], None]) -> list[dict[str, Any]]:
    """Run ``gpus``, ``pick-gpu`` and ``doctor`` as a user would; clean = no traceback, a documented exit."""
    gpu_cmds = []
    for args in (["gpus"], ["pick-gpu"], ["doctor"]):
        say(f"running ckptfix {' '.join(args)} ...")
        p = subprocess.run([sys.executable, "-m", "ckptfix", *args], capture_output=True, text=True, timeout=120)
        clean = "Traceback" not in p.stderr and p.returncode in (0, 20, 21)
        msg = _first(p.stderr if p.returncode else p.stdout, 110)
        gpu_cmds.append(
            {"command": "ckptfix " + " ".join(args), "exit_code": p.returncode, "ok": clean, "message": msg}
        )
    return gpu_cmds


class _Fixes:
    """One checkpoint's row: plain torch's problem, then each fix applied and proven with plain tools."""

    def __init__(self, entry: dict[str, Any], out_dir: str, fixed_dir: str) -> None:
        self.e = entry
        self.d = out_dir
        self.name = entry["path"]
        self.path = os.path.join(out_dir, self.name)
        self.stem = os.path.splitext(os.path.basename(self.name))[0]
        self.fixed_dir = fixed_dir
        self.steps: dict[str, Any] = {}
        self.fixes: list[str] = []
        self.failed: list[str] = []
        self.problem = "?"
        self.detail = ""

    def record(self, fix: str, result: dict[str, Any], **extra: Any) -> None:
        self.steps[fix] = {**extra, **result}
        (self.fixes if result.get("exact") else self.failed).append(fix)

    def prove(self, state_dict: Any) -> dict[str, Any]:
        return prove_plain(self.e, self.d, state_dict)

    def run(self) -> DemoRow:
        try:
            self._apply()
        except Exception as exc:  # noqa: BLE001 - the demo reports every failure in its table
            self.failed.append("(error)")
            self.detail = f"{type(exc).__name__}: {_first(str(exc), 200)}"
        failed = self.failed
        if failed and not self.detail:
            why = [self.steps.get(f.split(" ")[0], {}).get("error") for f in failed]
            self.detail = (
                "; ".join(f"{f}: {w}" for f, w in zip(failed, why, strict=False) if w) or "probe outputs differ"
            )
        fix_txt = ", ".join(
            self.fixes + [f"{f} NOT verified" if "not verified" not in f else f for f in failed if f != "(error)"]
        )
        return DemoRow(
            checkpoint=self.name,
            problem=self.problem,
            fix=fix_txt,
            verified=not failed,
            detail=self.detail,
            steps=self.steps,
        )

    def _apply(self) -> None:
        from ckptfix.ops.inspect import inspect_checkpoint
        from ckptfix.ops.load import load_checkpoint
        from ckptfix.train.models import build_model

        self.problem = plain_problem(self.path, build_model(self.e["model"], 0))
        rep = inspect_checkpoint(self.path)
        self.steps["inspect"] = {
            "format": rep.format,
            "prefixes": rep.prefixes,
            "locations": rep.locations,
            "weights_only_ok": rep.weights_only_ok,
        }
        on_cuda = any(str(k).startswith("cuda") for k in (rep.locations or {}))
        # 1. load_anywhere (in memory), proven by a strict load_state_dict + the probe
        sd = load_checkpoint(self.path, model=build_model(self.e["model"], 0)).state_dict
        self.record("load_anywhere", self.prove(sd))
        # 2. files only: make plain torch.load(weights_only=True) work, then strip the prefixes
        if not os.path.isdir(self.path):
            src_file = self._sanitize() if "Unsupported global" in self.problem else self.path
            if src_file:
                self._strip_prefix(src_file, on_cuda)
        # 3. convert to safetensors (prefixes stripped on the way), read back by safetensors itself
        self._convert()

    def _sanitize(self) -> str:
        """``sanitize`` the file; the sanitized file's path, or "" when plain torch still cannot load it."""
        from ckptfix.ops.sanitize import sanitize_checkpoint
        from ckptfix.train.models import build_model

        safe = os.path.join(self.fixed_dir, self.stem + ".safe.pt")
        if os.path.exists(safe):
            os.unlink(safe)
        sanitize_checkpoint(self.path, safe)
        try:
            obj = _plain_torch_load(safe)
        except Exception as exc:  # noqa: BLE001
            self.record("sanitize", {"exact": False, "error": f"torch.load: {_error_line(exc)}"}, output=safe)
            return ""
        sd = _model_sd(obj)
        r = (
            self.prove(sd)
            if set(sd) == set(build_model(self.e["model"], 0).state_dict())
            else {"exact": True, "note": "weights_only load works; prefixes remain"}
        )
        self.record("sanitize", r, output=safe)
        return safe

    def _strip_prefix(self, src_file: str, on_cuda: bool) -> None:
        from ckptfix.ops.prefixes import strip_prefix_report
        from ckptfix.ops.rewrite import rewrite_checkpoint

        stripped = os.path.join(self.fixed_dir, self.stem + ".stripped.pt")
        if os.path.exists(stripped):
            os.unlink(stripped)
        srep = rewrite_checkpoint(
            src_file,
            lambda sd: strip_prefix_report(sd),
            output=stripped,
            map_location="cpu" if on_cuda else None,
        )
        target = srep.output or src_file
        try:
            sd = _model_sd(_plain_torch_load(target))
        except Exception as exc:  # noqa: BLE001
            self.record(
                "strip-prefix", {"exact": False, "error": f"torch.load: {_error_line(exc)}"}, output=srep.output
            )
            return
        if srep.output:
            self.record("strip-prefix", self.prove(sd), output=srep.output, renamed=srep.renamed)
        else:
            self.steps["strip-prefix"] = {"output": None, "note": "no prefix to strip", **self.prove(sd)}

    def _convert(self) -> None:
        from safetensors.torch import load_file

        from ckptfix.ops.convert import convert_to_safetensors

        st = os.path.join(self.fixed_dir, self.stem + ".safetensors")
        crep = convert_to_safetensors(self.path, st, strip_prefix=True, force=True)
        self.record("convert", self.prove(load_file(st)), output=st, verified=getattr(crep, "verified", None))


def format_summary(res: DemoResult) -> str:
    """The demo's text report: the checkpoint table, the GPU command table, the verdict."""
    from ckptfix.text import table

    rows = [
        [
            r.checkpoint,
            r.problem if len(r.problem) <= 110 else r.problem[:107] + "...",
            r.fix,
            "yes" if r.verified else "NO",
        ]
        for r in res.rows
    ]
    out = [table(rows, ["checkpoint", "problem found", "fix applied", "verified"])]
    out.append("")
    out.append(
        table(
            [
                [g["command"], str(g["exit_code"]), g["message"][:80], "yes" if g["ok"] else "NO"]
                for g in res.gpu_commands
            ],
            ["command", "exit", "message", "clean"],
        )
    )
    out.append("")
    from ckptfix.display import shown_path

    verdict = "all verified" if res.ok else "FAILURES"
    out.append(f"{verdict} in {res.seconds:.0f} s; files in {shown_path(res.out_dir)}/")
    for r in res.rows:
        if r.detail:
            out.append(f"  {r.checkpoint}: {r.detail}")
    return "\n".join(out)


def check(res: DemoResult) -> None:
    """Fail unless every step of the demo verified.

    Raises:
        DemoFailedError: some fix or GPU command did not verify (names them).
    """
    if not res.ok:
        bad = [r.checkpoint for r in res.rows if not r.verified] + [
            g["command"] for g in res.gpu_commands if not g["ok"]
        ]
        raise DemoFailedError(f"{len(bad)} step(s) did not verify: {', '.join(bad)}; see the table above")
