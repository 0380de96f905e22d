"""What the model tests share: tiny transformers reference directories, and the checks every family goes through
(padded and packed logit parity, save -> transformers round trip, prefill + decode = full forward)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

from support.tolerance import K_REFERENCE, K_REORDERED, assert_close_scaled, ulps_apart
from tandem.models import KVCache, ModelRuntime, save_model
from tandem.models.layers import document_ids, document_mask
from tandem.testing.tiny import SPECIAL_TOKENS, write_tokenizer

TOL = 1e-4
"""A hand-set fp32 bound on the max abs logit difference vs transformers, for the checks not yet moved to
`support.tolerance.assert_close_scaled` (which sets bounds from the dtype and the values' magnitude)."""
HF_REFERENCE = {"dtype": torch.float32, "attn_implementation": "eager", "experts_implementation": "eager"}
"""The plain transformers implementations as the reference: eager attention and the per-expert loop (some
transformers versions default to a grouped_mm experts kernel that disagrees with their own loop on CPU)."""

DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 256,
    "hidden_size": 72,
    "intermediate_size": 88,
    "moe_intermediate_size": 24,
    "num_hidden_layers": 3,
    "num_attention_heads": 3,
    "num_key_value_heads": 3,
    "n_routed_experts": 8,
    "num_experts_per_tok": 3,
    "n_group": 2,
    "topk_group": 1,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "q_lora_rank": 28,
    "kv_lora_rank": 20,
    "qk_nope_head_dim": 12,
    "qk_rope_head_dim": 8,
    "v_head_dim": 10,
    "rope_interleave": True,
    "num_nextn_predict_layers": 1,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "torch_dtype": "float32",
}
"""A tiny DeepSeek-V3: odd sizes (hidden 72, 3 heads, q rank 28, latent rank 20, RoPE part 8), a dense first
layer, 8 experts in 2 groups of which 1 is kept, top-3, one shared expert."""

GLM4_MOE = {
    "architectures": ["Glm4MoeForCausalLM"],
    "model_type": "glm4_moe",
    "vocab_size": 256,
    "hidden_size": 72,
    "intermediate_size": 88,
    "moe_intermediate_size": 24,
    "num_hidden_layers": 3,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 12,
    "partial_rotary_factor": 0.5,
    "n_routed_experts": 8,
    "num_experts_per_tok": 3,
    "n_group": 2,
    "topk_group": 1,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "use_qk_norm": True,
    "attention_bias": True,
    "num_nextn_predict_layers": 1,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}
"""A tiny GLM-4.5: GQA 6/2 with q/k/v bias, qk-norm, RoPE on half of each 12-dim head; DeepSeek-V3's MoE."""


def write_hf_model(path: Path, config: dict[str, Any], seed: int = 0, perturb: tuple[str, ...] = ()) -> Path:
    """A transformers model from `config` (`torch.manual_seed(seed)`), saved to `path` with `config` as written.

    Biases and MoE correction biases, which transformers initialises to zero, are randomised so that parity
    covers them, and so is every tensor whose name ends with one of `perturb` (normal(0, 0.1) added: e.g.
    zero-initialised norm weights). The config is written back as given (the hub's spelling, not what
    `save_pretrained` writes).
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.float32)
        with torch.no_grad():
            for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
                if name.endswith(".bias"):
                    tensor.normal_(std=0.1)
                if name.endswith("e_score_correction_bias"):
                    tensor.uniform_(-0.1, 0.1)
                if perturb and name.endswith(perturb):
                    tensor.add_(torch.randn_like(tensor), alpha=0.1)
    model.save_pretrained(path)
    (Path(path) / "config.json").write_text(json.dumps(config, indent=2))
    return Path(path)


def write_servable_model(path: Path, config: dict[str, Any], seed: int = 0) -> Path:
    """`write_hf_model` with the tiny models' tokenizer beside it, the vocabulary sized to it and `<|im_end|>` as
    EOS: a directory the engine serves and `tandem rl` trains, as it does the tiny Qwen3."""
    vocab = write_tokenizer(path)
    special = {"bos_token_id": None, "eos_token_id": SPECIAL_TOKENS.index("<|im_end|>"), "pad_token_id": 0}
    return write_hf_model(path, {**config, "vocab_size": vocab, **special}, seed)


def hf_load(path: Path, **kw: Any) -> torch.nn.Module:
    """The transformers reference for `path`, asserting that every checkpoint key loaded and none was left over."""
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, **{**HF_REFERENCE, **kw})
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


def hf_greedy(hf: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of `prompt`: `max_new_tokens` tokens (fewer if it stops at EOS)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()


def disk_tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 (safe_open is not a dict)
    return out


def hf_packed_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """The 4D additive mask transformers needs to keep packed documents apart (position restarts alone do not)."""
    allowed = document_mask(document_ids(position_ids))
    return torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)


def packed(lengths: list[int], vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (sum(lengths),), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])
    return ids, pos


def assert_padded_parity(model: torch.nn.Module, hf: torch.nn.Module, label: str) -> None:
    """Right- and left-padded rows match transformers on real tokens; an unpadded row equals the causal path."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.args.vocab_size, (3, 11), generator=g)
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[1, 7:] = 0  # right padding
    mask[2, :4] = 0  # left padding
    with torch.no_grad():
        ours = model(ids, mask=mask)
        ref = hf(ids, attention_mask=mask).logits
        unmasked = model(ids)
    assert_close_scaled(ours[mask.bool()], ref[mask.bool()], K_REFERENCE, msg=f"{label}: padded batch")
    assert_close_scaled(ours[0], unmasked[0], K_REORDERED, msg=f"{label}: unpadded row vs causal")
    assert ours.abs().max() > 0.5, "logits too small for the comparison to mean anything"


