#!/usr/bin/env python3
"""Measure the simulator's cost-model constants on this machine's GPU, in one call.

A random-weight model with Qwen3.5-9B's geometry (the ``qwen3.5-9b`` preset of
``lmcache_histate/core/model_presets.py``: 24 GatedDeltaNet + 8 full-attention layers,
bf16 weights and KV, float32 SSM state) runs prefill steps the way vLLM runs them (steps of
at most ``engine_step_tokens`` rounded down to whole blocks, the recurrent state and the KV
carried from step to step, a device sync at each step end). In order:

1. ``correctness``: the bf16 layer stack against a float32 reference (same weights, the
   token-by-token gated delta rule, plain softmax attention) on fresh random inputs; one
   prompt prefilled in one step against two steps (the cache path); the GDN kernel in use
   against the float32 recurrence; the in-step capture's states against separate steps.
   A failed check marks the JSON (``correctness.passed`` false, exit 1 at the end) and
   ``gpu_costs_fit.py`` refuses it: timing a wrong model measures nothing (NOTE 3).
2. ``copies``: one snapshot (51.5 MB) and one KV chunk (17 MB) device → pinned host →
   device; ``disk``: a cold (page cache dropped with ``posix_fadvise``) and a warm file
   read of each from ``--disk-dir``, with the disk named (device, model, filesystem).
3. ``step_price``: one prompt of 64 blocks prefilled in one step, then in steps of 16, 4
   and 1 blocks: the price of a step end is the extra time over the number of extra steps.
4. ``capture``: one GDN layer's prefill of a 16-block step with 1, 3 and 15 states kept
   inside it (``backends/vllm/gdn_capture.py``) against the same step without them.
5. ``prefill``: prompts of 2K … 100K tokens from scratch and after cached prefixes; the
   least-squares fit of ``t = a·(n − h) + c·(n² − h²)/2`` gives the cost model's
   ``prefill_s_per_token`` (a) and ``attention_s_per_token_pair`` (c).

Sections run in that order, longest prompts last; ``--budget-s`` (default 420 s of
measurement) skips what would not fit and lists it under ``skipped``, so one call ends
well inside the device's 10-minute command limit. ``scripts/gpu_costs_fit.py`` turns the
JSON into a cost-model YAML; ``benchmarks/gpu_costs.md`` says how to run it on the device.

GDN kernel: fla's Triton ``chunk_gated_delta_rule`` (fla-core 0.6.0) where it imports and
the device is CUDA, else the PyTorch chunked reference (``backends/vllm/gdn_reference.py``);
``--gdn-kernel`` forces one. ``--tiny`` (the default without CUDA) runs a tiny geometry
(``tiny-qwen3-next``'s layers and heads, an 8-token block) in seconds on a CPU: a smoke
run of the same code, whose numbers are no GPU's.

Not modelled (named in the JSON's ``model``): embeddings and the LM head (one token per
prompt), rotary position encoding (element-wise), MoE (Qwen3.5-9B is dense; its MLP width
is ``--intermediate`` = 12,288, an assumption: the preset keeps only the sizes that enter
KV and state bytes).

Exit status: 0 done, 1 a correctness check failed, 2 bad arguments or environment.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = "gpu_costs/1"


def _import_package() -> None:
    """Make ``lmcache_histate`` and ``lmcache_histate.backends`` importable from the
    checkout when the package is not installed (the device machine: no pip install)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    with contextlib.suppress(ImportError):
        import lmcache_histate.backends  # noqa: F401
        return
    spec = importlib.util.spec_from_file_location(
        "lmcache_histate.backends", ROOT / "backends" / "__init__.py",
        submodule_search_locations=[str(ROOT / "backends")])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["lmcache_histate.backends"] = module
    spec.loader.exec_module(module)


_import_package()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lmcache_histate.backends.vllm.gdn_capture import capture_by_segments  # noqa: E402
from lmcache_histate.backends.vllm.gdn_reference import chunked_gdn, recurrent_gdn  # noqa: E402

from lmcache_histate.core.model_presets import PRESET_CONFIGS, preset  # noqa: E402


# ---------------------------------------------------------------- geometry
@dataclass(frozen=True)
class Geometry:
    """The sizes the model is built with, and the engine's grid (block, step budget)."""

    name: str
    layer_kinds: tuple[str, ...]          # "gdn" | "attention", bottom to top
    hidden: int
    intermediate: int
    attention_heads: int
    kv_heads: int
    head_dim: int
    gdn_key_heads: int
    gdn_value_heads: int
    gdn_key_dim: int
    gdn_value_dim: int
    conv_kernel: int
    block_tokens: int
    step_tokens: int
    kv_bytes_per_token: int
    snapshot_bytes: int

    @property
    def gdn_layers(self) -> int:
        return self.layer_kinds.count("gdn")

    @property
    def attention_layers(self) -> int:
        return self.layer_kinds.count("attention")

    @property
    def conv_dim(self) -> int:
        return 2 * self.gdn_key_heads * self.gdn_key_dim + self.gdn_value_heads * self.gdn_value_dim


