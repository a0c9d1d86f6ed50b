"""vLLM symbols that moved between the checked versions: one version-guarded lookup each.

The code that uses a moved symbol calls the lookup here instead of importing it, so the
version dispatch lives in one place and names the versions it was checked on
(``versions.VLLM``; ``scripts/compat.py`` checks each branch's imports against the wheel of
every version in its range). A vLLM outside the checked series is refused with
:class:`UpstreamVersionError` naming both.

* :func:`serve_cli_setup` -- ``VLLM_SUBCMD_PARSER_EPILOG`` and ``cli_env_setup``: in
  ``vllm/entrypoints/serve/utils/api_utils.py`` in 0.32.0, in
  ``vllm/entrypoints/common/startup.py`` from 0.33.0 (not re-exported from the old module);
  unchanged otherwise (read in the 0.33.0 and 0.34.0 wheels).
"""

from __future__ import annotations

from collections.abc import Callable

from .patching import UpstreamVersionError, installed_version
from .versions import VLLM, checked_vllm_minor

__all__ = ["serve_cli_setup", "vllm_series"]


def vllm_series(version: str | None = None) -> tuple[int, int]:
    """The installed vLLM's release series as ``(0, 33)``; refuses an unchecked one."""
    version = installed_version("vllm") if version is None else version
    minor = checked_vllm_minor(version)
    if minor is None:
        raise UpstreamVersionError(
            f"HiState was checked on vLLM {', '.join(VLLM)}, found {version}: install one of "
            "those (docs/support.md) or check this version with make compat"
        )
    major, _, rest = minor.partition(".")
    return int(major), int(rest)


def serve_cli_setup(version: str | None = None) -> tuple[str, Callable[[], None]]:
    """vLLM's subcommand-parser epilog template and its CLI environment set-up."""
    if vllm_series(version) >= (0, 33):
        from vllm.entrypoints.common.startup import VLLM_SUBCMD_PARSER_EPILOG, cli_env_setup
    else:
        from vllm.entrypoints.serve.utils.api_utils import (
            VLLM_SUBCMD_PARSER_EPILOG,
            cli_env_setup,
        )
    return VLLM_SUBCMD_PARSER_EPILOG, cli_env_setup
