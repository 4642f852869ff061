"""``python -m ckptfix`` and the ``ckptfix`` console script: this process is the command."""

from __future__ import annotations

import sys

from ckptfix._startup import command_process, imports_quietly


def run() -> None:
    """Run the ``ckptfix`` command line in this process and exit with its status."""
    command_process()
    with imports_quietly():  # click and the CLI
        from ckptfix.cli import main

    sys.exit(main())


if __name__ == "__main__":
    run()