def geometry(name: str, *, intermediate: int, block_tokens: int, engine_step_tokens: int
             ) -> Geometry:
    """From a core preset: the layer kinds and head sizes of its config, the KV and
    snapshot bytes the core computes (``ModelGeometry``), the step budget on whole blocks
    (vLLM's align mode; ``CostModel.step_grid``)."""
    raw = PRESET_CONFIGS[name]
    cfg = {**raw, **raw.get("text_config", {})}
    kinds = tuple("attention" if t == "full_attention" else "gdn" for t in cfg["layer_types"])
    geo = preset(name)
    return Geometry(
        name=name, layer_kinds=kinds, hidden=cfg["hidden_size"], intermediate=intermediate,
        attention_heads=cfg["num_attention_heads"], kv_heads=cfg["num_key_value_heads"],
        head_dim=cfg["head_dim"], gdn_key_heads=cfg["linear_num_key_heads"],
        gdn_value_heads=cfg["linear_num_value_heads"], gdn_key_dim=cfg["linear_key_head_dim"],
        gdn_value_dim=cfg["linear_value_head_dim"], conv_kernel=cfg["linear_conv_kernel_dim"],
        block_tokens=block_tokens,
        step_tokens=max(1, engine_step_tokens // block_tokens) * block_tokens,
        kv_bytes_per_token=geo.kv_bytes_per_token, snapshot_bytes=geo.snapshot_bytes,
    )


@dataclass(frozen=True)
class Plan:
    """What one run measures (``full`` on a GPU, ``tiny`` anywhere in seconds)."""

    mode: str
    geometry: Geometry
    check_tokens: int
    scratch: tuple[int, ...]
    prefixed: tuple[tuple[int, int], ...]
    price_blocks: int = 64
    price_steps: tuple[int, ...] = (16, 4, 1)
    capture_blocks: int = 16
    capture_every: tuple[int, ...] = (8, 4, 1)
    repeats: int = 3
    copy_repeats: int = 10
    tolerance: dict[str, float] = field(default_factory=dict)


# NOTE 1 (tolerances). bf16 weights and activations carry a relative rounding of 2^-8 ≈
# 0.4 % per operation; over 32 residual layers the hidden state of the bf16 stack stays
# within a few percent of the float32 one when both are right (0.5 % on the tiny CPU run),
# while a wrong mask, a wrong head mapping or a lost state moves it by tens of percent
# (a random output is ~100 % off). The GDN kernel alone (bf16 q/k/v, float32 state; fla
# keeps its WY factors in bf16) is within 0.2-0.4 % on the CPU kernels. The bounds sit
# between the two, loose enough that a right model on another kernel passes: the device
# run cannot be repeated at will.
TOLERANCE = {"stack_vs_fp32": 0.10, "one_vs_two_steps": 0.10, "kernel_vs_fp32": 0.05}


def plan(mode: str, intermediate: int | None) -> Plan:
    if mode == "full":
        return Plan(
            mode="full",
            geometry=geometry("qwen3.5-9b", intermediate=intermediate or 12288,
                              block_tokens=528, engine_step_tokens=8192),
            check_tokens=256,
            scratch=(2048, 4096, 8192, 16384, 32768, 65536, 100000),
            prefixed=((16384, 24576), (32768, 40960), (65536, 73728), (92000, 100000),
                      (50000, 100000)),
            repeats=3,  # the median of 3 ignores one disturbed run (a first-call compile)
            tolerance=TOLERANCE,
        )
    return Plan(
        mode="tiny",
        geometry=geometry("tiny-qwen3-next", intermediate=intermediate or 512,
                          block_tokens=8, engine_step_tokens=128),
        check_tokens=64, scratch=(64, 128, 256, 512), prefixed=((128, 256), (256, 512)),
        price_blocks=32, price_steps=(16, 4, 1), capture_blocks=16, repeats=1, copy_repeats=3,
        tolerance=TOLERANCE,
    )


# NOTE 3 (a failed check does not stop the run). The device is lent for minutes, once: the
# timings of a run whose check failed are kept for diagnosis (what failed, by how much, how
# fast the kernels ran), but the JSON says so and no cost model is made from it.


# ---------------------------------------------------------------- the model
def _normal(shape: tuple[int, ...], std: float, gen: torch.Generator, device: str) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, device=device) * std).to(torch.bfloat16)


def build_weights(geo: Geometry, device: str, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Random bf16 weights, std 0.02, output projections scaled by (2·layers)^-1/2 (the
    usual init, which keeps a random 32-layer residual stack finite)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    h, std = geo.hidden, 0.02
    out_std = std / math.sqrt(2 * len(geo.layer_kinds))
    layers = []
    for kind in geo.layer_kinds:
        p: dict[str, torch.Tensor] = {}
        if kind == "gdn":
            qk = geo.gdn_key_heads * geo.gdn_key_dim
            vv = geo.gdn_value_heads * geo.gdn_value_dim
            p["w_qkvz"] = _normal((h, 2 * qk + 2 * vv), std, gen, device)
            p["w_ba"] = _normal((h, 2 * geo.gdn_value_heads), std, gen, device)
            p["conv_w"] = _normal((geo.conv_dim, geo.conv_kernel), 0.5, gen, device)
            p["a_log"] = torch.empty(geo.gdn_value_heads, device=device).uniform_(
                0, math.log(16), generator=gen)
            p["dt_bias"] = torch.ones(geo.gdn_value_heads, device=device)
            p["w_out"] = _normal((vv, h), out_std, gen, device)
        else:
            d = geo.head_dim
            p["w_q"] = _normal((h, 2 * geo.attention_heads * d), std, gen, device)  # q + gate
            p["w_k"] = _normal((h, geo.kv_heads * d), std, gen, device)
            p["w_v"] = _normal((h, geo.kv_heads * d), std, gen, device)
            p["w_o"] = _normal((geo.attention_heads * d, h), out_std, gen, device)
        p["w_gu"] = _normal((h, 2 * geo.intermediate), std, gen, device)
        p["w_down"] = _normal((geo.intermediate, h), out_std, gen, device)
        layers.append(p)
    return layers


def rms(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


Kernel = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class Cache:
    """One request's engine state: per GDN layer the conv and SSM state, per attention
    layer a KV buffer of ``capacity`` tokens, and the number of tokens already in it."""

    def __init__(self, geo: Geometry, capacity: int, device: str, dtype: torch.dtype) -> None:
        self.pos = 0
        self.conv: dict[int, torch.Tensor] = {}
        self.ssm: dict[int, torch.Tensor] = {}
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for i, kind in enumerate(geo.layer_kinds):
            if kind == "gdn":
                self.conv[i] = torch.zeros(geo.conv_dim, geo.conv_kernel - 1, device=device,
                                           dtype=dtype)
                self.ssm[i] = torch.zeros(geo.gdn_value_heads, geo.gdn_key_dim,
                                          geo.gdn_value_dim, device=device)
            else:
                shape = (geo.kv_heads, capacity, geo.head_dim)
                self.kv[i] = (torch.zeros(shape, device=device, dtype=dtype),
                              torch.zeros(shape, device=device, dtype=dtype))

    def reset(self) -> None:
        """Empty: no tokens, zero states (the KV buffers keep their memory)."""
        self.pos = 0
        for s in (*self.conv.values(), *self.ssm.values()):
            s.zero_()

    def fake_prefix(self, tokens: int, gen: torch.Generator) -> None:
        """Pretend ``tokens`` are cached: random KV and states (timing does not depend on
        the values; the correctness checks use real prefixes)."""
        for k, v in self.kv.values():
            k[:, :tokens].normal_(generator=gen)
            v[:, :tokens].normal_(generator=gen)
        for s in self.ssm.values():
            s.normal_(generator=gen).mul_(0.01)
        for c in self.conv.values():
            c.normal_(generator=gen)
        self.pos = tokens


AttentionImpl = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool],
                         tuple[torch.Tensor, torch.Tensor]]


