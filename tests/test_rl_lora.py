"""`tandem rl --model.lora.rank 8` end to end on CPU: the server builds the trainer's adapters from the shared
`[model.lora]`, every hand-off (shared, broadcast, file) moves the adapters only, the engine's logprobs equal the
trainer's (fp32, on policy) at every step, and the base never changes."""

from __future__ import annotations

import re

import pytest
from safetensors.torch import load_file

from support.jsonl import read_metrics
from support.reverse_text import held_out_rl, mixed_start
from support.runs import tandem_rl, two_on_policy_rl_steps, write_rl_sources
from tandem.models.lora import is_adapter_name

LORA = ["--model.lora.rank", "8", "--model.lora.alpha", "16", "--model.lora.target-modules", "q_proj", "v_proj", "down_proj"]  # fmt: skip
ADAPTERS = 2 * 2 * 3  # (A, B) x 2 layers x 3 targets (q_proj and v_proj both live in qkv_proj)


@pytest.mark.slow  # ~14 s a transport on 2 CPU cores; tests/inference/test_lora_engine.py covers each in-process
@pytest.mark.parametrize("transport", ["shared", "broadcast", "file"])
def test_rl_with_lora_hands_off_adapters_only_and_stays_on_policy(transport, tiny_model_dir, tmp_path):
    base = tiny_model_dir("qwen3")
    tandem_rl(
        base, tmp_path, "@", write_rl_sources(tmp_path), "--max-steps", "3", "--orchestrator.async-level", "0",
        "--orchestrator.no-filter-zero-advantage", "--trainer.weights.transport", transport, *LORA,
        "--trainer.optim.lr", "1e-2",
    )  # fmt: skip
    run = tmp_path / "rl"
    assert "[model.lora]\nrank = 8" in (run / "inference.toml").read_text()  # the server wraps as the trainer does
    metrics = read_metrics(run)
    assert [r["step"] for r in metrics] == [1, 2, 3]
    assert all(abs(r["mismatch_kl"]) < 1e-6 for r in metrics), [r["mismatch_kl"] for r in metrics]
    server_log = (run / "logs" / "inference.stderr.log").read_text()
    if transport == "file":
        assert "loaded" in server_log
    else:  # policies 1 and 2 in memory, each the adapters alone (the server refuses any other tensor)
        assert re.findall(r"received policy (\d) over the \w+: (\d+) tensors", server_log) == [
            ("1", str(ADAPTERS)),
            ("2", str(ADAPTERS)),
        ]
    final = run / "policies" / "step-000003"
    assert sorted(p.name for p in final.iterdir()) == ["COMPLETE", "adapter_config.json", "adapter_model.safetensors"]
    weights = load_file(final / "adapter_model.safetensors")
    assert len(weights) == ADAPTERS and all(is_adapter_name(k) for k in weights)
    assert any(t.abs().max() > 0 for k, t in weights.items() if "lora_B" in k)  # the adapters trained
    # no policy holds a base weight: the base never travels
    assert not any(run.glob("policies/*/model*.safetensors"))


def test_rl_with_lora_chooses_the_rewarded_answer(tmp_path):
    """`test_rl_learns.py::test_rl_chooses_the_rewarded_answer` with only rank-16 adapters training (lr 3e-3).
    Measured 0.497 -> 0.806 held-out greedy reward, in 76 s on 2 CPU cores (SFT included)."""
    lora = ["--model.lora.rank", "16", "--model.lora.alpha", "32", "--trainer.optim.lr", "3e-3"]
    held_out, run = held_out_rl(tmp_path, mixed_start(tmp_path), 40, *lora)
    print(f"LoRA: held-out greedy reward by eval: {held_out}")
    assert held_out[1] > held_out[0] + 0.1, held_out
    assert (run / "policies" / "step-000040" / "adapter_config.json").is_file()


@pytest.mark.slow  # ~20 s on 2 CPU cores; tests/inference/test_lora_engine.py serves expert adapters in-process
def test_rl_with_expert_adapters_hands_off_and_stays_on_policy(tiny_model_dir, tmp_path):
    """`--model.lora.experts` on a Qwen3-MoE: the expert adapters train, travel in the hand-off (shared) and are
    served folded into the engine's stacked expert weights, on policy at every step."""
    base = tiny_model_dir("qwen3_moe")
    experts = ["--model.lora.experts", "--trainer.optim.lr", "1e-2", "--trainer.weights.transport", "shared"]
    _, policy = two_on_policy_rl_steps(base, tmp_path, *LORA, *experts)
    run = tmp_path / "rl"
    assert all(abs(r["mismatch_kl"]) < 1e-6 for r in read_metrics(run)), read_metrics(run)
    expert_keys = [key for key in policy if ".mlp.experts." in key]
    assert len(expert_keys) == 2 * 2 * 2  # (A, B) x (gate_up_proj, down_proj) x 2 layers
    assert any(policy[key].abs().max() > 0 for key in expert_keys if "lora_B" in key)  # they trained
