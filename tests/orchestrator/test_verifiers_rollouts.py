"""verifiers environments as training sources, against a real server: verifiers' own harness (its chat program, a
`uv` script) samples through the orchestrator's token gateway, and every trained token is the engine's.

Single-turn, multi-turn (bridged by `renderers`) and two agents, each written against verifiers' public API
(`tests/support/verifiers_tasksets`)."""

from __future__ import annotations

import asyncio
import re

import pytest
import torch

from support.inference import ServerThread, engine_config
from support.verifiers_envs import QWEN3_MARKERS, on_path, verifiers_table
from tandem.config.orchestrator import InferencePoolConfig, TrainSourceConfig
from tandem.inference.engine import Engine
from tandem.inference.main import eos_token_ids
from tandem.models import load_model
from tandem.orchestrator.pool import InferencePool
from tandem.orchestrator.rollouts import Group, Rollouts
from tandem.orchestrator.tasks import Draw, load_sources

pytest.importorskip("verifiers.v1", reason="needs the verifiers extra")

SEQ_LEN = 1024  # room for a tool schema in the system prompt
GROUP = 3


@pytest.fixture
def served(tiny_model_dir, tmp_path, monkeypatch):
    """(server, tokenizer, model): the tiny qwen3 model served on a loopback port, its tokenizer, its fp32 model."""
    from transformers import AutoTokenizer

    on_path(monkeypatch)
    path = tiny_model_dir("qwen3", extra_special=QWEN3_MARKERS)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = load_model(path, dtype=torch.float32, device="cpu")
    engine = Engine(model, engine_config(path, device="cpu", seq_len=SEQ_LEN), tokenizer=tokenizer,
                    eos_token_ids=eos_token_ids(path, tokenizer)).start()  # fmt: skip
    server = ServerThread(engine, tokenizer, tmp_path)
    yield server, tokenizer, model
    server.stop()
    engine.stop()


class RecordingPool(InferencePool):
    """The pool, keeping every prompt it sent and the samples the engine answered with."""

    def __init__(self, url: str) -> None:
        super().__init__(InferencePoolConfig(base_urls=[url]))
        self.sent: list[tuple[list[int], list[int], list[float]]] = []

    async def generate_response(self, request):
        response = await super().generate_response(request)
        for sample in response.outputs[0].samples:
            self.sent.append((list(request.prompt_token_ids), sample.token_ids, sample.logprobs))
        return response


class ToolCallingPool(RecordingPool):
    """The pool, but the first reply of each episode is a call of `vf_tools`' add tool in Qwen3's format (the
    numbers its prompt asks about), as if the engine had sampled it: a tiny random model writes no tool calls."""

    def __init__(self, url: str, tokenizer) -> None:
        super().__init__(url)
        self.tokenizer = tokenizer

    async def generate_response(self, request):
        response = await InferencePool.generate_response(self, request)
        prompt = self.tokenizer.decode(request.prompt_token_ids)
        (sample,) = response.outputs[0].samples
        if "<tool_response>" not in prompt:
            a, b = re.findall(r"What is (\d+) \+ (\d+)", prompt)[-1]
            call = f'<tool_call>\n{{"name": "add_toolset_add", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'
            ids = [*self.tokenizer.encode(call, add_special_tokens=False), self.tokenizer.eos_token_id]
            sample = sample.model_copy(
                update={"token_ids": ids, "logprobs": [-1.0] * len(ids), "versions": [0] * len(ids), "masks": None,
                        "finish_reason": "stop", "stop_reason": self.tokenizer.eos_token_id, "top_logprobs": None}
            )  # fmt: skip
            output = response.outputs[0].model_copy(update={"samples": [sample]})
            response = response.model_copy(update={"outputs": [output]})
        self.sent.append((list(request.prompt_token_ids), sample.token_ids, sample.logprobs))
        return response


def _roll(
    served, taskset: str, table: dict, pool: RecordingPool | None = None, draws: int = 2, **sampling
) -> tuple[list[Group | str], RecordingPool]:
    server, tokenizer, _ = served
    config = TrainSourceConfig(id=taskset, verifiers=table, sampling={"max_tokens": 6, **sampling})
    sources = load_sources([config])
    pool = pool or RecordingPool(server.url)
    rollouts = Rollouts(tokenizer, pool, sources, seq_len=SEQ_LEN, group_size=GROUP, seed=0, max_long_streak=10)

    async def run() -> list[Group | str]:
        await rollouts.start()
        try:
            picked = [Draw(i, sources[0], sources[0].next_task(), {}) for i in range(draws)]
            return [await rollouts.roll(draw) for draw in picked]
        finally:
            await rollouts.close()
            await pool.close()

    return asyncio.run(run()), pool