def flash_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, log-sum-exp)`` of softmax attention ``[H, T, D]`` by ATen's flash kernel
    (FlashAttention-2 on CUDA, its CPU port elsewhere); ``causal`` aligns top-left."""
    op = (torch.ops.aten._scaled_dot_product_flash_attention if q.is_cuda
          else torch.ops.aten._scaled_dot_product_flash_attention_for_cpu)
    result = op(q[None], k[None], v[None], 0.0, causal)
    return result[0][0], result[1][0, :, :q.shape[1]].float()  # some kernels pad the LSE


def blocked_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                 block: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """The same by explicit float32 scores, ``block`` queries at a time (the fallback)."""
    outs, lses = [], []
    kpos = torch.arange(k.shape[1], device=q.device)[None, :]
    for start in range(0, q.shape[1], block):
        scores = (q[:, start:start + block].float() @ k.float().transpose(-1, -2))
        scores = scores / math.sqrt(q.shape[-1])
        if causal:
            qpos = torch.arange(start, start + scores.shape[1], device=q.device)[:, None]
            scores = scores.masked_fill(kpos > qpos, float("-inf"))
        lse = torch.logsumexp(scores, -1)
        outs.append(((scores - lse[..., None]).exp() @ v.float()).to(q.dtype))
        lses.append(lse)
    return torch.cat(outs, 1), torch.cat(lses, 1)


# NOTE 2 (attention after a cached prefix). A step's queries see every cached key and, causally,
# the step's own keys. SDPA's ``is_causal`` aligns the mask top-left when there are fewer
# queries than keys, and its lower-right ``CausalBias`` runs only on the memory-efficient
# kernel, which may refuse head_dim 256 and fall back to the math kernel that materialises
# T x S scores (100K x 100K does not fit). Two flash calls, prefix keys without a mask and the
# step's keys with a square causal one, merged by their log-sum-exps, are the softmax over
# the union exactly; the correctness check ``one_vs_two_steps`` runs this path.
def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int,
           impl: AttentionImpl) -> torch.Tensor:
    """A step's queries ``[H, T, D]`` over ``prefix`` cached keys (all visible) and the
    step's own ``T`` keys (causal): two kernel calls merged by their log-sum-exps
    (NOTE 2)."""
    out, lse = impl(q, k[:, prefix:], v[:, prefix:], True)
    if prefix == 0:
        return out
    out_a, lse_a = impl(q, k[:, :prefix], v[:, :prefix], False)
    top = torch.maximum(lse, lse_a)
    w, w_a = (lse - top).exp()[..., None], (lse_a - top).exp()[..., None]
    return (out.float() * w + out_a.float() * w_a) / (w + w_a)


def pick_attention(device: str, head_dim: int) -> tuple[str, AttentionImpl]:
    """ATen's flash kernel if it agrees with the float32 scores on a small case at the
    model's head size, else the blocked fallback."""
    gen = torch.Generator(device=device).manual_seed(7)
    q, k, v = (torch.randn(4, n, head_dim, generator=gen, device=device).to(torch.bfloat16)
               for n in (48, 80, 80))
    with contextlib.suppress(Exception):
        for causal, keys in ((True, 48), (False, 80)):
            got = flash_lse(q, k[:, :keys], v[:, :keys], causal)
            want = blocked_math(q, k[:, :keys], v[:, :keys], causal)
            if rel_err(got[0], want[0]) > 2e-2 or rel_err(got[1], want[1]) > 1e-3:
                break
        else:
            return "aten flash + log-sum-exp merge", flash_lse
    return "blocked float32 math (flash kernel unavailable or disagreeing)", blocked_math



def gdn_mixer(geo: Geometry, p: dict[str, torch.Tensor], x: torch.Tensor, cache: Cache, i: int,
              kernel: Kernel, boundaries: tuple[int, ...] = ()) -> torch.Tensor:
    t = x.shape[0]
    qk = geo.gdn_key_heads * geo.gdn_key_dim
    vv = geo.gdn_value_heads * geo.gdn_value_dim
    mixed, z = (x @ p["w_qkvz"].to(x.dtype)).split([2 * qk + vv, vv], dim=-1)
    b, a = (x @ p["w_ba"].to(x.dtype)).split(geo.gdn_value_heads, dim=-1)
    joined = torch.cat([cache.conv[i], mixed.transpose(0, 1)], dim=-1)
    cache.conv[i] = joined[:, -(geo.conv_kernel - 1):].clone()
    conv = F.silu(F.conv1d(joined[None], p["conv_w"].to(x.dtype)[:, None, :],
                           groups=geo.conv_dim)[0]).transpose(0, 1)
    q, k, v = conv.split([qk, qk, vv], dim=-1)
    q = q.reshape(t, geo.gdn_key_heads, geo.gdn_key_dim)
    k = k.reshape(t, geo.gdn_key_heads, geo.gdn_key_dim)
    v = v.reshape(t, geo.gdn_value_heads, geo.gdn_value_dim)
    g = -p["a_log"].float().exp() * F.softplus(a.float() + p["dt_bias"].float())
    beta = torch.sigmoid(b.float())
    o, cache.ssm[i], _ = capture_by_segments(kernel, q, k, v, g, beta, cache.ssm[i], boundaries)
    z = z.reshape(t, geo.gdn_value_heads, geo.gdn_value_dim)
    o = rms(o.to(x.dtype)) * F.silu(z)
    return o.reshape(t, vv) @ p["w_out"].to(x.dtype)


