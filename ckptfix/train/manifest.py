"""``checkpoints.json``: the record of every checkpoint a training run wrote in its ``--out``.

Each entry names a file (``path``, relative to the manifest) and what it holds: mode, devices,
world size, save style and format, expected key prefix, hyper-parameters, resume history and the
probe output (:mod:`ckptfix.train.probe`).  An entry is added only after its files are complete.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable

from ckptfix.errors import TrainingError

MANIFEST = "checkpoints.json"
MANIFEST_VERSION = 1


def manifest_path(out_dir: str) -> str:
    """The manifest of ``out_dir`` (or ``out_dir`` itself when it is a ``.json`` path)."""
    return out_dir if out_dir.endswith(".json") else os.path.join(out_dir, MANIFEST)


def read_manifest(out_dir: str) -> dict[str, Any]:
    """Read ``out_dir/checkpoints.json`` (or the file itself); an empty manifest when absent.

    Raises:
        OSError: the file exists but cannot be read.
        ValueError: the file is not JSON.
    """
    path = manifest_path(out_dir)
    if not os.path.exists(path):
        return {"version": MANIFEST_VERSION, "checkpoints": []}
    with open(path, encoding="utf-8") as f:
        data: dict[str, Any] = json.load(f)
    return data


def update_manifest(out_dir: str, entries: list[dict[str, Any]]) -> str:
    """Add ``entries`` to ``out_dir/checkpoints.json``, replacing entries with the same path; atomic.

    Raises:
        OutputError: the manifest cannot be written.
    """
    import torch

    from ckptfix._version import __version__
    from ckptfix.train.saving import atomic_write_text

    path = os.path.join(out_dir, MANIFEST)
    man = read_manifest(out_dir)
    new_paths = {e["path"] for e in entries}
    kept = [e for e in man.get("checkpoints", []) if e.get("path") not in new_paths]
    man = {
        "version": MANIFEST_VERSION,
        "generator": f"ckptfix {__version__} train",
        "torch": torch.__version__,
        "checkpoints": kept + entries,
    }
    atomic_write_text(path, json.dumps(man, indent=2) + "\n")
    return path


def check_outputs(out_dir: str, paths: Iterable[str], run: str, resumed_from: str | None) -> None:
    """Refuse to overwrite files that another run wrote in ``out_dir``.

    Re-running the same configuration (same run name, same resume source) replaces its own
    files; anything else -- a file of a run with another history, or a file not in
    ``checkpoints.json`` -- is kept.  A probe sidecar ``X.probe.pt`` belongs to the entry of
    its checkpoint.

    Args:
        out_dir: The run's output directory.
        paths: The files the run will write, relative to ``out_dir``.
        run: The run's name.
        resumed_from: The checkpoint the run resumes from (absolute), or None.

    Raises:
        TrainingError: a file exists and belongs to another run (the message says how to proceed).
    """
    man = read_manifest(out_dir)
    by_path = {e.get("path"): e for e in man.get("checkpoints", [])}
    by_probe = {e["probe"]["file"]: e for e in man.get("checkpoints", []) if isinstance(e.get("probe"), dict)}
    for rel in paths:
        if not os.path.exists(os.path.join(out_dir, rel)):
            continue
        e = by_path.get(rel) or by_probe.get(rel)
        if e is not None and e.get("run") == run and e.get("resumed_from") == resumed_from:
            continue
        from ckptfix.display import shown_path

        other = (
            (
                f"run {e.get('run')!r}"
                + (f" resumed from {shown_path(e['resumed_from'])}" if e.get("resumed_from") else "")
            )
            if e
            else "something not listed in checkpoints.json"
        )
        raise TrainingError(
            f"{shown_path(os.path.join(out_dir, rel))} already exists (written by {other}); pass --force to "
            "overwrite it, or choose another --name or --out"
        )
