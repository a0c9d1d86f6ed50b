"""Several recurrent states inside one prefill step: segment calls with the state carried.

A GatedDeltaNet layer's recurrent state exists where a prefill call ends, so an engine
keeps a state at a block boundary only by ending a step there (vLLM ``align`` mode; the
price of a step end, ``sim/capture.py``). ``capture_by_segments`` keeps the states at
planned boundaries inside ONE step instead: the layer's prefill kernel runs once per
segment between boundaries, each call starting from the state the previous one left, and
the state is copied at every boundary. Everything else in the step (projections, the
convolution, the attention layers, the MLPs) runs once over all the step's tokens.

Invariant: the kernel calls are exactly the calls separate steps would make (same
segments, same initial states), so the states are those of separate steps bit for bit;
only the outputs of tokens after a boundary can differ from the one-call step's, by the
kernel's own chunking error (the chunk grid restarts at each boundary). The convolution's
state at a boundary ``b`` is the last ``kernel - 1`` inputs before ``b``, a slice of the
step's input (exact by definition, nothing to run).

NOTE 1 (why segment calls, not the kernel's chunk states). Neither engine kernel hands its
per-chunk states to the caller: vLLM's CPU op ``chunk_gated_delta_rule_cpu`` updates the
pool slot in place and returns the final state only (vllm 0.32
``model_executor/layers/mamba/ops/cpu/gdn_attention.py:333-351``); on CUDA the GDN layer
calls its prefill kernel once per step with the pool as ``initial_state``
(``model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py:1231-1244``), and the Triton
``chunk_gated_delta_rule_fwd`` computes them (``third_party/flash_linear_attention/ops/
chunk.py:61-71``) but returns them only with ``GDN_RECOMPUTE_SUPPRESS_LEVEL >= 3``
(``chunk.py:83-86``) and ``ChunkGatedDeltaRuleFunction.forward`` drops them
(``chunk.py:134``); they are stored in the input dtype, bfloat16, while the state is float32
(``chunk_delta_h.py:312-315``; fla-core 0.6.0 ``ops/common/chunk_delta_h.py:722-723``), and
they exist only every 64 tokens from the step start (``utils.py:31``, ``FLA_CHUNK_SIZE``),
which a 528-token block boundary meets every fourth block. A kernel whose chunk grid
restarts at each boundary gives exact states in one call (``gdn_reference.chunked_gdn``
shows it in PyTorch); segment calls give the same states with the engines' kernels as
they ship.

NOTE 2 (where this lives). The live connector would use it from a patch of vLLM's GDN
layer (``backends/upstream/``): the prefill branch of ``_cpu_gdn_attention_nonspec`` calls
the kernel once per request with ``initial_state_indices`` naming the request's slot;
``capture_by_segments`` with :func:`vllm_cpu_kernel` is that call split at the plan's
boundaries (on CUDA, the call at ``qwen_gdn_linear_attn.py:1231``). In a batched step the
other requests' sequences still share the first call (varlen ``cu_seqlens``); a request's
later segments cannot join it, since each starts from the state the one before leaves, so
``k`` states inside a step cost ``k`` more kernel calls, not ``k`` more steps. It needs
torch only at import (vLLM is imported when the CPU kernel is asked for), so
``scripts/gpu_costs.py`` runs it on a machine without vLLM.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
from torch import Tensor

from .gdn_reference import boundary_cuts

__all__ = ["GdnKernel", "capture_by_segments", "conv_states_at", "vllm_cpu_kernel"]

GdnKernel = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
"""``kernel(q, k, v, g, beta, state) -> (o, final state)``: one sequence's chunked prefill,
shapes as in ``gdn_reference``; ``state`` ``[Hv, K, V]`` float32 may be updated in place."""


def capture_by_segments(kernel: GdnKernel, q: Tensor, k: Tensor, v: Tensor, g: Tensor,
                        beta: Tensor, state: Tensor,
                        boundaries: tuple[int, ...] | list[int] = (),
                        ) -> tuple[Tensor, Tensor, list[Tensor]]:
    """``(o, final state, [state at each boundary])``: one kernel call per segment, the
    state carried from call to call and copied (``clone``) at each boundary."""
    cuts = boundary_cuts(v.shape[0], tuple(boundaries))
    outs: list[Tensor] = []
    captured: list[Tensor] = []
    for a, b in itertools.pairwise(cuts):
        out, state = kernel(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], state)
        outs.append(out)
        if b != cuts[-1]:
            captured.append(state.clone())
    return (outs[0] if len(outs) == 1 else torch.cat(outs)), state, captured


def conv_states_at(x: Tensor, conv_state: Tensor, boundaries: tuple[int, ...] | list[int]
                   ) -> list[Tensor]:
    """The convolution's state ``[dim, width - 1]`` at each boundary of a step whose
    pre-convolution inputs are ``x`` ``[T, dim]`` and whose state before it was
    ``conv_state``: the last ``width - 1`` inputs before the boundary."""
    boundary_cuts(x.shape[0], tuple(boundaries))
    width1 = conv_state.shape[-1]
    joined = torch.cat([conv_state, x.transpose(0, 1).to(conv_state.dtype)], dim=-1)
    return [joined[:, b: b + width1].clone() for b in boundaries]


def vllm_cpu_kernel(eps: float = 1e-5) -> GdnKernel:
    """vLLM-CPU's prefill op as a :data:`GdnKernel`, called as the GDN layer calls it
    (``gdn_attention.py:333-351``: ``use_qk_l2norm_in_kernel=True``, one sequence, the
    state a pool slot updated in place; here the pool is ``state`` itself, slot 0)."""
    import vllm._custom_ops as ops

    slot = torch.zeros(1, dtype=torch.int32)

    def kernel(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
               state: Tensor) -> tuple[Tensor, Tensor]:
        pool = state.unsqueeze(0)
        cu = torch.tensor([0, v.shape[0]], dtype=torch.int32)
        out, _ = ops.chunk_gated_delta_rule_cpu(
            query=q[None], key=k[None], value=v[None], g=g[None], beta=beta[None],
            initial_state=pool, output_final_state=True, cu_seqlens=cu, head_first=False,
            use_qk_l2norm_in_kernel=True, initial_state_indices=slot, eps=eps,
        )
        return out[0], state

    return kernel