def attention_mixer(geo: Geometry, p: dict[str, torch.Tensor], x: torch.Tensor, cache: Cache,
                    i: int, impl: AttentionImpl | None) -> torch.Tensor:
    """Qwen3-Next / Qwen3.5 gated attention (q/k RMS-normed per head, a sigmoid output
    gate); the step's K and V go into the cache, its queries attend to every cached key
    before them and causally to the step's own (``impl`` None: explicit float32 scores)."""
    t, d = x.shape[0], geo.head_dim
    q, gate = (x @ p["w_q"].to(x.dtype)).reshape(t, geo.attention_heads, 2 * d).chunk(2, -1)
    k = rms((x @ p["w_k"].to(x.dtype)).reshape(t, geo.kv_heads, d))
    v = (x @ p["w_v"].to(x.dtype)).reshape(t, geo.kv_heads, d)
    q = rms(q)
    kc, vc = cache.kv[i]
    start, end = cache.pos, cache.pos + t
    kc[:, start:end] = k.transpose(0, 1).to(kc.dtype)
    vc[:, start:end] = v.transpose(0, 1).to(vc.dtype)
    groups = geo.attention_heads // geo.kv_heads
    # KV heads expanded to the query heads: a copy vLLM's kernel does not make (it reads the
    # grouped heads in place), so the attention term is overstated by that copy's time.
    keys, values = (y[:, :end].to(x.dtype).repeat_interleave(groups, 0) for y in (kc, vc))
    qh = q.transpose(0, 1)
    if impl is None:  # the float32 reference: plain softmax over explicit scores
        scores = (qh @ keys.transpose(-1, -2)) / math.sqrt(d)
        qpos = torch.arange(start, end, device=x.device)[:, None]
        kpos = torch.arange(end, device=x.device)[None, :]
        scores = scores.masked_fill(kpos > qpos, float("-inf"))
        out = torch.softmax(scores, -1) @ values
    else:
        out = attend(qh, keys, values, start, impl).to(x.dtype)
    out = out.transpose(0, 1) * torch.sigmoid(gate)
    return out.reshape(t, geo.attention_heads * d) @ p["w_o"].to(x.dtype)


def forward_step(geo: Geometry, weights: list[dict[str, torch.Tensor]], x: torch.Tensor,
                 cache: Cache, kernel: Kernel, attention: AttentionImpl | None,
                 boundaries: tuple[int, ...] = ()) -> torch.Tensor:
    """One prefill step over ``x`` [T, hidden]: every layer, the cache advanced by T."""
    for i, (kind, p) in enumerate(zip(geo.layer_kinds, weights, strict=True)):
        if kind == "gdn":
            x = x + gdn_mixer(geo, p, rms(x), cache, i, kernel, boundaries)
        else:
            x = x + attention_mixer(geo, p, rms(x), cache, i, attention)
        gate, up = (rms(x) @ p["w_gu"].to(x.dtype)).chunk(2, -1)
        x = x + (F.silu(gate) * up) @ p["w_down"].to(x.dtype)
    cache.pos += x.shape[0]
    return x


def prefill(geo: Geometry, weights: list[dict[str, torch.Tensor]], x: torch.Tensor,
            cache: Cache, kernel: Kernel, attention: AttentionImpl, step_tokens: int,
            sync: Callable[[], None]) -> torch.Tensor:
    """``x`` in steps of at most ``step_tokens``, a device sync at each step end (the
    engine samples, or at least returns to its scheduler, after every step)."""
    out = x
    for start in range(0, x.shape[0], step_tokens):
        out = forward_step(geo, weights, x[start:start + step_tokens], cache, kernel, attention)
        sync()
    return out


# ---------------------------------------------------------------- kernels
class SetupError(RuntimeError):
    """The environment cannot run what was asked (exit 2, one line)."""


def torch_kernel(q, k, v, g, beta, state):
    o, final, _ = chunked_gdn(q, k, v, g, beta, state)
    return o.to(q.dtype), final


TORCH_KERNEL = "torch-chunked (backends/vllm/gdn_reference.py)"


def pick_kernel(choice: str, device: str, geo: Geometry) -> tuple[str, Kernel]:
    """fla's Triton kernel where it imports and runs a small case at the model's head sizes
    on CUDA (``auto`` falls back to the PyTorch chunked reference, naming why), else the
    reference."""
    if choice == "torch" or (choice == "auto" and device != "cuda"):
        return TORCH_KERNEL, torch_kernel
    if device != "cuda":
        raise SetupError("--gdn-kernel fla needs a CUDA device")
    try:
        import fla
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        def fla_kernel(q, k, v, g, beta, state):
            o, final = chunk_gated_delta_rule(
                q[None], k[None], v[None], g[None], beta[None].to(q.dtype),
                initial_state=state[None], output_final_state=True,
                use_qk_l2norm_in_kernel=True)
            return o[0], final[0]

        gen = torch.Generator(device=device).manual_seed(3)
        fla_kernel(*gdn_inputs(geo, 100, device, torch.bfloat16, gen))
        torch.cuda.synchronize()
    except Exception as e:  # ImportError, a Triton compile error, a shape it refuses
        why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]
        if choice == "fla":
            raise SetupError(f"--gdn-kernel fla: fla does not run here ({why}); carry the "
                             "fla-core and einops wheels (benchmarks/gpu_costs.md)") from e
        return f"{TORCH_KERNEL}; fla unavailable: {why}", torch_kernel
    return f"fla {getattr(fla, '__version__', '?')}", fla_kernel


def fp32_kernel(q, k, v, g, beta, state):
    return recurrent_gdn(q, k, v, g, beta, state)


