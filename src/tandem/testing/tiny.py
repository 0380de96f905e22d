"""Build tiny Hugging Face model directories (tokenizer + config + random weights)."""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path
from typing import Any, Literal

import torch

TinyArchitecture = Literal["qwen3", "llama", "qwen3_moe"]
"""The families a tiny test model can be built as (the names here, not HF's `tandem.models.ARCHITECTURES`)."""
TINY_ARCHITECTURES: tuple[TinyArchitecture, ...] = ("qwen3", "llama", "qwen3_moe")

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN3_MARKERS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")
"""The special tokens `renderers`' Qwen3 renderer looks up: a tiny model whose tokenizer has them
(`write_tiny_model(path, "qwen3", extra_special=QWEN3_MARKERS)`) renders, parses and bridges turns as Qwen3
does."""

# ChatML, the format Qwen models use; rendered by `apply_chat_template`. Tools, when given, go first in a system
# turn that asks for Hermes-style calls, and an assistant's `tool_calls` follow its content as the <tool_call>
# blocks `HermesParser.render` writes, as Qwen3's template renders them (OpenAI's string arguments as they are,
# an object as JSON), so a rendered conversation parses back to the calls it holds.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nCall a tool as <tool_call>"
    '{"name": ..., "arguments": {...}}</tool_call>. Tools:\n'
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% set content = message.content if message.content is defined and message.content is not none else '' %}"
    "<|im_start|>{{ message.role }}\n{{ content }}"
    "{% for call in message.tool_calls or [] %}"
    "{% set call = call.function if call.function is defined else call %}"
    "{% if content or not loop.first %}{{ '\\n' }}{% endif %}"
    '<tool_call>\n{"name": {{ call.name | tojson }}, "arguments": '
    "{% if call.arguments is string %}{{ call.arguments }}{% else %}{{ call.arguments | tojson }}{% endif %}"
    "}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_WORDS = (
    "the quick brown fox jumps over a lazy dog while seven bright stars shine on "
    "calm water and every small model learns to reverse text add numbers answer "
    "questions think step by step system user assistant hello world please what "
    "is reward policy token train sample batch loss value"
).split()


def _corpus(seed: int = 0, n_lines: int = 2000) -> list[str]:
    """A synthetic corpus covering words, reversed words, digits and punctuation."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        words = rng.choices(_WORDS, k=rng.randint(3, 10))
        text = " ".join(words)
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        lines.append(f"{text.capitalize()}. {text[::-1]}! {a} + {b} = {a + b}? (x, y): #### {a * b}")
    return lines


@functools.lru_cache(maxsize=4)
def _trained_tokenizer_json(vocab_size: int, corpus: tuple[str, ...] | None, extra_special: tuple[str, ...]) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[*SPECIAL_TOKENS, *extra_special],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus or _corpus(), trainer)
    return tokenizer.to_str()


def build_tokenizer(vocab_size: int = 512, corpus: tuple[str, ...] | None = None, extra_special: tuple[str, ...] = ()):
    """A byte-level BPE `tokenizers.Tokenizer` trained in-process on `corpus` (default: a synthetic one), with
    `SPECIAL_TOKENS` and `extra_special` (a real model's markers, for code that looks them up) as special tokens."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_trained_tokenizer_json(vocab_size, corpus, extra_special))


def write_tokenizer(
    path: str | Path,
    vocab_size: int = 512,
    corpus: tuple[str, ...] | None = None,
    extra_special: tuple[str, ...] = (),
) -> int:
    """Write `tokenizer.json` and `tokenizer_config.json` (with a chat template); return the vocab size."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab_size, corpus, extra_special)
    tokenizer.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 2048,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return tokenizer.get_vocab_size()


def tiny_config(arch: TinyArchitecture = "qwen3", vocab_size: int = 512, **overrides: Any) -> dict[str, Any]:
    """A `config.json` dict for a 2-layer, hidden-64 model with GQA (4 query heads, 2 KV heads)."""
    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "eos_token_id": SPECIAL_TOKENS.index("<|im_end|>"),
        "pad_token_id": SPECIAL_TOKENS.index("<|endoftext|>"),
        "torch_dtype": "float32",
    }
    if arch == "qwen3":
        config = {**common, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "tie_word_embeddings": True}
    elif arch == "llama":
        config = {
            **common,
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "tie_word_embeddings": False,
            "mlp_bias": False,
        }
    elif arch == "qwen3_moe":
        config = {
            **common,
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "tie_word_embeddings": False,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "router_aux_loss_coef": 0.001,
            "output_router_logits": False,
        }
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}; expected one of {TINY_ARCHITECTURES}")
    config.update(overrides)
    return config


def write_tiny_model(
    path: str | Path,
    arch: TinyArchitecture = "qwen3",
    seed: int = 0,
    vocab_size: int = 512,
    extra_special: tuple[str, ...] = (),
    **config_overrides: Any,
) -> Path:
    """Write a complete HF model directory (tokenizer, config, random safetensors weights) and return it;
    `extra_special` adds special tokens to the tokenizer (`build_tokenizer`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    actual_vocab = write_tokenizer(path, vocab_size, extra_special=extra_special)
    config_dict = tiny_config(arch, vocab_size=actual_vocab, **config_overrides)
    config = AutoConfig.for_model(**config_dict)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    # Keep config.json in the hub's spelling (`num_experts`, `rope_theta`, `torch_dtype`), which real
    # checkpoints use, rather than the newer keys `save_pretrained` writes.
    (path / "config.json").write_text(json.dumps(config_dict, indent=2))
    return path
