"""The engine serving hybrid models on the Triton kernels (`inference.recurrent_kernels = "triton"`): prompts split
over prefill steps continue from the cached states through Gated DeltaNet's Triton pass over chunks and Mamba-2's
Triton within-chunk part, each decode step advances the states in their slots with the step kernels, and the
engine still samples what the trainer scores and transformers' greedy tokens (fp32).

On CPU the kernels run under Triton's interpreter; on CUDA compiled.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernel is defined, so before the import
pytest.importorskip("triton", reason="the Triton kernels need the triton package (CPU wheels of torch lack it)")

from transformers import AutoTokenizer

from support.hybrid_models import NEMOTRON_H_MOE, QWEN3_NEXT, write_servable_hybrid
from support.inference import assert_on_policy, engine_config, random_prompts, trainer_logprobs
from support.model_parity import hf_greedy, hf_load
from tandem.config import ConfigError
from tandem.inference.engine import Engine
from tandem.inference.main import eos_token_ids, load_served_model
from tandem.models import load_model
from tandem.models.layers.gated_deltanet import GatedDeltaNet
from tandem.models.layers.mamba2 import Mamba2
from tandem.wire.protocol import SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h_moe"])
def test_triton_kernels_give_transformers_greedy_tokens_and_the_trainers_logprobs(family, tmp_path):
    """Greedy tokens equal transformers'; sampled tokens' logprobs equal the trainer's torch-path scoring (mismatch
    KL < 1e-6): the first token of each sample is drawn from the prefill's last logits, the others from decode
    steps."""
    path = write_servable_hybrid(tmp_path, {"qwen3_next": QWEN3_NEXT, "nemotron_h_moe": NEMOTRON_H_MOE}[family])
    config = engine_config(path, device=DEVICE, recurrent_kernels="triton", max_prefill_tokens=16, kv_cache_blocks=64)
    model = load_served_model(config, path, torch.device(DEVICE), lora=None)
    mixers = [m for m in model.modules() if isinstance(m, GatedDeltaNet | Mamba2)]
    assert mixers and all(getattr(m, "scan", None) == "triton" or getattr(m, "ssd", None) == "triton" for m in mixers)
    tokenizer = AutoTokenizer.from_pretrained(path)
    engine = Engine(model, config, tokenizer=tokenizer, eos_token_ids=eos_token_ids(path, tokenizer)).start()
    prompts = random_prompts(3, engine.vocab_size, (20, 45), seed=3)  # two or three prefill steps each
    try:
        greedy = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=12))
        sampled = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=8, seed=0, ignore_eos=True))
    finally:
        engine.stop()
    hf = hf_load(path)
    for prompt, (sample,) in zip(prompts, greedy, strict=True):
        assert sample.token_ids == hf_greedy(hf, prompt, 12)
    trainer = load_model(path, dtype=torch.float32).eval()
    diffs = [
        trainer_logprobs(trainer, prompt, sample.token_ids) - torch.tensor(sample.logprobs).double()
        for prompt, (sample,) in zip(prompts, sampled, strict=True)
    ]
    assert_on_policy(diffs)


def test_triton_kernels_without_a_gpu_are_a_config_error(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    path = write_servable_hybrid(tmp_path)
    config = engine_config(path, device="cpu", recurrent_kernels="triton")
    with pytest.raises(ConfigError, match=r"inference.recurrent_kernels = triton: Triton kernels need CUDA"):
        load_served_model(config, path, torch.device("cpu"), lora=None)
