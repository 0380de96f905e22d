"""Token-exact multi-turn rollouts: ids are the engine's outputs plus rendered suffixes, never re-tokenised."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
from transformers import AutoTokenizer

from tandem.envs import Task
from tandem.envs.builtin.guess_number import GuessNumber
from tandem.orchestrator.episodes import ChatSuffixes, TemplateSuffixError, token_episode
from tandem.testing.tiny import write_tokenizer


@dataclass
class Reply:
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    kept_ids: list | None = None


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    write_tokenizer(path)
    return AutoTokenizer.from_pretrained(path)


class ScriptedEngine:
    """Replies with fixed texts, encoded once (the ids the 'engine' produced), ending in <|im_end|>."""

    def __init__(self, tokenizer, texts: list[str]):
        self.tokenizer = tokenizer
        self.replies = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in texts]
        self.prompts: list[list[int]] = []

    async def __call__(self, prompt_ids: list[int], max_tokens: int) -> Reply:
        self.prompts.append(list(prompt_ids))
        ids = self.replies[len(self.prompts) - 1][:max_tokens]
        reason = "stop" if len(ids) == len(self.replies[len(self.prompts) - 1]) else "length"
        return Reply(ids, [-0.5] * len(ids), [len(self.prompts)] * len(ids), reason)


def guess_task(secret: int) -> Task:
    return Task(idx=0, id="g", prompt="Guess a number between 1 and 100.", answer=str(secret))


def test_three_turn_episode_trains_on_exactly_the_engine_ids(tokenizer):
    env = GuessNumber()
    engine = ScriptedEngine(tokenizer, ["50", "25", "30"])
    suffixes = ChatSuffixes(tokenizer)
    rollout = asyncio.run(token_episode(env, guess_task(30), suffixes, engine, max_tokens=16, max_len=512))

    assert rollout.turns == 3 and rollout.outcome == "ok" and rollout.reward > 1.0  # solved, efficiency > 0
    # Each turn's prompt is the previous prompt + the previous reply's ids + the rendered answer.
    first = suffixes.prompt_ids(guess_task(30).messages())
    assert engine.prompts[0] == first
    expected = list(first)
    for turn, answer in enumerate(["lower", "higher"]):
        expected += engine.replies[turn]
        expected += tokenizer("\n<|im_start|>user\n" + answer + "<|im_end|>\n<|im_start|>assistant\n",
                              add_special_tokens=False)["input_ids"]  # fmt: skip
        assert engine.prompts[turn + 1] == expected
    expected += engine.replies[2]
    assert rollout.prompt_ids + rollout.completion_ids == expected
    # Only generated tokens are trained; their logprobs and versions are the engine's.
    generated = [i for i, t in enumerate(rollout.trained) if t]
    assert len(generated) == sum(len(r) for r in engine.replies)
    assert [rollout.completion_ids[i] for i in generated] == [t for r in engine.replies for t in r]
    assert all(rollout.logprobs[i] == -0.5 for i in generated)
    assert all(lp == 0.0 for lp, t in zip(rollout.logprobs, rollout.trained, strict=True) if not t)
    assert len(rollout.versions) == len(rollout.completion_ids) == len(rollout.kept_ids)
    # The conversation the env saw is the decoded replies, turn by turn.
    assert [m["content"] for m in rollout.messages] == ["50", "lower", "25", "higher", "30"]


def test_context_overflow_ends_the_episode_as_truncated_and_scores_it(tokenizer):
    engine = ScriptedEngine(tokenizer, ["50", "25", "30"])
    suffixes = ChatSuffixes(tokenizer)
    task = guess_task(30)
    limit = len(suffixes.prompt_ids(task.messages())) + len(engine.replies[0]) + 3
    rollout = asyncio.run(token_episode(GuessNumber(), task, suffixes, engine, max_tokens=16, max_len=limit))
    assert rollout.outcome == "truncated" and rollout.turns == 1 and rollout.reward == 0.0
    assert len(rollout) <= limit


def test_a_reply_cut_at_max_tokens_is_closed_by_the_template_and_marks_the_episode_truncated(tokenizer):
    engine = ScriptedEngine(tokenizer, ["50 is my guess", "30"])
    suffixes = ChatSuffixes(tokenizer)
    rollout = asyncio.run(token_episode(GuessNumber(), guess_task(30), suffixes, engine, max_tokens=2, max_len=512))
    assert rollout.outcome == "truncated"
    # The cut reply gets the end-of-turn token from the template (context, not trained).
    cut = len(engine.replies[0][:2])
    context = rollout.completion_ids[cut:]
    assert context[0] == tokenizer.eos_token_id and not rollout.trained[cut]


def test_a_template_that_rewrites_earlier_turns_is_refused_by_name(tokenizer):
    # Like templates that render the last message's role into every turn: the answer changes what came before.
    tokenizer = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}{% if loop.last %}!{% endif %}\n{{ m['content'] }}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    suffixes = ChatSuffixes(tokenizer)
    with pytest.raises(TemplateSuffixError, match="re-tokenise"):
        suffixes.answer_text([{"role": "user", "content": "lower"}])


def test_packed_multi_turn_sample_targets_only_the_generated_tokens():
    from tandem.orchestrator.batching import IGNORE_INDEX, TrainSample, pack_batch

    trained = [True, True, False, False, False, True]
    sample = TrainSample(
        prompt_ids=[1, 2, 3], completion_ids=[10, 11, 20, 21, 22, 12], logprobs=[-1.0, -2.0, 0, 0, 0, -3.0],
        advantage=1.0, weight=0.25, temperature=1.0, versions=[0] * 6, trained=trained,
    )  # fmt: skip
    [[micro]] = pack_batch([sample], seq_len=16, world_size=1)
    targets, weights = micro["target_ids"][0], micro["loss_weights"][0]
    assert micro["input_ids"][0, :9].tolist() == [1, 2, 3, 10, 11, 20, 21, 22, 12]
    # Position i predicts token i + 1: completion token j sits at 2 + j.
    assert targets[:9].tolist() == [IGNORE_INDEX, IGNORE_INDEX, 10, 11, *[IGNORE_INDEX] * 3, 12, IGNORE_INDEX]
    assert weights[:9].tolist() == [0, 0, 0.25, 0.25, 0, 0, 0, 0.25, 0]


def test_a_tool_episode_trains_the_engines_calls_and_answers_with_tool_results_as_context(tokenizer):
    from tandem.envs import load_taskset
    from tandem.envs.tools import ToolCall

    env = load_taskset("calculator", num_tasks=1, digits=2)
    task = env.tasks()[0]
    a, b = task.prompt.split("What is ")[1].split("?")[0].split(" * ")
    call = env.parser.render([ToolCall("calculate", {"expression": f"{a}*{b}"})])
    engine = ScriptedEngine(tokenizer, [call, task.answer])
    suffixes = ChatSuffixes(tokenizer, env.tool_schemas(), env.tool_parser)
    rollout = asyncio.run(token_episode(env, task, suffixes, engine, max_tokens=256, max_len=1024))

    assert rollout.turns == 2 and rollout.outcome == "ok" and rollout.reward == 1.0
    assert rollout.metrics["tool_calls"] == 1.0 and rollout.metrics["tool_errors"] == 0.0
    # The first prompt shows the tools; the second is it, the call's ids and the tool message rendered as a suffix.
    first = suffixes.prompt_ids(task.messages())
    assert engine.prompts[0] == first and '"name": "calculate"' in tokenizer.decode(first)
    tool_turn = f"\n<|im_start|>tool\n{task.answer}<|im_end|>\n<|im_start|>assistant\n"
    after_call = tokenizer(tool_turn, add_special_tokens=False)["input_ids"]
    assert engine.prompts[1] == first + engine.replies[0] + after_call
    assert rollout.prompt_ids + rollout.completion_ids == engine.prompts[1] + engine.replies[1]
    assert rollout.trained == [True] * len(engine.replies[0]) + [False] * len(after_call) + [True] * len(
        engine.replies[1]
    )
    assert [m["role"] for m in rollout.messages] == ["assistant", "tool", "assistant"]


def test_tools_need_a_template_that_renders_them_in_the_syntax_the_environment_parses(tokenizer):
    from tandem.envs import load_taskset

    env = load_taskset("calculator")
    plain = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    plain.chat_template = plain.chat_template.split("{% endif %}", 1)[1]  # the tiny template without its tools block
    with pytest.raises(TemplateSuffixError, match=r"does not render tools \(calculate\)"):
        ChatSuffixes(plain, env.tool_schemas(), env.tool_parser)
    with pytest.raises(TemplateSuffixError, match="teaches 'hermes' tool calls, but the environment parses 'mistral'"):
        ChatSuffixes(tokenizer, env.tool_schemas(), "mistral")
