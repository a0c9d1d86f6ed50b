"""The gated delta rule in plain PyTorch: the token recurrence and the chunked prefill.

This is the specification the GatedDeltaNet kernels implement (vLLM's CPU op
``chunk_gated_delta_rule_cpu``, fla's Triton ``chunk_gated_delta_rule``), written so that
it runs anywhere PyTorch runs and can hand out the recurrent state at planned boundaries
inside one call. It needs torch only (no vLLM), so ``scripts/gpu_costs.py`` runs it on a GPU
machine without vLLM, where fla's kernels are not installed either.

Shapes, one sequence (a request's prefill step; no batch dimension): queries and keys
``[T, Hk, K]``, values ``[T, Hv, V]``, log-decay ``g`` and write strength ``beta``
``[T, Hv]``, the recurrent state ``[Hv, K, V]`` in float32 (vLLM's and fla's layout for
the SSM state, ``[N, HV, K, V]``). ``Hv`` is a multiple of ``Hk``; value head ``h`` reads
key head ``h // (Hv / Hk)`` (fla's grouped-value mapping, transformers'
``repeat_interleave``).

The rule, per head, token by token (``recurrent_gdn``; q and k L2-normalised, q scaled
by ``K^-1/2``)::

    S ← exp(g_t) · S
    S ← S + β_t · k_t (v_t − Sᵀ k_t)ᵀ
    o_t = Sᵀ q_t

``chunked_gdn`` computes the same thing chunk by chunk (the WY / UT-transform form of
transformers 5 ``models/qwen3_next/modeling_qwen3_next.py: torch_chunk_gated_delta_rule``,
which fla's kernels implement too): inside a chunk of ``C`` tokens every quantity is a few
batched matmuls, and a sequential scan carries ``S`` from chunk to chunk.

NOTE 1 (the chunk grid follows the boundaries). The kernels lay their chunk grid from the
start of each sequence, so a state exists only at multiples of ``C`` (64) from the step's
first token, and a 528-token block boundary falls on that grid only every fourth block
(2,112 = 33 x 64). ``chunked_gdn(boundaries=...)`` restarts the grid at every boundary
instead (a chunk never crosses one; the chunk before a boundary may be short and is
zero-padded, which changes nothing: ``g = 0`` does not decay, ``β = 0`` does not write).
The scan then passes every boundary at a chunk end and copies ``S`` there. Every chunk of
such a call is a chunk that separate calls, one per segment, would compute with the same
shapes, and the scan runs the same operations in the same order, so the states are those
of separate steps bit for bit (``tests/test_gdn_capture.py`` checks it; the cost is one
extra, partly empty chunk per boundary and the copy).
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

__all__ = ["CHUNK_TOKENS", "boundary_cuts", "chunked_gdn", "l2norm", "recurrent_gdn"]

CHUNK_TOKENS = 64  # fla's FLA_CHUNK_SIZE and transformers' default chunk_size


def boundary_cuts(tokens: int, boundaries: tuple[int, ...] | list[int]) -> list[int]:
    """``[0, *boundaries, tokens]`` after checking the boundaries are increasing integers
    strictly inside ``(0, tokens)``; a bad list is a one-line ``ValueError``."""
    cuts = [0, *boundaries, tokens]
    for a, b in itertools.pairwise(cuts):
        if not isinstance(b, int) or isinstance(b, bool) or b <= a:
            raise ValueError(
                f"boundaries must be increasing integers strictly inside (0, {tokens}), "
                f"got {list(boundaries)!r}"
            )
    return cuts


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x / sqrt(Σ x² + eps)`` over the last axis (fla's and transformers' form)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _heads_first(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                 eps: float) -> tuple[Tensor, ...]:
    """float32, ``[H, T, ...]``, keys expanded to the value heads, q/k normalised, q scaled."""
    hv, hk = v.shape[1], k.shape[1]
    if hv % hk:
        raise ValueError(f"value heads ({hv}) must be a multiple of key heads ({hk})")
    q, k = (l2norm(x.float(), eps).repeat_interleave(hv // hk, dim=1) for x in (q, k))
    q = q * q.shape[-1] ** -0.5
    return (q.transpose(0, 1), k.transpose(0, 1), v.float().transpose(0, 1),
            g.float().transpose(0, 1), beta.float().transpose(0, 1))


def recurrent_gdn(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                  eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """``(o [T, Hv, V] float32, final state)``: the rule above, one token at a time, in
    float32 (the reference the chunked forms are checked against; O(T) small steps)."""
    q, k, v, g, beta = _heads_first(q, k, v, g, beta, eps)
    s = state.float().clone()
    out = torch.empty_like(v)
    for t in range(v.shape[1]):
        s = s * g[:, t].exp()[:, None, None]
        kv_mem = (s * k[:, t, :, None]).sum(1)                    # Sᵀ k   [H, V]
        delta = (v[:, t] - kv_mem) * beta[:, t, None]
        s = s + k[:, t, :, None] * delta[:, None, :]
        out[:, t] = (s * q[:, t, :, None]).sum(1)                 # Sᵀ q
    return out.transpose(0, 1), s


def _chunk_index(tokens: int, cuts: list[int], chunk: int) -> Tensor:
    """``[n_chunks, chunk]`` token positions; ``tokens`` (a zero row) pads short chunks."""
    rows = []
    for a, b in itertools.pairwise(cuts):
        for start in range(a, b, chunk):
            stop = min(start + chunk, b)
            rows.append(list(range(start, stop)) + [tokens] * (chunk - (stop - start)))
    return torch.tensor(rows, dtype=torch.long)


def chunked_gdn(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                boundaries: tuple[int, ...] | list[int] = (), chunk: int = CHUNK_TOKENS,
                eps: float = 1e-6) -> tuple[Tensor, Tensor, list[Tensor]]:
    """``(o [T, Hv, V] float32, final state, states at boundaries)`` by chunks of ``chunk``
    tokens laid from 0 and restarted at each boundary (NOTE 1). The states are float32
    copies of ``S`` after the tokens before each boundary; ``state`` is not modified."""
    tokens = v.shape[0]
    cuts = boundary_cuts(tokens, tuple(boundaries))
    index = _chunk_index(tokens, cuts, chunk).to(v.device)
    n = index.shape[0]
    q, k, v, g, beta = _heads_first(q, k, v, g, beta, eps)

    def chunks(x: Tensor) -> Tensor:  # [H, T, ...] -> [H, n, C, ...], padding rows zero
        padded = torch.cat([x, x.new_zeros(x[:, :1].shape)], dim=1)
        return padded[:, index.reshape(-1)].reshape(x.shape[0], n, chunk, *x.shape[2:])

    q, k, v, g, beta = (chunks(x) for x in (q, k, v, g, beta))
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    cum = g.cumsum(-1)                                              # log decay since chunk start
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=v.device).triu(1)
    pair = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    ut = (k_beta @ k.transpose(-1, -2)) * pair                     # I + strictly lower part
    intra = (q @ k.transpose(-1, -2)) * pair
    new_v = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut, k_beta * cum.exp()[..., None], upper=False,
                                               unitriangular=True)
    q = q * cum.exp()[..., None]
    k = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]

    s = state.float().clone()
    out = torch.empty_like(v)
    ends = index.masked_fill(index == tokens, -1).amax(1) + 1      # first token after each chunk
    wanted = set(cuts[1:-1])
    captured: list[Tensor] = []
    for i, end in enumerate(ends.tolist()):
        v_new = new_v[:, i] - k_cumdecay[:, i] @ s
        out[:, i] = q[:, i] @ s + intra[:, i] @ v_new
        s = s * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
        if end in wanted:
            captured.append(s.clone())
    valid = index.reshape(-1) < tokens
    o = out.reshape(out.shape[0], n * chunk, -1)[:, valid]  # rows hold tokens in order
    return o.transpose(0, 1), s, captured