# ---------------------------------------------------------------- measurements
class Clock:
    """Wall time with the device drained at both ends; the run's budget."""

    def __init__(self, device: str, budget_s: float) -> None:
        self.device = device
        self.start = time.perf_counter()
        self.budget_s = budget_s
        self.skipped: list[str] = []

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def time(self, fn: Callable[[], Any]) -> float:
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - t0

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.start)

    def fits(self, what: str, predicted_s: float) -> bool:
        if predicted_s <= self.left():
            return True
        self.skipped.append(f"{what} (predicted {predicted_s:.1f} s, {self.left():.1f} s left)")
        return False


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def gdn_inputs(geo: Geometry, n: int, device: str, dtype: torch.dtype, gen: torch.Generator
               ) -> tuple[torch.Tensor, ...]:
    """Random inputs of one GDN layer's prefill kernel for ``n`` tokens: q, k, v in
    ``dtype``, decays in (e^-0.5, 1], write strengths in [0, 1), a small random state."""
    hk, hv, dk, dv = geo.gdn_key_heads, geo.gdn_value_heads, geo.gdn_key_dim, geo.gdn_value_dim
    q = torch.randn(n, hk, dk, generator=gen, device=device).to(dtype)
    k = torch.randn(n, hk, dk, generator=gen, device=device).to(dtype)
    v = torch.randn(n, hv, dv, generator=gen, device=device).to(dtype)
    g = -torch.rand(n, hv, generator=gen, device=device) * 0.5
    beta = torch.rand(n, hv, generator=gen, device=device)
    return q, k, v, g, beta, torch.randn(hv, dk, dv, generator=gen, device=device) * 0.1


def correctness(p: Plan, weights, kernel: Kernel, attention: AttentionImpl, device: str,
                dtype: torch.dtype,
                gen: torch.Generator) -> dict[str, Any]:
    geo = p.geometry
    n = p.check_tokens
    x = torch.randn(n, geo.hidden, generator=gen, device=device).to(dtype)
    checks = []

    def check(name: str, value: float, tol: float, detail: str) -> None:
        checks.append({"name": name, "value": value, "tolerance": tol,
                       "passed": bool(value <= tol), "what": detail})

    one = forward_step(geo, weights, x, Cache(geo, n, device, dtype), kernel, attention)
    ref_weights = [{k: w.float() for k, w in layer.items()} for layer in weights]
    ref = forward_step(geo, ref_weights, x.float(), Cache(geo, n, device, torch.float32),
                       fp32_kernel, None)
    del ref_weights
    check("stack_vs_fp32", rel_err(one, ref), p.tolerance["stack_vs_fp32"],
          f"{n} tokens through all {len(geo.layer_kinds)} layers, bf16 vs float32 reference")
    cache = Cache(geo, n, device, dtype)
    half = n // 2
    forward_step(geo, weights, x[:half], cache, kernel, attention)
    two = forward_step(geo, weights, x[half:], cache, kernel, attention)
    check("one_vs_two_steps", rel_err(two, one[half:]), p.tolerance["one_vs_two_steps"],
          f"tokens {half}..{n} prefilled after a cached prefix of {half} vs in one step")

    q, k, v, g, beta, s0 = gdn_inputs(geo, n, device, dtype, gen)
    o_k, s_k = kernel(q, k, v, g, beta, s0.clone())
    o_r, s_r = recurrent_gdn(q, k, v, g, beta, s0)
    check("kernel_vs_fp32", max(rel_err(o_k, o_r), rel_err(s_k, s_r)),
          p.tolerance["kernel_vs_fp32"], "one GDN layer's prefill kernel (bf16 q/k/v) vs the "
          "float32 token recurrence: output and final state")
    cuts = (n // 3, 2 * n // 3)
    _, _, states = capture_by_segments(kernel, q, k, v, g, beta, s0.clone(), cuts)
    separate, s = [], s0.clone()
    for a, b in ((0, cuts[0]), (cuts[0], cuts[1])):
        _, s = kernel(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], s)
        separate.append(s.clone())
    equal = all(torch.equal(a, b) for a, b in zip(states, separate, strict=True))
    check("capture_vs_separate_steps", 0.0 if equal else 1.0, 0.0,
          f"states at {list(cuts)} from one step with capture vs separate steps: bit-identical")
    return {"passed": all(c["passed"] for c in checks), "checks": checks}


def copies(p: Plan, device: str, clock: Clock) -> list[dict[str, Any]]:
    """Device → pinned host → device for one snapshot and one KV chunk (median of
    ``copy_repeats``); on a CPU plain host copies (no device, no pinning)."""
    rows = []
    geo = p.geometry
    for what, nbytes in (("snapshot", geo.snapshot_bytes),
                         ("kv_chunk", geo.block_tokens * geo.kv_bytes_per_token)):
        dev = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device == "cuda")
        back = torch.empty_like(dev)
        d2h = [clock.time(lambda h=host, d=dev: h.copy_(d, non_blocking=True))
               for _ in range(p.copy_repeats)]
        h2d = [clock.time(lambda b=back, h=host: b.copy_(h, non_blocking=True))
               for _ in range(p.copy_repeats)]
        ok = bool(torch.equal(back, dev))
        d2h_s, h2d_s = statistics.median(d2h), statistics.median(h2d)
        rows.append({"what": what, "bytes": nbytes, "d2h_s": d2h_s, "h2d_s": h2d_s,
                     "d2h_bytes_per_s": nbytes / d2h_s, "h2d_bytes_per_s": nbytes / h2d_s,
                     "round_trip_equal": ok, "pinned": device == "cuda"})
    return rows


def disk_info(path: Path) -> dict[str, Any]:
    """The filesystem and block device holding ``path``, from /proc and /sys (Linux)."""
    info: dict[str, Any] = {"path": str(path)}
    best = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            source, mount, fstype = line.split()[:3]
            if str(path).startswith(mount) and len(mount) > len(best):
                best = mount
                info.update(mount=mount, fstype=fstype, source=source)
    st = os.stat(path)
    block = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    if block.exists():
        dev = block.resolve()
        disk = dev if (dev / "device").exists() else dev.parent
        info["block_device"] = dev.name
        for key, rel in (("model", "device/model"), ("rotational", "queue/rotational"),
                         ("size_sectors", "size")):
            with contextlib.suppress(OSError):
                info[key] = (disk / rel).read_text().strip()
        with contextlib.suppress(OSError):
            info["driver"] = (disk / "device" / "driver").resolve(strict=True).name
    else:
        info["block_device"] = None  # overlay / tmpfs / network: no block device behind it
    return info


