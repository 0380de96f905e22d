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


def test_chat_template_renders_tool_calls_that_parse_back(tiny_model_dir):
    """An assistant's `tool_calls` (OpenAI's string arguments or an object) render as the Hermes blocks the
    model would write, so the rendered conversation parses back to the same calls."""
    from transformers import AutoTokenizer

    from tandem.envs.tool_parsers import parser_for
    from tandem.envs.tools import ToolCall

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir("qwen3"))
    hermes = parser_for("hermes")
    first = [ToolCall("add", {"a": 2, "b": 3})]
    second = [ToolCall("add", {"a": 5, "b": -1}), ToolCall("note", {"text": 'ünïcode "quoted"'})]
    messages = [
        {"role": "user", "content": "what is 2 + 3 - 1?"},
        {"role": "assistant", "content": None, "tool_calls": [call.to_openai() for call in first]},
        {"role": "tool", "tool_call_id": first[0].id, "content": "5"},
        {
            "role": "assistant",
            "content": "Now subtract.",
            "tool_calls": [
                {"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in second
            ],
        },
        {"role": "tool", "content": "4"},
        {"role": "assistant", "content": "4"},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    turns = [turn.split("\n", 1) for turn in rendered.split("<|im_start|>")[1:]]
    assert [role for role, _ in turns] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    bodies = [body.removesuffix("<|im_end|>\n") for _, body in turns]
    assert bodies[1] == hermes.render(first) and bodies[3] == hermes.render(second, "Now subtract.")
    for body, calls, content in ((bodies[1], first, ""), (bodies[3], second, "Now subtract."), (bodies[5], [], "4")):
        parsed = hermes.parse(body)
        assert not parsed.errors and parsed.content == content
        assert [(c.name, c.arguments) for c in parsed.calls] == [(c.name, c.arguments) for c in calls]


def test_same_seed_same_weights(tmp_path):
    from safetensors.torch import load_file

    from tandem.testing import write_tiny_model

    a = load_file(write_tiny_model(tmp_path / "a", "llama", seed=3) / "model.safetensors")
    b = load_file(write_tiny_model(tmp_path / "b", "llama", seed=3) / "model.safetensors")
    c = load_file(write_tiny_model(tmp_path / "c", "llama", seed=4) / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
