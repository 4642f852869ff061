"""The torch-free tests' fixtures (``cli``, ``ckpts``), defined in notorch_helpers.py, registered for this folder.

A conftest (not tests/conftest.py, which imports torch): .ci/run runs this folder with ``--confcutdir``.
"""

from notorch_helpers import ckpts, cli  # noqa: F401 (pytest fixtures: importing them here registers them)
