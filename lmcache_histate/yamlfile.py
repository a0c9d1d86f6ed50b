"""Reading a YAML file with errors that name the file (shared by every config loader).

Errors are one line. Aliases (``*name``) are refused: a configuration has no use for
them, and nested ones expand exponentially (a 230-byte file of nine nested aliases is a
value of millions of elements, which produced a 5.2 MB error message).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

__all__ = ["read_yaml"]


class _AliasRefused(Exception):
    def __init__(self, name: str, line: int) -> None:
        super().__init__(name, line)
        self.name = name
        self.line = line


class _NoAliasLoader(yaml.SafeLoader):
    """``SafeLoader`` that refuses an alias where it would be composed."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise _AliasRefused(str(event.anchor), event.start_mark.line + 1)
        return super().compose_node(parent, index)


def read_yaml(path: Path, error: type[Exception]) -> Any:
    """The parsed document (``None`` for an empty file); ``error`` on I/O or syntax errors
    and on an alias, in one line."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise error(f"{path}: cannot read the file: {exc.strerror or exc}") from exc
    try:
        return yaml.load(text, Loader=_NoAliasLoader)  # a SafeLoader subclass
    except _AliasRefused as exc:
        raise error(
            f"{path}: line {exc.line}: YAML aliases (*{exc.name}) are not accepted in a "
            "configuration; write the value out"
        ) from None
    except yaml.YAMLError as exc:
        raise error(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from exc
