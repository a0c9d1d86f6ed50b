"""Reading a YAML file with errors that name the file (shared by every config loader)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

__all__ = ["read_yaml"]


def read_yaml(path: Path, error: type[Exception]) -> Any:
    """The parsed document (``None`` for an empty file); ``error`` on I/O or syntax errors."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise error(f"{path}: cannot read the file: {exc.strerror or exc}") from exc
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise error(f"{path}: not valid YAML: {exc}") from exc
