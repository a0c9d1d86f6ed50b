"""Where HiState's log records go inside the processes that host it.

The package logs through ``logging.getLogger("lmcache_histate.<part>")`` and, as a library
should, attaches no handler when imported. The two hosts configure only their own
loggers, never the root one:

* vLLM gives the ``vllm`` logger a handler on stdout with vLLM's format and turns its
  propagation off (``vllm/logger.py``, ``DEFAULT_LOGGING_CONFIG``; vLLM 0.32);
* LMCache gives every logger it creates a handler with its own formatter
  (``lmcache/logging.py``, ``init_logger``; lmcache 0.5.6).

A ``lmcache_histate`` record therefore finds no handler on its way to the root and falls to
Python's last-resort handler, which prints WARNING and above without time or source and
drops INFO: the interval-saves line at start, the step price the scheduler measured, the
disk tier's recovery summary never reached a log.

:func:`route_logs` is called where HiState enters a host process: the connector's
constructor in vLLM (which covers the step scheduler too: it logs only with a HiState
connector, which vLLM's scheduler constructor builds), the launcher in the LMCache server.
It gives the ``lmcache_histate`` logger the host's handler and level, so HiState's lines
appear in the host's log in the host's format.

Invariants:

* A ``lmcache_histate`` logger that already has a handler (a deployment's own logging
  configuration, or an earlier call) is left as it is; calling twice adds nothing.
* Records still propagate to the root logger, so whatever a process installs there (a test's
  log capture, a script's ``basicConfig``) sees them; the host's handler prints a record only
  while the root logger has no handler, so a record is printed once either way (NOTE 2).
"""

from __future__ import annotations

import logging
from typing import Literal

__all__ = ["PACKAGE_LOGGER", "route_logs"]

PACKAGE_LOGGER = "lmcache_histate"
"""The parent of every logger the package uses."""


def _root_silent(_record: logging.LogRecord) -> bool:
    """NOTE 2: ``vllm serve`` and ``lmcache server`` leave the root logger without a handler,
    but a process embedding vLLM may not (an offline ``LLM`` run under ``basicConfig``): the
    root's handler then prints the record, and ours would print it a second time."""
    return not logging.getLogger().handlers


class _ForwardHandler(logging.Handler):
    """Hands each record to the handlers a host logger has at the time of the record.

    NOTE 1: vLLM configures its logging again in each engine process
    (``configure_logging`` in ``v1/engine/core.py``), which replaces the ``vllm``
    handler; a copy of the handler taken earlier would write through a closed one."""

    def __init__(self, host: logging.Logger) -> None:
        super().__init__()
        self.host = host

    def emit(self, record: logging.LogRecord) -> None:
        for handler in self.host.handlers:
            if record.levelno >= handler.level:
                handler.handle(record)


def route_logs(host: Literal["vllm", "lmcache"]) -> logging.Logger:
    """Give the package's logger ``host``'s handler and level (see the module docstring);
    returns that logger."""
    package = logging.getLogger(PACKAGE_LOGGER)
    if package.handlers:
        return package
    handler: logging.Handler
    if host == "vllm":
        from vllm.logger import init_logger  # importing it configures the ``vllm`` logger

        source = init_logger("vllm")
        handler = _ForwardHandler(source)
        level = source.getEffectiveLevel()
    elif host == "lmcache":
        from lmcache.logging import CustomFormatter, get_log_level

        handler = logging.StreamHandler()
        handler.setFormatter(CustomFormatter())
        level = get_log_level()
    else:
        raise ValueError(f"host must be 'vllm' or 'lmcache', got {host!r}")
    handler.addFilter(_root_silent)
    package.addHandler(handler)
    if package.level == logging.NOTSET:
        package.setLevel(level)
    return package
