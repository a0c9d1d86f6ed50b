"""Fixtures for live tests against a real ``lmcache server`` (LMCache MP mode).

The suites have no ``__init__.py`` files, so pytest puts only each test file's own folder on
``sys.path``; the shared harness lives in ``tests/support``, so ``tests/`` is added here.
"""

from __future__ import annotations

import sys
from pathlib import Path

_TESTS_DIR = str(Path(__file__).resolve().parents[1])
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)
