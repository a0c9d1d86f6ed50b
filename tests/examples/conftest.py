"""The example tests run ``examples/*.py`` as subprocesses (``support.examples``); ``tests/``
goes on ``sys.path`` for the shared ``support`` package (the suites have no ``__init__.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

_TESTS_DIR = str(Path(__file__).resolve().parents[1])
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)