PACKED_ROWS = ([5, 8, 3], [9, 7])


def assert_packed_parity(model: torch.nn.Module, hf: torch.nn.Module, label: str) -> None:
    """Packed documents (positions restart) match transformers with a document mask, and each document alone."""
    rows = [packed(lengths, model.args.vocab_size, seed=r + 1) for r, lengths in enumerate(PACKED_ROWS)]
    ids, pos = torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
    with torch.no_grad():
        ours = model(ids, pos)
        ref = hf(ids, position_ids=pos, attention_mask=hf_packed_mask(pos)).logits
        leaky = hf(ids, position_ids=pos).logits
    assert_close_scaled(ours, ref, K_REFERENCE, msg=f"{label}: packed")
    # The reference must be sensitive: without document isolation the logits are very different.
    assert ulps_apart(leaky, ref) > 100 * K_REFERENCE
    with torch.no_grad():
        for r, lengths in enumerate(PACKED_ROWS):
            start = 0
            for n in lengths:
                alone = model(ids[r : r + 1, start : start + n])[0]
                assert_close_scaled(ours[r, start : start + n], alone, K_REORDERED, msg=f"{label}: document alone")
                start += n


def assert_round_trips_through_transformers(model: torch.nn.Module, src: Path, out: Path) -> None:
    """`save_model` writes `src`'s keys and values unchanged, and transformers loads it to the same logits."""
    save_model(model, out)
    original, saved = disk_tensors(src), disk_tensors(out)
    assert sorted(saved) == sorted(original)
    for key, tensor in original.items():
        assert saved[key].dtype == tensor.dtype and torch.equal(saved[key], tensor), key
    ids = torch.randint(3, model.args.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_close_scaled(model(ids), hf_load(out)(ids).logits, K_REFERENCE, msg="saved model vs transformers")


PROMPTS = (5, 9, 3)
DECODE_STEPS = 4


def paged_tables(num_seqs: int, blocks_per_seq: int) -> list[list[int]]:
    """Interleaved, non-contiguous block ids, so a wrong table lookup reads another sequence's keys."""
    ids = torch.randperm(num_seqs * blocks_per_seq, generator=torch.Generator().manual_seed(1)).tolist()
    return [ids[i::num_seqs] for i in range(num_seqs)]


def cache_sequences(vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (n + DECODE_STEPS,), generator=g) for n in PROMPTS]


def assert_cache_matches_forward(model: torch.nn.Module, layout: str) -> None:
    """Prefill three prompts packed, then decode token by token: logits equal the full forward's, for a paged
    cache (interleaved blocks of 4) or a slot cache (one region per sequence)."""
    seqs = cache_sequences(model.args.vocab_size)
    if layout == "paged":
        cache, tables = KVCache.for_model(model.args, num_blocks=3 * 4, block_size=4), paged_tables(3, 4)
    else:
        cache, tables = KVCache.for_model(model.args, num_blocks=3, block_size=max(map(len, seqs))), [[2], [0], [1]]
    with torch.no_grad():
        full = [model(s[None])[0] for s in seqs]
        batch = cache.batch(list(PROMPTS), [0, 0, 0], tables)
        logits = model.prefill(torch.cat([s[:n] for s, n in zip(seqs, PROMPTS, strict=True)]), cache, batch)
        for i, n in enumerate(PROMPTS):
            assert_close_scaled(logits[i], full[i][n - 1], K_REORDERED, msg=f"{layout} prefill")
        for step in range(DECODE_STEPS):
            lens = [n + step for n in PROMPTS]
            batch = cache.batch([1, 1, 1], lens, tables)
            logits = model.decode(torch.stack([s[n] for s, n in zip(seqs, lens, strict=True)]), cache, batch)
            for i, n in enumerate(lens):
                assert_close_scaled(logits[i], full[i][n], K_REORDERED, msg=f"{layout} decode step {step}")


def assert_backends_agree(load: Any, ids: torch.Tensor) -> None:
    """`load(runtime=ModelRuntime(moe_backend=...))` models with the loop, grouped_mm and per-layer mixed backends: same logits and
    gradients (every parameter that gets one)."""
    results = []
    for backend in ("loop", "grouped_mm", ["grouped_mm"] * (len(load().layers) - 1) + ["loop"]):
        model = load(runtime=ModelRuntime(moe_backend=backend))
        logits = model(ids)
        logits.logsumexp(-1).sum().backward()
        results.append((logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
    for logits, grads in results[1:]:
        assert_close_scaled(logits, results[0][0], K_REORDERED, msg="logits")
        for name, grad in results[0][1].items():
            if grad is None:
                assert grads[name] is None, name
                continue
            assert_close_scaled(grads[name], grad, K_REORDERED, msg=name)
