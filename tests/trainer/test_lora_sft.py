"""`tandem sft --model.lora.rank R` end to end on CPU: only adapters train and are checkpointed, hf/final is a PEFT
adapter that PEFT loads, `tandem merge-lora` writes a checkpoint transformers loads, resume continues exactly."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from support.jsonl import read_metrics
from support.runs import run_tandem, sft_flags, tandem_sft
from support.tiny_models import INIT_STD

LORA = ["--model.lora.rank", "8", "--model.lora.alpha", "16"]
IDS = torch.tensor([[5, 17, 33, 2, 9, 41, 7, 100]])


def _keys(file) -> list[str]:
    with safe_open(str(file), "pt") as handle:
        return list(handle.keys())


def test_lora_sft_trains_adapters_only_and_exports_a_peft_adapter(tiny_model_dir, reverse_text_jsonl, tmp_path):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_dir("qwen3", initializer_range=INIT_STD)
    tandem_sft(*sft_flags(model_dir, reverse_text_jsonl, tmp_path, "lora"), "--max-steps", "6", *LORA)
    run = tmp_path / "lora"
    losses = [m["loss"] for m in read_metrics(run)]
    assert sum(losses[-2:]) < sum(losses[:2])

    # the training checkpoint holds the adapters and their AdamW moments, nothing of the frozen base
    checkpoint = run / "checkpoints" / "step-000006"
    weights = _keys(checkpoint / "model-00000-of-00001.safetensors")
    assert len(weights) == 2 * 7 * 2 and all(".lora_A." in k or ".lora_B." in k for k in weights)
    moments = _keys(checkpoint / "optimizer-00000-of-00001.safetensors")
    assert {k.rsplit("::", 1)[0] for k in moments} == set(weights)

    # hf/final is the PEFT adapter directory: PEFT loads it on the untouched base
    final = run / "hf" / "final"
    assert sorted(p.name for p in final.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((final / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (8, 16, str(model_dir))
    load = {"dtype": torch.float32, "attn_implementation": "eager"}
    adapted = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, **load), final).eval()
    base = AutoModelForCausalLM.from_pretrained(model_dir, **load).eval()
    with torch.no_grad():
        expected = adapted(IDS).logits
        assert (expected - base(IDS).logits).abs().max() > 1e-3  # training moved the adapters

    # merge-lora: a full checkpoint transformers loads, equal to base + adapter
    run_tandem("merge-lora", "--adapter", str(final), "--out", str(tmp_path / "merged"))  # base from the adapter
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", **load).eval()
    with torch.no_grad():
        assert (merged(IDS).logits - expected).abs().max() < 1e-4
    refused = run_tandem("merge-lora", "--adapter", str(final), "--out", str(tmp_path / "merged"), check=False)
    assert refused.returncode == 2 and "--overwrite" in refused.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    ("arch", "extra"),
    [("llama", ["--model.lora.dropout", "0.1"]), ("qwen3_moe", ["--model.lora.experts"])],
    ids=["dropout", "moe-experts"],
)
def test_lora_resume_on_two_ranks_continues_exactly(arch, extra, tiny_model_dir, reverse_text_jsonl, tmp_path):
    """FSDP2 over 2 gloo ranks with bf16 frozen base weights and fp32 adapters, with dropout on (the RNG is
    restored) or with adapters on the routed experts: resuming from step 2 repeats steps 3..6 exactly."""
    model_dir = tiny_model_dir(arch, initializer_range=INIT_STD)
    flags = [
        *sft_flags(model_dir, reverse_text_jsonl, tmp_path, "run"), "--model.dtype", "bfloat16", "--max-steps", "6",
        "--ckpt.interval", "2", "--ckpt.keep", "5", "--deploy.nproc", "2", *LORA, *extra,
    ]  # fmt: skip
    tandem_sft(*flags)
    straight = [m["loss"] for m in read_metrics(tmp_path / "run")]
    adapter = tmp_path / "run" / "hf" / "final" / "adapter_model.safetensors"
    with safe_open(str(adapter), "pt") as handle:
        before = {k: handle.get_tensor(k) for k in handle.keys()}  # noqa: SIM118
    assert any(".mlp.experts." in key for key in before) == ("--model.lora.experts" in extra)
    tandem_sft(*flags, "--resume.step", "2")
    resumed = read_metrics(tmp_path / "run")
    assert [m["step"] for m in resumed] == list(range(1, 7))
    assert [m["loss"] for m in resumed] == pytest.approx(straight, rel=1e-6)
    with safe_open(str(adapter), "pt") as handle:
        for key, tensor in before.items():
            torch.testing.assert_close(handle.get_tensor(key), tensor, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_lora_with_activation_checkpointing_and_compile_trains_the_same(tiny_model_dir, reverse_text_jsonl, tmp_path):
    model_dir = tiny_model_dir("qwen3", initializer_range=INIT_STD)
    variants = {"plain": [], "full_ac": ["--activation-checkpointing", "full"], "compiled": ["--compile"]}
    losses = {}
    for name, extra in variants.items():
        tandem_sft(*sft_flags(model_dir, reverse_text_jsonl, tmp_path, name), "--max-steps", "2", *LORA, *extra)
        losses[name] = [m["loss"] for m in read_metrics(tmp_path / name)]
    for name, values in losses.items():
        assert values == pytest.approx(losses["plain"], rel=1e-5), name


def test_lora_config_mistakes_are_config_errors(tiny_model_dir, reverse_text_jsonl, tmp_path):
    flags = sft_flags(tiny_model_dir("qwen3"), reverse_text_jsonl, tmp_path, "bad")
    result = tandem_sft(*flags, "--model.lora.rank", "4", "--model.lora.target-modules", "q_proj", "qkv", check=False)
    assert result.returncode == 2 and "valid: q_proj, k_proj" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "bad").exists()  # refused before the run directory or the model exists
    result = tandem_sft(
        *flags, "--model.lora.rank", "4", "--model.lora.experts", "--model.lora.dropout", "0.1", check=False
    )
    assert result.returncode == 2 and "set dropout = 0 with experts = true" in result.stderr
    result = tandem_sft(*flags, "--model.lora.rank", "4", "--model.lora.experts", check=False)  # a dense model
    assert result.returncode == 2 and "needs an MoE model" in result.stderr and "Traceback" not in result.stderr