def _check_exact(group: Group, pool: RecordingPool, model, temperature: float, scored: bool = True) -> None:
    """Every trained token was sampled by the engine right after exactly the tokens before it, with the logprob the
    engine reported, which the trainer's forward over the sample reproduces (unless not `scored`: replies the pool
    scripted carry logprobs of its own)."""
    sent = {(tuple(prompt), tuple(reply)): logprobs for prompt, reply, logprobs in pool.sent}
    for member, completion in enumerate(group.completions):
        prompt = group.prompt_of(member)
        tokens = [*prompt, *completion.token_ids]
        trained = completion.trained or [True] * len(completion.token_ids)
        assert trained[0] and trained[-1]
        # Split the completion into its runs of trained tokens; each run is one engine call's reply.
        start = 0
        while start < len(trained):
            if not trained[start]:
                start += 1
                continue
            end = start
            while end < len(trained) and trained[end]:
                end += 1
            here = len(prompt) + start
            key = (tuple(tokens[:here]), tuple(tokens[here : len(prompt) + end]))
            assert key in sent, "a trained run of tokens is no reply the engine gave to exactly the tokens before it"
            assert completion.logprobs[start:end] == sent[key]
            start = end
        if not scored:
            continue
        with torch.no_grad():
            logits = model(torch.tensor([tokens]))[0].float() / temperature
        logp = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1].gather(
            -1, torch.tensor(completion.token_ids)[:, None]
        )
        mask = torch.tensor(trained)
        engine = torch.tensor(completion.logprobs)
        diff = (logp[:, 0] - engine)[mask]
        assert torch.all(torch.tensor([lp for lp, t in zip(completion.logprobs, trained, strict=True) if not t]) == 0)
        assert diff.abs().max() < 1e-4, diff.abs().max()
        mismatch_kl = (torch.exp(diff) - 1 - diff).mean()  # the k3 estimate the trainer reports
        assert mismatch_kl < 1e-6, mismatch_kl


def test_a_single_turn_verifiers_env_trains_the_engines_tokens(served):
    groups, pool = _roll(served, "vf_letters", verifiers_table(), temperature=0.8)
    for group in groups:
        assert isinstance(group, Group), group
        assert len(group.completions) == GROUP and not group.failed
        assert all(0.0 <= reward <= 1.0 for reward in group.rewards)
        assert all(c.trained is not None and all(c.trained) for c in group.completions)  # one reply, all trained
        assert all("reply_chars" in m and m["turns"] == 1.0 for m in group.metrics)
        _check_exact(group, pool, served[2], 0.8)
    # seeded by draw and member: the two draws' groups differ, the members of one group too
    assert len({tuple(c.token_ids) for g in groups for c in g.completions}) > GROUP


def test_multi_turn_verifiers_episodes_train_every_reply_with_the_users_turns_as_context(served):
    groups, pool = _roll(served, "vf_dialog", verifiers_table())
    for group in groups:
        assert isinstance(group, Group), group
        for completion, metrics in zip(group.completions, group.metrics, strict=True):
            assert metrics["turns"] == 3.0
            assert completion.trained is not None and not all(completion.trained)  # user turns between: context
        _check_exact(group, pool, served[2], 1.0)


def test_only_the_trainable_agents_traces_train(served):
    groups, pool = _roll(served, "vf_duo", verifiers_table("solver", "critic"))
    for group in groups:
        assert isinstance(group, Group), group
        assert len(group.completions) == GROUP  # one solver trace per episode; the critics' never
        for member in range(GROUP):
            assert "Is this a good answer" not in served[1].decode(group.prompt_of(member))
        _check_exact(group, pool, served[2], 1.0)
    assert len(pool.sent) == 2 * 2 * GROUP  # both agents sampled once in every episode


def test_a_toolset_call_and_its_result_train_as_one_branch_with_the_result_as_context(served):
    server, tokenizer, _ = served
    pool = ToolCallingPool(server.url, tokenizer)
    groups, pool = _roll(served, "vf_tools", verifiers_table(), pool=pool, draws=1, max_tokens=40)
    for group in groups:
        assert isinstance(group, Group), group
        assert len(group.completions) == GROUP and not group.failed
        for member, completion in enumerate(group.completions):
            assert group.metrics[member]["tool_results"] == 1.0 and group.metrics[member]["turns"] == 2.0
            text = tokenizer.decode(completion.token_ids)
            # the scripted call, the tool server's answer (context, bridged by the renderer), then the engine's reply
            assert text.startswith("<tool_call>") and "<tool_response>" in text
            a = int(re.findall(r"What is (\d+) \+", tokenizer.decode(group.prompt_of(member)))[-1])
            assert re.search(rf"<tool_response>\s*{2 * a + 2}\s*</tool_response>", text), text
            trained = completion.trained
            assert trained is not None and trained[0] and not all(trained)
        _check_exact(group, pool, served[2], 1.0, scored=False)
    assert len(pool.sent) == 2 * GROUP  # two calls an episode: the tool call, then the reply to its result
