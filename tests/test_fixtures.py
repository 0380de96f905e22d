"""The tiny offline fixtures load in `transformers`; the tokenizer round-trips and renders chat."""

from __future__ import annotations

import json

import pytest
import torch

from tandem.testing import SPECIAL_TOKENS, TINY_ARCHITECTURES


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_tiny_model_loads_in_transformers(tiny_model_dir, arch):
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir(arch)
    config = json.loads((path / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and config["hidden_size"] == 64
    assert config["num_key_value_heads"] < config["num_attention_heads"]  # GQA
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert type(model).__name__ == config["architectures"][0]
    logits = model(torch.tensor([[1, 5, 9, 12]])).logits
    assert logits.shape == (1, 4, config["vocab_size"])
    assert torch.isfinite(logits).all()
    if arch == "qwen3_moe":
        assert config["num_experts"] > config["num_experts_per_tok"] > 1


def test_tied_and_untied_embeddings(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    qwen = AutoModelForCausalLM.from_pretrained(tiny_model_dir("qwen3"))
    llama = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"))
    assert qwen.lm_head.weight.data_ptr() == qwen.model.embed_tokens.weight.data_ptr()
    assert llama.lm_head.weight.data_ptr() != llama.model.embed_tokens.weight.data_ptr()


def test_tokenizer_round_trips_and_renders_chat(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir("qwen3"))
    assert 200 <= len(tokenizer) <= 1024
    for text in ["Reverse this: hello world", "12 + 7 = 19. #### 19", "ünïcode and emoji 🙂 too"]:
        assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "olleh"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nolleh<|im_end|>\n"
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    ids = tokenizer(rendered)["input_ids"]
    for special in SPECIAL_TOKENS[1:]:
        assert tokenizer.convert_tokens_to_ids(special) in ids  # special tokens are single ids
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"


def test_same_seed_same_weights(tmp_path):
    from safetensors.torch import load_file

    from tandem.testing import write_tiny_model

    a = load_file(write_tiny_model(tmp_path / "a", "llama", seed=3) / "model.safetensors")
    b = load_file(write_tiny_model(tmp_path / "b", "llama", seed=3) / "model.safetensors")
    c = load_file(write_tiny_model(tmp_path / "c", "llama", seed=4) / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
