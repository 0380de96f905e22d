"""Routed experts (`inference.return_routed_experts`): every position's experts as the engine's router chose them
equal transformers' router's top-k over the same tokens, through chunked prefill, forked samples and batched
decode (under CUDA graphs on a GPU), and come back on the token route in the shape verifiers reads."""

from __future__ import annotations

import asyncio
import base64

import pytest
import torch

from support.inference import engine_config
from tandem.config import ConfigError
from tandem.inference.engine import Engine
from tandem.models import load_model
from tandem.wire.protocol import RoutedExperts, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [30, 31, 32], [40] * 20]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


def _rows(routed: RoutedExperts) -> torch.Tensor:
    dtype = torch.uint8 if routed.dtype == "uint8" else torch.int16
    flat = torch.frombuffer(bytearray(base64.b64decode(routed.data)), dtype=dtype)
    return flat.view(*routed.shape).long()


def _hf_routing(model_dir, tokens: list[int]) -> torch.Tensor:
    """transformers' router choice at every position of `tokens`, `[T, layers, k]`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    top_k = model.config.num_experts_per_tok
    with torch.no_grad():
        out = model(torch.tensor([tokens]), output_router_logits=True)
    return torch.stack([logits.topk(top_k, dim=-1).indices for logits in out.router_logits], dim=1)


@pytest.mark.parametrize("device", DEVICES)
def test_routing_matches_transformers_router(device, make_engine, model_dir, caplog):
    path = model_dir("qwen3_moe")
    # Prefill chunks of 8 tokens split the long prompts; n = 2 forks the second sample off the first's prompt.
    engine = make_engine("qwen3_moe", device=device, return_routed_experts=True, max_prefill_tokens=8)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=9, ignore_eos=True)
    results = engine.generate(PROMPTS, params, n=2)
    assert "engine step failed" not in caplog.text  # a failed step would be recomputed and hide the fault
    for prompt, samples in zip(PROMPTS, results, strict=True):
        for sample in samples:
            routed = sample.routed_experts
            assert routed is not None and routed.start == 0 and routed.dtype == "uint8"
            tokens = prompt + sample.token_ids
            want = _hf_routing(path, tokens[:-1])  # the last token never ran through the model
            assert routed.shape == tuple(want.shape) == (len(tokens) - 1, 2, 2)
            assert torch.equal(_rows(routed), want)


def test_token_route_returns_routing_from_the_asked_position(make_engine, serve, tokenizer):
    """`renderers.client.generate` (verifiers' train client) gets `routed_experts` from
    `routed_experts_prompt_start` on, the rows the whole sequence's routing holds there."""
    renderers = pytest.importorskip("renderers")
    from openai import AsyncOpenAI
    from renderers.client import generate

    server = serve(make_engine("qwen3_moe", return_routed_experts=True))
    renderer = renderers.create_renderer(tokenizer, renderers.DefaultRendererConfig())
    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    sampling = {"temperature": 0, "max_tokens": 4, "ignore_eos": True}

    async def ask(**extra) -> dict:
        messages = [{"role": "user", "content": "two plus two"}]
        return await generate(
            client=client, renderer=renderer, messages=messages, model="tiny", sampling_params=sampling | extra
        )

    async def both() -> list[dict]:  # one event loop: the client's connections belong to it
        return [await ask(), await ask(routed_experts_prompt_start=3)]

    def routed(result: dict) -> RoutedExperts:
        wire = result["routed_experts"]
        return RoutedExperts.model_validate({**wire, "data": bytes(wire["data"]).decode()})

    whole, tail = asyncio.run(both())
    assert whole["completion_ids"] == tail["completion_ids"]
    full, part = routed(whole), routed(tail)
    assert full.start == 0 and full.shape[0] == len(whole["prompt_ids"]) + len(whole["completion_ids"]) - 1
    assert part.start == 3 and part.shape == (full.shape[0] - 3, *full.shape[1:])
    assert torch.equal(_rows(part), _rows(full)[3:])


def test_dense_model_refuses_the_option(model_dir):
    path = model_dir("qwen3")
    config = engine_config(path, device="cpu", return_routed_experts=True)
    model = load_model(path, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="not a mixture of experts"):
        Engine(model, config, tokenizer=None, eos_token_ids=[0])


def test_vllm_engine_refuses_the_option(model_dir):
    with pytest.raises((ConfigError, ValueError), match="return_routed_experts is the built-in engine's"):
        engine_config(model_dir("qwen3_moe"), engine="vllm", return_routed_experts=True)