def disk_reads(p: Plan, directory: Path, clock: Clock) -> dict[str, Any]:
    """Write each object to a file (fsync), drop it from the page cache
    (``POSIX_FADV_DONTNEED``), time a cold read into a (pinned) host buffer, then a warm one."""
    geo = p.geometry
    work = Path(tempfile.mkdtemp(prefix="gpu_costs_", dir=directory))
    rows = []
    try:
        for what, nbytes in (("snapshot", geo.snapshot_bytes),
                             ("kv_chunk", geo.block_tokens * geo.kv_bytes_per_token)):
            path = work / what
            data = os.urandom(nbytes)
            with open(path, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            buf = torch.empty(nbytes, dtype=torch.uint8,
                              pin_memory=clock.device == "cuda").numpy()
            cold, warm = [], []
            for _ in range(3):
                fd = os.open(path, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
                cold.append(_timed_read(path, buf))
                warm.append(_timed_read(path, buf))
            assert bytes(buf[:64]) == data[:64]
            rows.append({"what": what, "bytes": nbytes, "cold_s": statistics.median(cold),
                         "warm_s": statistics.median(warm),
                         "cold_bytes_per_s": nbytes / statistics.median(cold),
                         "warm_bytes_per_s": nbytes / statistics.median(warm)})
    finally:
        for f in work.iterdir():
            f.unlink()
        work.rmdir()
    return {"disk": disk_info(directory), "reads": rows,
            "cold": "page cache dropped with posix_fadvise(POSIX_FADV_DONTNEED) after fsync"}


def _timed_read(path: Path, buf: Any) -> float:
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        view = memoryview(buf)
        got = 0
        while got < len(view):
            n = f.readinto(view[got:])
            if not n:
                break
            got += n
    return time.perf_counter() - t0


def _median_time(clock: Clock, fn: Callable[[], Any], repeats: int) -> tuple[float, list[float]]:
    times = [clock.time(fn) for _ in range(repeats)]
    return statistics.median(times), times


def step_price(p: Plan, weights, kernel: Kernel, attention: AttentionImpl, device: str,
               dtype: torch.dtype,
               clock: Clock, gen: torch.Generator) -> dict[str, Any]:
    geo = p.geometry
    tokens = p.price_blocks * geo.block_tokens
    x = torch.randn(tokens, geo.hidden, generator=gen, device=device).to(dtype)
    cache = Cache(geo, tokens, device, dtype)

    def run(step: int) -> Callable[[], Any]:
        def go() -> None:
            cache.reset()
            prefill(geo, weights, x, cache, kernel, attention, step, clock.sync)
        return go

    run(tokens)()  # warm-up (allocator, autotuning)
    one, one_all = _median_time(clock, run(tokens), p.repeats)
    rows = [{"blocks_per_step": p.price_blocks, "steps": 1, "seconds": one, "repeats": one_all}]
    for blocks in p.price_steps:
        steps = p.price_blocks // blocks
        if not clock.fits(f"step_price {blocks}-block steps", one * 1.5 * p.repeats * 2):
            continue
        t, all_t = _median_time(clock, run(blocks * geo.block_tokens), p.repeats)
        rows.append({"blocks_per_step": blocks, "steps": steps, "seconds": t, "repeats": all_t,
                     "price_s_per_step_end": (t - one) / (steps - 1)})
    return {"prompt_tokens": tokens, "block_tokens": geo.block_tokens, "rows": rows}


def capture_cost(p: Plan, kernel: Kernel, kernel_name: str, device: str, dtype: torch.dtype,
                 clock: Clock, gen: torch.Generator) -> dict[str, Any]:
    """One GDN layer's prefill kernel on a step of ``capture_blocks`` blocks, with a state
    kept every ``e`` blocks inside it, against the same step without."""
    geo = p.geometry
    n = p.capture_blocks * geo.block_tokens
    q, k, v, g, beta, s0 = gdn_inputs(geo, n, device, dtype, gen)
    reps = max(3, p.repeats)
    methods: dict[str, Callable[..., Any]] = {
        f"segments ({kernel_name.split()[0]})": lambda b: capture_by_segments(
            kernel, q, k, v, g, beta, s0.clone(), b)}
    if device != "cuda" or kernel_name.startswith("torch"):
        methods["grid (torch-chunked)"] = lambda b: chunked_gdn(q, k, v, g, beta, s0, b)
    rows = []
    for method, fn in methods.items():
        fn(())  # warm-up
        base, _ = _median_time(clock, lambda f=fn: f(()), reps)
        for every in p.capture_every:
            bounds = tuple(range(every * geo.block_tokens, n, every * geo.block_tokens))
            t, _ = _median_time(clock, lambda f=fn, b=bounds: f(b), reps)
            states = fn(bounds)[2]
            separate, s = [], s0.clone()
            for a, b in zip((0, *bounds[:-1]), bounds, strict=True):
                s = _segment(kernel, method, q, k, v, g, beta, s, a, b)
                separate.append(s.clone())
            exact = all(torch.equal(x, y) for x, y in zip(states, separate, strict=True))
            rows.append({"method": method, "states": len(bounds), "every_blocks": every,
                         "seconds": t, "seconds_without": base,
                         "extra_s_per_state_per_layer": (t - base) / len(bounds),
                         "extra_s_per_state_model": (t - base) / len(bounds) * geo.gdn_layers,
                         "states_equal_separate_steps": exact})
    return {"step_tokens": n, "block_tokens": geo.block_tokens, "gdn_layers": geo.gdn_layers,
            "rows": rows}


def _segment(kernel, method, q, k, v, g, beta, s, a, b):
    """The state after a separate step over ``[a, b)`` from ``s``, by the method's kernel."""
    if method.startswith("grid"):
        return chunked_gdn(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], s)[1]
    return kernel(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], s.clone())[1]


