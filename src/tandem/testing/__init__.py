"""Tiny, offline model and tokenizer fixtures shared by every test and benchmark.

Nothing here touches the network: the tokenizer is trained in-process with
`tokenizers`, and model weights are random, written as a complete Hugging Face
directory that `transformers.AutoModelForCausalLM.from_pretrained` loads.
"""

from tandem.testing.tiny import (
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    TINY_ARCHITECTURES,
    build_tokenizer,
    tiny_config,
    write_tiny_model,
    write_tokenizer,
)

__all__ = [
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "TINY_ARCHITECTURES",
    "build_tokenizer",
    "tiny_config",
    "write_tiny_model",
    "write_tokenizer",
]
