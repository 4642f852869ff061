"""torchrun entry point for ``ddp`` mode: ``python -m ckptfix.train.ddp_worker --config CFG.json --result OUT.json``.

:func:`ckptfix.train.ddp.launch` starts it; users running their own torchrun
can use ``-m ckptfix train --mode ddp ...`` instead (same code path).
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _write_error(path: str, err: dict[str, object]) -> None:
    """The launcher reads ``path`` after the job: written whole or not at all."""
    from ckptfix.files.atomic import atomic_output

    with atomic_output(path) as f:
        f.write(json.dumps(err).encode("utf-8"))


def main(argv: list[str] | None = None) -> int:
    """Train as one rank; a failure is written next to ``--result`` for the launcher.

    Args:
        argv: The command line (default ``sys.argv[1:]``).

    Returns:
        The exit status: 0, the ckptfix error's exit code, or 1 for anything else.
    """
    p = argparse.ArgumentParser(prog="python -m ckptfix.train.ddp_worker")
    p.add_argument("--config", required=True, help="TrainConfig as JSON")
    p.add_argument("--result", default=None, help="rank 0 writes the TrainResult JSON here")
    a = p.parse_args(argv)
    from ckptfix.errors import CkptfixError
    from ckptfix.train.config import TrainConfig
    from ckptfix.train.ddp import run_worker

    with open(a.config, encoding="utf-8") as f:
        cfg = TrainConfig.from_dict(json.load(f))
    rank = os.environ.get("RANK", "0")
    try:
        run_worker(cfg, a.result)
    except CkptfixError as e:
        if a.result:
            _write_error(
                f"{a.result}.err{rank}", {"message": str(e), "type": type(e).__name__, "exit_code": e.exit_code}
            )
        print(f"[rank {rank}] Error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    except Exception as e:  # noqa: BLE001 - a bug or an environment failure: one line for the launcher, traceback in the log
        import traceback

        traceback.print_exc()
        if a.result:
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            _write_error(
                f"{a.result}.err{rank}",
                {"message": f"rank {rank}: {type(e).__name__}: {first}", "type": "internal", "exit_code": 1},
            )
        return 1
    return 0


def _exit_now(code: int) -> None:
    """Leave without interpreter finalization once the rank's work and files are done.

    Under CPU contention a gloo rank sometimes aborts *after* its work is complete (SIGABRT,
    "terminate called without an active exception"): c10d/gloo C++ threads and objects are torn
    down during interpreter finalization, after the GIL machinery is gone (pytorch/pytorch#179291
    describes the same race).  torchrun then reports the job as failed although every file was
    written — the flaky ``test_cli_bench_json`` exit 30.  Everything this process owes is already
    on disk (results and errors go through atomic writes), so flush the streams and ``_exit``.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit_now(main())
