"""A tiny random-weight ``Qwen3NextForCausalLM`` checkpoint, generated locally (no downloads).

Why: the live tests and the demo need a real hybrid (GatedDeltaNet + full attention) model that
vLLM's CPU build can serve in seconds, and nothing may be downloaded. ``Qwen3NextForCausalLM`` has
the same GDN layer as Qwen3.5 without the Qwen3.5 classes' torchvision import (docs/design.md §5.3).

What is generated, deterministically from ``seed`` (same seed -> byte-identical files):

* ``config.json``: the geometry of the core preset ``tiny-qwen3-next``
  (``lmcache_histate/core/hf_config.py``) plus the MoE and misc fields vLLM needs. vLLM refuses a
  Qwen3-Next without MoE layers (``QwenNextMixtureOfExperts.set_moe_parameters``: "No Qwen3Next
  layer found"), so layers 1 and 3 are MoE (``mlp_only_layers=[0, 2]``) with 4 experts, top-2.
* ``model.safetensors``: random weights in the *original checkpoint* naming vLLM's loader expects
  (per-expert ``mlp.experts.{i}.{gate,up,down}_proj.weight``; transformers 5 keeps experts fused
  in memory, so its ``save_pretrained`` output is not used).
* ``tokenizer.json`` + ``tokenizer_config.json``: a byte-level BPE trained here with
  ``tokenizers`` on a small built-in corpus, filled up to the model's ``vocab_size`` with
  whole-word pseudo-words (NOTE 2), so every id the model can generate decodes to text;
* ``chat_template.jinja``: a plain ``role: content`` chat template (:data:`CHAT_TEMPLATE`).
  vLLM's OpenAI server answers chat completions with HTTP 400 ("default chat template is no
  longer allowed") for a tokenizer without one, and agents use chat completions.

The directory is cached under ``$HISTATE_CACHE_DIR`` (default ``~/.cache/lmcache-histate``)
keyed by a hash of everything that determines its content, and written atomically (tmp dir +
rename), so concurrent callers are safe.

Sizes (:data:`MODEL_SIZES`, ``--size``): ``tiny`` is :data:`TINY_CONFIG`; ``production`` is the
same generator at a geometry whose *ratios* are Qwen3.5-9B's on an H100 (below).

Production proportions, from ``lmcache_histate/data/cost_model_qwen35_9b_h100.yaml`` (prefill
``t = 80 µs`` per token, host DRAM -> GPU ``50 GB/s``, NVMe ``5 GB/s``) and the 9B geometry
(8 attention layers x 4 KV heads x 256 dims, bf16; 24 GDN layers of 32 value heads x 128 x 128
fp32 plus a 3 x 8192 bf16 conv state):

* KV bytes per token ``b = 8 * 2 * 4 * 256 * 2 = 32,768``; one GDN layer's state row
  ``r = 32*128*128*4 + 3*8192*2 = 2,146,304``; a snapshot ``24 r = 51,511,296 B`` (51.5 MB).
* Prefill vs KV bytes: ``R = t * B / b``, how many tokens' KV move in one token's prefill
  time. DRAM tier: ``80e-6 * 50e9 / 32,768 = 122``; disk tier: ``12.2``.
* Snapshot vs KV: ``N_s = 24 r / b = 1,572`` tokens of KV per snapshot (bandwidth-free; the
  interval choice, docs/design.md §4, depends on it only). Moving one takes
  ``51.5 MB / 50 GB/s = 1.03 ms`` (DRAM) or ``10.3 ms`` (NVMe), the prefill of ``12.9`` or
  ``129`` tokens; a 528-token chunk it saves costs ``42 ms`` of prefill.
* Fixed cost vs prefill: ``request_overhead_s = 20 ms`` is the prefill of ``250`` tokens.

The ``production`` size keeps 9B's head dims (attention 256, GDN 128) and its 3:1
GDN:attention mix at 8 layers (6 GDN + 2 attention) with a quarter of its heads (1 KV head,
4 / 8 GDN key / value heads) at hidden size 256: ``b = 2 * 2 * 1 * 256 * 2 = 2,048``, a GDN row
``r' = 8*128*128*4 + 3*2048*2 = 536,576`` (= ``r / 4``), a snapshot ``6 r' = 3,219,456 B``, so
``N_s = 1,572`` exactly as for 9B, on any machine (every head count scaled by the same 1/4).

``R`` and the fixed-cost ratio depend on the machine. Measured on the 2-core CPU box (vLLM CPU,
``LLM`` class at its default budget, median of 3 fresh 2,048-token prompts after a warm-up,
load average ~8; CPU-tier copy rate ``B = 3.3 GB/s`` from ``benchmarks/live/results/live.md``):

=========================  ===========  ======  =============  ======================
model                      t per token  R       N_s            0.1 s fixed cost as
                                                               tokens of prefill
=========================  ===========  ======  =============  ======================
Qwen3.5-9B / H100 (yaml)   80 µs        122     1,572          250 (at its 20 ms)
tiny                       64 µs        417     268            1,560
production (this size)     278 µs       452     1,572          360
9B's full head counts      3,924 µs     1,593   1,572          25
=========================  ===========  ======  =============  ======================

On an AVX2-only CPU (``vllm._C_AVX2``, 2 cores, quiet, same method) prefill is ~25x slower
while memory is not: tiny 1,554 µs and production 6,851 µs per token, so ``R`` is ~10,000
and ~11,000 (``B = 3.3 GB/s``) and 0.1 s is 64 and 15 tokens of prefill. There a hit is
worth more and a fixed cost less than on an H100; ``N_s`` alone keeps its value.

NOTE 1 (why ``R = 122`` is out of reach on this CPU): ``R = (FLOP per token / b) * (B / F)``
for a compute rate ``F``. An H100 has ``B / F = 50e9 / 225e12``; this CPU ``3.3e9 / ~40e9``,
about 400x more bytes per FLOP, so a model would need ~400x fewer FLOP per KV byte than 9B's
18 GFLOP / 32 KiB; attention alone costs ~``L`` FLOP per KV byte at context ``L`` and a GDN
layer ~1 FLOP per state byte (``N_s`` of them per KV byte), so no geometry with 9B's ``N_s``
gets there. 9B's full head counts (row 4) move ``R`` the wrong way: GDN with 32 value heads is
slow on CPU. The production size matches what can be matched: ``N_s`` exactly, the fixed
cost within 1.5x (360 vs 250 tokens, against 6x for the tiny model), ``R`` within the tiny
model's (452 vs 417), at 0.57 s per 2K-token prompt, so a live run stays short.

NOTE 2 (a tokenizer for every id): the corpus trains 644 BPE tokens, the model has 2,048
logits. A random-weight model picks ids above 643 most of the time, which a 644-token
tokenizer decodes to nothing: an OpenAI client met empty answers. Ids 644..2047 are therefore
added tokens, each a pseudo-word of two syllables with a leading space (`` kabo``, in a
fixed order), matched only as a whole word (``single_word``), so ordinary text tokenizes as
before and generated text reads as words.

NOTE 3 (positions): ``max_position_embeddings`` is 8,192, so vLLM serves at most
``--max-model-len 8192``. For longer prompts pass ``--hf-overrides
'{"max_position_embeddings": 32768}'`` to ``vllm serve`` / ``histate serve`` (the rotary
tables are computed, not stored, so no weights change), or generate a model with
``ensure_tiny_model(max_position_embeddings=...)``.

CLI: ``python -m lmcache_histate.backends.demo.tiny_model [--seed N] [--size S] [--cache-dir D]``
prints the model's folder on stdout (generating it if needed) and, on stderr, what a client
needs: vocabulary and tokenizer size, positions, and a ``histate serve`` line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "CHAT_TEMPLATE",
    "MODEL_SIZES",
    "PRODUCTION_OVERRIDES",
    "TINY_CONFIG",
    "TOKENIZER_VOCAB",
    "ensure_tiny_model",
    "size_overrides",
    "tiny_config",
]

FORMAT_VERSION = 2
"""Bump when the generator changes in a way the config hash does not capture."""

TOKENIZER_VOCAB = 1024
"""Target BPE vocabulary (the corpus below is small: the real size comes out lower, 644 for
the tiny model); ``_fill_vocabulary`` then gives every id below ``vocab_size`` a token."""

# The geometry fields are those of the core preset "tiny-qwen3-next" (keep the two in sync; the
# test checks it). The rest is what vLLM 0.32 / transformers 5.19 need to build the model.
TINY_CONFIG: Mapping[str, Any] = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "torch_dtype": "bfloat16",
    "vocab_size": 2048,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
    # MoE: vLLM needs at least one MoE layer. decoder_sparse_step 1 + mlp_only_layers [0, 2]
    # makes layers 1 and 3 MoE (4 experts, top-2, with a shared expert).
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [0, 2],
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 8192,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
    },
    "partial_rotary_factor": 0.25,
    "rope_theta": 10000.0,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "use_cache": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

PRODUCTION_OVERRIDES: Mapping[str, Any] = {
    # Qwen3.5-9B's head dims and 3:1 GDN:attention mix at 8 layers, a quarter of its heads
    # (module docstring: N_s as 9B's, prefill cost per token ~4x the tiny model's).
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 8,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    # MoE only where vLLM needs one (layers 3 and 7); dense MLPs elsewhere.
    "mlp_only_layers": [0, 1, 2, 4, 5, 6],
}
"""``config.json`` fields the ``production`` size changes in :data:`TINY_CONFIG`."""

MODEL_SIZES: Mapping[str, Mapping[str, Any]] = {"tiny": {}, "production": PRODUCTION_OVERRIDES}
"""Model sizes by name: the overrides of :data:`TINY_CONFIG` each one applies."""


def size_overrides(size: str) -> dict[str, Any]:
    """The ``config.json`` overrides of the named size (a fresh dict); ValueError if unknown."""
    if size not in MODEL_SIZES:
        raise ValueError(f"unknown model size {size!r}; choose one of {', '.join(MODEL_SIZES)}")
    return json.loads(json.dumps(dict(MODEL_SIZES[size])))


SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>", "<|unk|>")
"""Ids 0..3 in this order (config: pad 0, bos 1, eos 2)."""

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- message['role'] + ': ' + message['content'] + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'assistant: ' -}}{%- endif -%}"
)
"""Jinja chat template written as ``chat_template.jinja`` (transformers' file name): one
``role: content`` line per message, then ``assistant: `` when a reply is wanted. Plain text,
no special tokens, so a rendered conversation is a prefix of the next turn's rendering (the
prefix cache sees a growing agent context as a growing token prefix)."""

# Weight scale. Larger than HF's 0.02 so the random model's next-token distributions are not
# nearly flat (logprob comparisons then have something to see).
WEIGHT_STD = 0.08

_CORPUS = """\
The cache keeps the attention keys and values of every token, but a recurrent layer keeps only
one state that is updated in place. A prefix can be resumed only where a snapshot of that state
was saved. Agents rewrite their context in the middle of a turn, so a match often ends inside a
turn where no snapshot exists. The scheduler decides which chunks to store and which to drop.
def store(chunk, state):
    if state is None:
        return False
    return write(chunk.key, state.bytes())
