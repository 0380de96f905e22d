"""A conversation that outgrows the model's context ends as `truncated` and is scored (`tandem.envs.ContextFull`),
not as an `error` that drops the longest rollouts out of the mean: the server's 400 for it is recognised, in the
words of tandem's own server (the real one, on a tiny model) and of vLLM (both of its error body shapes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from support.inference import ServerThread, engine_config
from tandem.cli import main
from tandem.eval.traces import read_traces
from tandem.inference.engine import Engine
from tandem.inference.main import eos_token_ids
from tandem.models import load_model


def eval_guess_number(tmp_path: Path, url: str, *argv: str) -> list[dict]:
    code = main([
        "eval", "guess_number", "--env.args", "{num_tasks = 2}", "--env.max-turns", "40",
        "--base-url", f"{url}/v1", "--output-dir", str(tmp_path), "--run-name", "run", *argv,
    ])  # fmt: skip
    assert code == 0
    return read_traces(tmp_path / "run" / "traces.jsonl")


def vllm_refusal(context: int, new_shape: bool):
    """A fake vLLM: it refuses a request once its words plus `max_tokens` pass `context`, as vLLM words it."""

    def refuse(body: dict) -> tuple[int, dict] | None:
        prompt = sum(len(str(m["content"]).split()) for m in body["messages"])
        if prompt + body["max_tokens"] <= context:
            return None
        message = (
            f"This model's maximum context length is {context} tokens. However, you requested {body['max_tokens']} "
            f"output tokens and your prompt contains at least {prompt} input tokens, for a total of at least "
            f"{prompt + body['max_tokens']} tokens. Please reduce the length of the input prompt or the number of "
            f"requested output tokens. (parameter=input_tokens, value={prompt})"
        )
        if new_shape:
            return 400, {"error": {"message": message, "type": "BadRequestError", "param": "input_tokens", "code": 400}}
        return 400, {"object": "error", "message": message, "type": "BadRequestError", "param": None, "code": 400}

    return refuse


@pytest.mark.parametrize("new_shape", [True, False], ids=["error-object", "top-level-message"])
def test_a_vllm_context_refusal_ends_the_conversation_as_truncated(tmp_path, fake_server, new_shape):
    fake_server.answer = lambda messages: "50"  # never right for long: the game goes on until the context is full
    fake_server.refuse = vllm_refusal(context=60, new_shape=new_shape)
    records = eval_guess_number(tmp_path, fake_server.url, "--env.sampling.max-tokens", "4")
    assert [r["outcome"] for r in records] == ["truncated", "truncated"]
    assert all(r["error"] is None and r["turns"] > 1 for r in records)
    assert all(r["completion"][-1]["role"] == "user" for r in records)  # ended where the next reply would not fit
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())["sources"]["guess_number"]
    assert summary["outcomes"]["truncated"] == 2 and summary["outcomes"]["error"] == 0


def test_other_400s_stay_errors(tmp_path, fake_server):
    fake_server.refuse = lambda body: (400, {"error": {"message": "temperature: must be >= 0", "code": 400}})
    code = main(["eval", "arithmetic", "--env.args", "{num_tasks = 1}", "--base-url", f"{fake_server.url}/v1",
                 "--output-dir", str(tmp_path), "--run-name", "run"])  # fmt: skip
    assert code == 1
    (record,) = read_traces(tmp_path / "run" / "traces.jsonl")
    assert record["outcome"] == "error" and "HTTP 400" in record["error"]


def test_tandems_own_server_refusing_a_full_context_ends_as_truncated(tmp_path, model_dir):
    path = model_dir("qwen3")
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = engine_config(path, device="cpu", seq_len=256)
    model = load_model(path, dtype=torch.float32, device="cpu")
    engine = Engine(model, config, tokenizer=tokenizer, eos_token_ids=eos_token_ids(path, tokenizer)).start()
    try:
        with ServerThread(engine, tokenizer, tmp_path) as server:
            records = eval_guess_number(
                tmp_path, server.url, "--env.sampling.max-tokens", "12", "--env.sampling.seed", "0"
            )
    finally:
        engine.stop()
    assert [r["outcome"] for r in records] == ["truncated", "truncated"]
    assert all(r["error"] is None and 1 < r["turns"] < 40 for r in records)  # cut by the context, not max_turns
