"""``backends/log_routing.py``: HiState's log lines reach the host's log, once.

Each test starts from a ``lmcache_histate`` logger with no handler and no level (as a
fresh process has it) and puts the logger back afterwards.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import pytest
from lmcache_histate.backends.log_routing import PACKAGE_LOGGER, route_logs


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def package() -> Iterator[logging.Logger]:
    logger = logging.getLogger(PACKAGE_LOGGER)
    saved = (list(logger.handlers), logger.level)
    logger.handlers.clear()
    logger.setLevel(logging.NOTSET)
    yield logger
    logger.handlers[:] = saved[0]
    logger.setLevel(saved[1])


@contextlib.contextmanager
def bare_root() -> Iterator[None]:
    """A root logger with no handler, as ``vllm serve`` and ``lmcache server`` leave it
    (pytest puts its capture handlers there for each test's call)."""
    root = logging.getLogger()
    saved = list(root.handlers)
    root.handlers.clear()
    try:
        yield
    finally:
        root.handlers[:] = saved


@pytest.fixture
def vllm_logger() -> Iterator[logging.Logger]:
    logger = logging.getLogger("vllm")
    saved = (list(logger.handlers), logger.level)
    yield logger
    logger.handlers[:] = saved[0]
    logger.setLevel(saved[1])


def test_info_lines_go_to_the_vllm_handler_the_vllm_logger_has_when_they_are_logged(
    package: logging.Logger, vllm_logger: logging.Logger
) -> None:
    """vLLM replaces its handler when an engine process configures logging again, so a line
    goes to the handler ``vllm`` has then; INFO passes (vLLM's default level)."""
    vllm_logger.setLevel(logging.INFO)
    route_logs("vllm")
    later = Collect()
    vllm_logger.handlers[:] = [later]  # what configure_logging does in an engine process
    with bare_root():
        logging.getLogger("lmcache_histate.step_scheduler").info("step price %d", 100)
        logging.getLogger("lmcache_histate.step_scheduler").debug("not at INFO")
    assert later.lines == ["step price 100"]


def test_a_second_call_and_a_configured_logger_are_left_alone(
    package: logging.Logger, vllm_logger: logging.Logger
) -> None:
    """One handler after two calls; a deployment's own handler and level stay the only
    ones."""
    route_logs("vllm")
    route_logs("lmcache")
    assert len(package.handlers) == 1
    package.handlers.clear()
    own = Collect()
    package.addHandler(own)
    package.setLevel(logging.WARNING)
    route_logs("lmcache")
    assert package.handlers == [own]
    assert package.level == logging.WARNING


def test_the_server_side_uses_lmcaches_format_and_level(
    package: logging.Logger, monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """LMCACHE_LOG_LEVEL (lmcache.logging.get_log_level) decides the level; the line has
    LMCache's prefix and the logger's name."""
    monkeypatch.setenv("LMCACHE_LOG_LEVEL", "WARNING")
    route_logs("lmcache")
    assert package.level == logging.WARNING
    with bare_root():
        logging.getLogger("lmcache_histate.runtime").info("hidden at WARNING")
        logging.getLogger("lmcache_histate.runtime").warning("disk tier full")
    err = capfd.readouterr().err
    assert "hidden" not in err
    assert "LMCache WARNING:" in err and "disk tier full" in err
    assert "lmcache_histate.runtime" in err


def test_an_unknown_host_is_refused(package: logging.Logger) -> None:
    with pytest.raises(ValueError, match="'vllm' or 'lmcache'"):
        route_logs("sglang")  # type: ignore[arg-type]
    assert package.handlers == []


def test_a_process_that_configured_the_root_logger_prints_each_line_once(
    package: logging.Logger, vllm_logger: logging.Logger
) -> None:
    """With a root handler (``basicConfig`` in a process embedding vLLM) the root prints the
    record and the host's handler does not; without one, the host's handler does."""
    vllm_logger.setLevel(logging.INFO)
    route_logs("vllm")
    host, root = Collect(), Collect()
    vllm_logger.handlers[:] = [host]
    with bare_root():
        logging.getLogger().addHandler(root)
        logging.getLogger("lmcache_histate.connector").warning("no active HiState module")
        logging.getLogger().removeHandler(root)
        logging.getLogger("lmcache_histate.connector").warning("printed by the host")
    assert root.lines == ["no active HiState module"]
    assert host.lines == ["printed by the host"]