class Session:
    def __init__(self, turns):
        self.turns = list(turns)
    def append(self, text):
        self.turns.append(text)
Read the file, apply the patch, run the tests, and report what changed. If the tests fail,
show the traceback and the line that raised. The quick brown fox jumps over the lazy dog.
0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 32 64 128 256 384 512 1024 2048 4096
{"role": "user", "content": "list the files"} {"role": "assistant", "content": "ls -la"}
SELECT name, size FROM objects WHERE tier = 'disk' ORDER BY last_access DESC LIMIT 10;
"""


def tiny_config(**overrides: Any) -> dict[str, Any]:
    """The tiny model's ``config.json`` content (a fresh dict), with optional overrides."""
    config = json.loads(json.dumps(dict(TINY_CONFIG)))
    config.update(overrides)
    return config


def _content_key(config: Mapping[str, Any], seed: int) -> str:
    blob = json.dumps(
        {
            "config": config,
            "seed": seed,
            "v": FORMAT_VERSION,
            "vocab": TOKENIZER_VOCAB,
            "std": WEIGHT_STD,
            "corpus": hashlib.sha256(_CORPUS.encode()).hexdigest(),
            "chat_template": hashlib.sha256(CHAT_TEMPLATE.encode()).hexdigest(),
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def default_cache_dir() -> Path:
    """``$HISTATE_CACHE_DIR`` or ``~/.cache/lmcache-histate``."""
    env = os.environ.get("HISTATE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "lmcache-histate"


# ------------------------------------------------------------------------------- weights


def _weights(config: Mapping[str, Any], seed: int) -> dict[str, Any]:
    """Random tensors named as in the original Qwen3-Next checkpoints (what vLLM loads)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, str(config["torch_dtype"]))
    hidden = int(config["hidden_size"])
    vocab = int(config["vocab_size"])

    def normal(*shape: int, std: float = WEIGHT_STD) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    def uniform(lo: float, hi: float, *shape: int) -> torch.Tensor:
        return (lo + (hi - lo) * torch.rand(*shape, generator=gen)).to(dtype)

    # Qwen3-Next RMSNorms are zero-centred (output * (1 + w)); small noise keeps them non-trivial.
    def norm(n: int) -> torch.Tensor:
        return normal(n, std=0.05)

    nk, nv = int(config["linear_num_key_heads"]), int(config["linear_num_value_heads"])
    dk, dv = int(config["linear_key_head_dim"]), int(config["linear_value_head_dim"])
    kernel = int(config["linear_conv_kernel_dim"])
    heads, kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    head_dim = int(config["head_dim"])
    mlp_only = set(config.get("mlp_only_layers") or [])
    step = int(config.get("decoder_sparse_step", 1))
    experts = int(config.get("num_experts", 0))

    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(vocab, hidden, std=1.0)}
    for i, kind in enumerate(config["layer_types"]):
        p = f"model.layers.{i}."
        if kind == "linear_attention":
            conv_dim = 2 * nk * dk + nv * dv
            t[p + "linear_attn.dt_bias"] = uniform(0.5, 1.5, nv)
            t[p + "linear_attn.A_log"] = uniform(-1.0, 1.0, nv)
            t[p + "linear_attn.conv1d.weight"] = normal(conv_dim, 1, kernel, std=0.3)
            t[p + "linear_attn.in_proj_qkvz.weight"] = normal(2 * nk * dk + 2 * nv * dv, hidden)
            t[p + "linear_attn.in_proj_ba.weight"] = normal(2 * nv, hidden)
            t[p + "linear_attn.norm.weight"] = uniform(0.9, 1.1, dv)  # gated norm: plain scale
            t[p + "linear_attn.out_proj.weight"] = normal(hidden, nv * dv)
        else:
            # Qwen3-Next's q_proj carries a per-head output gate: 2 * heads * head_dim rows.
            t[p + "self_attn.q_proj.weight"] = normal(2 * heads * head_dim, hidden)
            t[p + "self_attn.k_proj.weight"] = normal(kv_heads * head_dim, hidden)
            t[p + "self_attn.v_proj.weight"] = normal(kv_heads * head_dim, hidden)
            t[p + "self_attn.o_proj.weight"] = normal(hidden, heads * head_dim)
            t[p + "self_attn.q_norm.weight"] = norm(head_dim)
            t[p + "self_attn.k_norm.weight"] = norm(head_dim)
        is_moe = i not in mlp_only and experts > 0 and (i + 1) % step == 0
        if is_moe:
            moe = int(config["moe_intermediate_size"])
            shared = int(config["shared_expert_intermediate_size"])
            t[p + "mlp.gate.weight"] = normal(experts, hidden)
            for e in range(experts):
                q = f"{p}mlp.experts.{e}."
                t[q + "gate_proj.weight"] = normal(moe, hidden)
                t[q + "up_proj.weight"] = normal(moe, hidden)
                t[q + "down_proj.weight"] = normal(hidden, moe)
            t[p + "mlp.shared_expert.gate_proj.weight"] = normal(shared, hidden)
            t[p + "mlp.shared_expert.up_proj.weight"] = normal(shared, hidden)
            t[p + "mlp.shared_expert.down_proj.weight"] = normal(hidden, shared)
            t[p + "mlp.shared_expert_gate.weight"] = normal(1, hidden)
        else:
            inter = int(config["intermediate_size"])
            t[p + "mlp.gate_proj.weight"] = normal(inter, hidden)
            t[p + "mlp.up_proj.weight"] = normal(inter, hidden)
            t[p + "mlp.down_proj.weight"] = normal(hidden, inter)
        t[p + "input_layernorm.weight"] = norm(hidden)
        t[p + "post_attention_layernorm.weight"] = norm(hidden)
    t["model.norm.weight"] = norm(hidden)
    t["lm_head.weight"] = normal(vocab, hidden, std=0.2)
    return t


# ----------------------------------------------------------------------------- tokenizer


def pseudo_words(count: int) -> list[str]:
    """``count`` distinct pseudo-words `` kabo``, `` kabe``, ... (consonant-vowel twice, a
    leading space), in a fixed order (NOTE 2)."""
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    words = [f" {a}{b}" for a in syllables for b in syllables]
    if count > len(words):
        raise ValueError(f"{count} pseudo-words asked, {len(words)} exist")
    return words[:count]


def _fill_vocabulary(tok: Any, vocab_size: int) -> None:
    """Add whole-word pseudo-words until the tokenizer has ``vocab_size`` tokens (NOTE 2)."""
    from tokenizers import AddedToken

    have = tok.get_vocab_size(with_added_tokens=True)
    words = pseudo_words(max(vocab_size - have, 0))
    taken = set(tok.get_vocab(with_added_tokens=True))
    tok.add_tokens([AddedToken(w, single_word=True, normalized=False) for w in words
                    if w not in taken])


def _train_tokenizer(out: Path, config: Mapping[str, Any]) -> None:
    """Byte-level BPE trained on the built-in corpus; ids 0..3 are the special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    vocab = min(TOKENIZER_VOCAB, int(config["vocab_size"]))
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Repeating the corpus does not change the merges but keeps pair counts above 1.
    tok.train_from_iterator([*_CORPUS.splitlines()] * 4, trainer=trainer)
    _fill_vocabulary(tok, int(config["vocab_size"]))
    tok.save(str(out / "tokenizer.json"))
    pad, bos, eos, unk = SPECIAL_TOKENS
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": pad,
        "unk_token": unk,
        "model_max_length": int(config["max_position_embeddings"]),
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    special = {"bos_token": bos, "eos_token": eos, "pad_token": pad, "unk_token": unk}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)


# ---------------------------------------------------------------------------------- build


def _build(out: Path, config: Mapping[str, Any], seed: int) -> None:
    from safetensors.torch import save_file

    (out / "config.json").write_text(json.dumps(dict(config), indent=2, sort_keys=True) + "\n")
    generation = {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"],
        "pad_token_id": config["pad_token_id"],
        "do_sample": False,
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    tensors = _weights(config, seed)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    _train_tokenizer(out, config)


_REQUIRED_FILES = ("model.safetensors", "tokenizer.json", "chat_template.jinja")
"""Files whose presence marks a complete model directory (written last: the tokenizer's)."""


def ensure_tiny_model(
    seed: int = 0,
    cache_dir: str | os.PathLike[str] | None = None,
    **config_overrides: Any,
) -> Path:
    """Return the directory of the tiny model for ``seed``, generating it if needed.

    Args:
        seed: Weight seed; the same seed always gives byte-identical weights.
        cache_dir: Parent directory (default :func:`default_cache_dir`).
        **config_overrides: ``config.json`` fields to change (part of the cache key).

    Returns:
        A directory vLLM and transformers can load (``config.json``, ``model.safetensors``,
        tokenizer files, chat template).
    """
    config = tiny_config(**config_overrides)
    parent = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = parent / f"tiny-qwen3-next-{_content_key(config, seed)}"
    if all((target / name).is_file() for name in _REQUIRED_FILES):
        return target
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=parent))
    try:
        _build(tmp, config, seed)
        tmp.chmod(0o755)
        for child in tmp.iterdir():
            child.chmod(0o644)
        try:
            os.replace(tmp, target)
        except OSError:
            # Another process won the race (target exists, non-empty): use theirs.
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", choices=list(MODEL_SIZES), default="tiny")
    parser.add_argument("--cache-dir", default=None, help="parent directory of the model dir")
    args = parser.parse_args(argv)
    import sys

    path = ensure_tiny_model(seed=args.seed, cache_dir=args.cache_dir,
                             **size_overrides(args.size))
    print(path)
    print(describe(path), file=sys.stderr)
    return 0


def describe(path: Path) -> str:
    """What a client of the model at ``path`` needs to know (CLI, stderr; NOTE 2-3)."""
    from tokenizers import Tokenizer

    config = json.loads((path / "config.json").read_text())
    tokens = Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab_size(
        with_added_tokens=True)
    positions = int(config["max_position_embeddings"])
    return (f"{config['architectures'][0]} with random weights: vocabulary "
            f"{config['vocab_size']:,}, tokenizer {tokens:,} tokens (chat template "
            f"included); positions {positions:,}: serve with --max-model-len <= {positions} "
            f"or raise it with --hf-overrides '{{\"max_position_embeddings\": 32768}}'.\n"
            f"serve it: histate serve {path} --served-model-name tiny "
            "(add the flags histate-server prints)")


if __name__ == "__main__":
    raise SystemExit(main())