def prefill_sweep(p: Plan, weights, kernel: Kernel, attention: AttentionImpl, device: str,
                  dtype: torch.dtype,
                  clock: Clock, gen: torch.Generator) -> list[dict[str, Any]]:
    geo = p.geometry
    capacity = max([*p.scratch, *(n for _, n in p.prefixed)])
    cache = Cache(geo, capacity, device, dtype)
    x_all = torch.randn(capacity, geo.hidden, generator=gen, device=device).to(dtype)
    rows: list[dict[str, Any]] = []

    def run(hit: int, n: int) -> Callable[[], Any]:
        def go() -> None:
            cache.reset()
            if hit:
                cache.fake_prefix(hit, gen)
            prefill(geo, weights, x_all[hit:n], cache, kernel, attention, geo.step_tokens,
                    clock.sync)
        return go

    run(0, min(p.scratch))()  # warm-up
    points = [(0, n) for n in p.scratch] + list(p.prefixed)
    for hit, n in points:
        predicted = _predict(rows, hit, n) * p.repeats
        if not clock.fits(f"prefill h={hit} n={n}", predicted):
            continue
        t, all_t = _median_time(clock, run(hit, n), p.repeats)
        rows.append({"hit_tokens": hit, "input_tokens": n, "seconds": t, "repeats": all_t})
    return rows


def _predict(rows: list[dict[str, Any]], hit: int, n: int) -> float:
    """A generous guess of one run's time from the runs so far (quadratic growth)."""
    if not rows:
        return 0.0
    last = max(rows, key=lambda r: r["input_tokens"] - r["hit_tokens"])
    done = last["input_tokens"] ** 2 - last["hit_tokens"] ** 2
    ratio = max((n - hit) / (last["input_tokens"] - last["hit_tokens"]),
                (n * n - hit * hit) / max(done, 1))
    return last["seconds"] * max(1.0, ratio) * 1.2


