"""The rubric: reward/metric decorators, weights, sync and async functions, rollout fields, task rows."""

from __future__ import annotations

import asyncio

import pytest

from tandem.envs import Score, Task, Taskset, metric, reward


class Weighted(Taskset):
    def tasks(self):
        return [Task(idx=0, prompt="2+2?", answer="4", info={"unit": "apples"})]

    @reward
    def exact(self, completion, answer):
        return completion.strip() == answer

    @reward(weight=0.5)
    async def mentions_unit(self, completion, info):
        await asyncio.sleep(0)
        return info["unit"] in completion

    @metric
    async def length(self, completion):
        return len(completion)

    @metric
    def turns(self, messages):
        return sum(m["role"] == "assistant" for m in messages)


def score(taskset, completion, state=None) -> Score:
    return asyncio.run(taskset.score(taskset.tasks()[0], completion, state))


def test_weighted_sum_of_sync_and_async_rewards_and_all_values_as_metrics():
    assert score(Weighted(), "4") == Score(1.0, {"exact": 1.0, "mentions_unit": 0.0, "length": 1.0, "turns": 1.0})
    assert score(Weighted(), "4 apples").reward == 0.5
    assert score(Weighted(), "4 apples").metrics["length"] == 8.0


def test_completion_as_messages_uses_the_last_assistant_turn():
    conversation = [
        {"role": "assistant", "content": "3"},
        {"role": "user", "content": "try again"},
        {"role": "assistant", "content": [{"type": "text", "text": "4"}]},
    ]
    result = score(Weighted(), conversation)
    assert result.reward == 1.0 and result.metrics["turns"] == 2.0


def test_state_reaches_reward_functions():
    class Stateful(Weighted):
        @reward
        def exact(self, state):  # overrides the inherited reward of the same name
            return state["won"]

    assert score(Stateful(), "anything", {"won": True}).metrics["exact"] == 1.0


def test_plain_override_removes_an_inherited_reward():
    class NoLength(Weighted):
        def length(self):
            return 0

    assert [fn.name for fn in NoLength.rubric] == ["exact", "mentions_unit", "turns"]


def test_unknown_parameter_fails_when_the_class_is_defined():
    with pytest.raises(TypeError, match=r"unknown parameter.*'respons'"):

        class Typo(Taskset):
            @reward
            def exact(self, respons):
                return 1.0


def test_non_numeric_result_names_the_function():
    class Bad(Weighted):
        @metric
        def label(self):
            return "yes"

    with pytest.raises(TypeError, match=r"Bad\.label returned 'yes'"):
        score(Bad(), "4")


def test_taskset_without_reward_cannot_score():
    class NoReward(Taskset):
        def tasks(self):
            return [Task(idx=0, prompt="p")]

    with pytest.raises(TypeError, match="declares no @reward"):
        score(NoReward(), "x")


def test_task_rows_serialise_and_default_their_id():
    task = Task(idx=3, prompt=[{"role": "system", "content": "s"}, {"role": "user", "content": "u"}], info={"k": [1]})
    assert task.id == "3"
    assert Task.model_validate_json(task.model_dump_json()) == task
    assert task.messages()[1] == {"role": "user", "content": "u"}
    assert Task(idx=0, prompt="hi").messages() == [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="idx"):
        Task(idx=-1, prompt="p")


def test_rollout_timeout_is_a_taskset_field():
    assert Weighted().timeout_s == 300.0
