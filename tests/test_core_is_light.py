"""The engine-agnostic package must not pull in lmcache, vllm or torch."""

from __future__ import annotations

import subprocess
import sys


def test_core_sim_and_cli_import_without_engines() -> None:
    code = (
        "import sys\n"
        "import lmcache_histate.cli, lmcache_histate.config\n"
        "import lmcache_histate.core.cache, lmcache_histate.core.model_presets\n"
        "import lmcache_histate.sim.runner, lmcache_histate.sim.server\n"
        "import lmcache_histate.sim.baselines\n"
        "heavy = sorted(m for m in ('lmcache', 'vllm', 'torch') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "", f"engine packages imported: {out.stdout.strip()}"