def fit(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Least squares of ``t = a·(n − h) + c·(n² − h²)/2`` over the prefill rows, both
    coefficients ≥ 0 (where the free fit makes one negative, it is 0 and the other is
    refitted alone); the relative residuals say how well two terms describe the rows."""
    if len(rows) < 2:
        return None
    xs = [(r["input_tokens"] - r["hit_tokens"],
           (r["input_tokens"] ** 2 - r["hit_tokens"] ** 2) / 2) for r in rows]
    ts = [r["seconds"] for r in rows]
    # Relative least squares (each row weighted by 1/t): short prompts count as much as long.
    w = [1 / t for t in ts]
    s11 = sum((x1 * wi) ** 2 for (x1, _), wi in zip(xs, w, strict=True))
    s22 = sum((x2 * wi) ** 2 for (_, x2), wi in zip(xs, w, strict=True))
    s12 = sum(x1 * x2 * wi * wi for (x1, x2), wi in zip(xs, w, strict=True))
    y1 = sum(x1 * t * wi * wi for (x1, _), t, wi in zip(xs, ts, w, strict=True))
    y2 = sum(x2 * t * wi * wi for (_, x2), t, wi in zip(xs, ts, w, strict=True))
    det = s11 * s22 - s12 * s12
    a, c = ((y1 * s22 - y2 * s12) / det, (y2 * s11 - y1 * s12) / det) if det > 0 else (-1, -1)
    if a < 0 or c < 0:
        a_only, c_only = max(0.0, y1 / s11), max(0.0, y2 / s22)
        err_a = sum(((a_only * x1 - t) * wi) ** 2 for (x1, _), t, wi in zip(xs, ts, w, strict=True))
        err_c = sum(((c_only * x2 - t) * wi) ** 2 for (_, x2), t, wi in zip(xs, ts, w, strict=True))
        a, c = (a_only, 0.0) if err_a <= err_c else (0.0, c_only)
    residuals = [(a * x1 + c * x2 - t) / t for (x1, x2), t in zip(xs, ts, strict=True)]
    return {"prefill_s_per_token": a, "attention_s_per_token_pair": c,
            "max_rel_residual": max(abs(r) for r in residuals),
            "rel_residuals": residuals, "rows": len(rows)}


# ---------------------------------------------------------------- report
def machine(device: str, kernel_name: str) -> dict[str, Any]:
    info: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if device == "cuda" else
        f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
        "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
        "gdn_kernel": kernel_name, "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    with contextlib.suppress(ImportError):
        import triton
        info["triton"] = triton.__version__
    with contextlib.suppress(ImportError):
        import transformers
        info["transformers"] = transformers.__version__
    return info


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:9.3f} ms"


def _gbs(rate: float) -> str:
    return f"{rate / 1e9:6.2f} GB/s"


def table(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [f"gpu_costs ({result['mode']}) on {m['device']}",
             f"GDN kernel: {m['gdn_kernel']}; attention: {m['attention']}"]
    lines += [f"check {c['name']:26s} {c['value']:.2e} <= {c['tolerance']:.0e}  "
              f"{'ok' if c['passed'] else 'FAILED'}" for c in result["correctness"]["checks"]]
    for r in result.get("copies", []):
        lines.append(f"copy {r['what']:9s} {r['bytes'] / 1e6:7.2f} MB  d2h {_ms(r['d2h_s'])} "
                     f"{_gbs(r['d2h_bytes_per_s'])}  h2d {_ms(r['h2d_s'])} "
                     f"{_gbs(r['h2d_bytes_per_s'])}")
    if "disk" in result:
        d = result["disk"]["disk"]
        lines.append(f"disk {d.get('block_device')} model={d.get('model')} "
                     f"fs={d.get('fstype')} rotational={d.get('rotational')} at {d.get('path')}")
        for r in result["disk"]["reads"]:
            lines.append(f"read {r['what']:9s} {r['bytes'] / 1e6:7.2f} MB  cold {_ms(r['cold_s'])} "
                         f"{_gbs(r['cold_bytes_per_s'])}  warm {_ms(r['warm_s'])}")
    if "step_price" in result:
        sp = result["step_price"]
        lines.append(f"step price: {sp['prompt_tokens']} tokens, block {sp['block_tokens']}")
        for r in sp["rows"]:
            price = r.get("price_s_per_step_end")
            lines.append(f"  {r['blocks_per_step']:3d} blocks/step {r['steps']:3d} steps "
                         f"{r['seconds']:9.4f} s"
                         + (f"  {_ms(price)} per step end" if price is not None else ""))
    if "capture" in result:
        cp = result["capture"]
        lines.append(f"in-step capture: one GDN layer, a step of {cp['step_tokens']} tokens")
        for r in cp["rows"]:
            lines.append(f"  {r['method']:27s} {r['states']:2d} states {_ms(r['seconds'])} "
                         f"(without {_ms(r['seconds_without'])}) "
                         f"{_ms(r['extra_s_per_state_per_layer'])}/state/layer "
                         f"exact={r['states_equal_separate_steps']}")
    if result.get("prefill"):
        lines.append("prefill:        h         n      seconds   tokens/s")
        for r in result["prefill"]:
            n = r["input_tokens"] - r["hit_tokens"]
            lines.append(f"  {r['hit_tokens']:14d} {r['input_tokens']:9d} {r['seconds']:12.4f} "
                         f"{n / r['seconds']:10.0f}")
    f = result.get("fit")
    if f:
        lines.append(f"fit: prefill_s_per_token {f['prefill_s_per_token']:.3e}, "
                     f"attention_s_per_token_pair {f['attention_s_per_token_pair']:.3e}, "
                     f"max relative residual {f['max_rel_residual']:.1%} over {f['rows']} rows")
    if result.get("skipped"):
        lines.append("skipped (budget): " + "; ".join(result["skipped"]))
    lines.append(f"elapsed {result['elapsed_s']:.1f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="gpu_costs.json", help="where the JSON goes")
    ap.add_argument("--tiny", action="store_true",
                    help="the tiny geometry (automatic without CUDA): a smoke run in seconds")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--gdn-kernel", choices=("auto", "fla", "torch"), default="auto")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="seconds of measurement; what would not fit is skipped (default 420)")
    ap.add_argument("--disk-dir", default=str(ROOT),
                    help="folder on the disk to read from (default: the checkout)")
    ap.add_argument("--intermediate", type=int, default=None,
                    help="MLP width (default 12288 full, 512 tiny)")
    ap.add_argument("--threads", type=int, default=1,
                    help="CPU threads on a CPU run (default 1: many tiny ops on a shared "
                         "machine run faster on one thread than on contended ones)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" \
        else args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu_costs: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    disk_dir = Path(args.disk_dir).resolve()
    if not disk_dir.is_dir():
        print(f"gpu_costs: --disk-dir {disk_dir} is not a folder", file=sys.stderr)
        return 2
    mode = "tiny" if args.tiny or device != "cuda" else "full"
    if device == "cpu":
        torch.set_num_threads(max(1, args.threads))
    p = plan(mode, args.intermediate)
    dtype = torch.bfloat16
    clock = Clock(device, args.budget_s)
    gen = torch.Generator(device=device).manual_seed(args.seed + 1)
    try:
        kernel_name, kernel = pick_kernel(args.gdn_kernel, device, p.geometry)
    except SetupError as e:
        print(f"gpu_costs: {e}", file=sys.stderr)
        return 2
    attention_name, attention = pick_attention(device, p.geometry.head_dim)
    geo = p.geometry
    result: dict[str, Any] = {
        "schema": SCHEMA, "mode": mode,
        "machine": {**machine(device, kernel_name), "attention": attention_name},
        "geometry": {**asdict(geo), "gdn_layers": geo.gdn_layers,
                     "attention_layers": geo.attention_layers},
        "model": {"weights": "bfloat16, random (std 0.02)", "ssm_state": "float32",
                  "kv": "bfloat16", "not_modelled": ["embeddings", "lm_head",
                                                     "rotary position encoding", "moe"],
                  "intermediate_assumed": geo.intermediate},
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else
                                                        sys.argv[1:])]),
    }
    out = Path(args.json)

    def save() -> None:
        """The JSON so far (after every section: a run cut short keeps what it measured)."""
        result["skipped"] = clock.skipped
        result["elapsed_s"] = time.perf_counter() - clock.start
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(result, indent=2) + "\n")
        tmp.replace(out)

    def finish(code: int) -> int:
        save()
        print(table(result))
        print(f"gpu_costs: wrote {out}")
        return code

    with torch.inference_mode():
        t0 = time.perf_counter()
        weights = build_weights(geo, device, args.seed)
        result["correctness"] = correctness(p, weights, kernel, attention, device, dtype,
                                            gen)
        result["section_s"] = {"correctness": time.perf_counter() - t0}
        print(f"[gpu_costs] correctness done in {result['section_s']['correctness']:.1f} s",
              file=sys.stderr, flush=True)
        failed = not result["correctness"]["passed"]
        if failed:  # NOTE 3
            print("gpu_costs: A CORRECTNESS CHECK FAILED: the timings below are kept for "
                  "diagnosis only (gpu_costs_fit.py refuses this JSON)", file=sys.stderr)
        sections: dict[str, Callable[[], Any]] = {
            "copies": lambda: copies(p, device, clock),
            "disk": lambda: disk_reads(p, disk_dir, clock),
            "step_price": lambda: step_price(p, weights, kernel, attention, device, dtype, clock,
                                               gen),
            "capture": lambda: capture_cost(p, kernel, kernel_name, device, dtype, clock, gen),
            "prefill": lambda: prefill_sweep(p, weights, kernel, attention, device, dtype,
                                                 clock, gen),
        }
        for name, section in sections.items():
            t0 = time.perf_counter()
            result[name] = section()
            result["section_s"][name] = time.perf_counter() - t0
            save()
            print(f"[gpu_costs] {name} done in {result['section_s'][name]:.1f} s",
                  file=sys.stderr, flush=True)
        result["fit"] = fit(result["prefill"])
    return finish(1 if failed else 0)


if __name__ == "__main__":
    sys.exit(main())
