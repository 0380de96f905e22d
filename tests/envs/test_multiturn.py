"""Multi-turn: the guess_number game's steps and rewards, and the shared rollout loop (turn limit, timeout)."""

from __future__ import annotations

import asyncio

import pytest

from tandem.envs import EnvConfig, MultiTurnTaskset, Task, load_env, load_taskset, reward, run_episode


def game(**args):
    taskset = load_taskset("guess_number", num_tasks=1, **args)
    return taskset, taskset.tasks()[0]


def test_step_says_higher_lower_and_stops_on_the_secret():
    taskset, task = game(max_value=10)
    secret = int(task.answer)
    state = taskset.init_state(task)

    def step(guess):
        return taskset.step(task, [*task.messages(), {"role": "assistant", "content": guess}], state)

    assert step("My guess is 0") == "higher"
    assert step("11") == "lower"
    assert step("no idea") == "Reply with a single integer."
    assert step(f"**{secret}**") is None
    assert state == {"guesses": ["0", "11", str(secret)], "solved": True}


def bisect(max_value):
    """A generate() that plays the game by bisection, as a model would through the chat API."""
    low, high = 1, max_value

    async def generate(messages):
        nonlocal low, high
        if len(messages) > 1:
            previous, feedback = int(messages[-2]["content"]), messages[-1]["content"]
            low, high = (previous + 1, high) if feedback == "higher" else (low, previous - 1)
        return {"role": "assistant", "content": str((low + high) // 2)}

    return generate


def test_episode_solved_by_bisection():
    taskset, task = game()
    episode = asyncio.run(run_episode(taskset, task, bisect(100)))
    assert episode.outcome == "ok" and episode.state["solved"]
    assert episode.completion[-1]["content"] == task.answer
    guesses = len(episode.state["guesses"])
    assert episode.score.metrics == {
        "solved": 1.0,
        "efficiency": pytest.approx(1 - (guesses - 1) / 7),
        "guesses": guesses,
    }
    assert episode.messages[0]["role"] == "user" and len(episode.completion) == 2 * guesses - 1


def test_episode_out_of_turns_is_truncated_and_unrewarded():
    taskset, task = game()
    wrong = "1" if task.answer != "1" else "2"

    async def stubborn(messages):
        return wrong

    episode = asyncio.run(run_episode(taskset, task, stubborn))
    assert episode.outcome == "truncated"
    assert len(episode.completion) == 2 * taskset.max_turns - 1  # ends on the model's last reply
    assert episode.score.reward == 0.0 and episode.score.metrics["guesses"] == taskset.max_turns


def test_config_overrides_turns_and_timeout():
    taskset = load_env(EnvConfig(id="guess_number", args={"num_tasks": 1}, max_turns=2, timeout_s=5))
    assert (taskset.max_turns, taskset.timeout_s) == (2, 5)
    assert type(taskset).max_turns == 8  # the class default is untouched
    episode = asyncio.run(run_episode(taskset, taskset.tasks()[0], lambda messages: asyncio.sleep(0, "0")))
    assert episode.outcome == "truncated" and len(episode.completion) == 3
    with pytest.raises(ValueError, match="single-turn"):
        load_env(EnvConfig(id="arithmetic", max_turns=2))


def test_timeout_ends_the_rollout_and_it_is_still_scored():
    taskset, task = game()
    taskset.timeout_s = 0.05

    async def slow_after_first(messages):
        if len(messages) > 1:
            await asyncio.sleep(10)
        return "0"

    episode = asyncio.run(run_episode(taskset, task, slow_after_first))
    assert episode.outcome == "timeout"
    assert [m["content"] for m in episode.completion] == ["0", "higher"]
    assert episode.score.metrics["guesses"] == 1.0


def test_a_timeout_error_raised_by_generate_is_not_mistaken_for_ours():
    taskset, task = game()

    async def failing(messages):
        raise TimeoutError("http read timed out")

    with pytest.raises(TimeoutError, match="http read"):
        asyncio.run(run_episode(taskset, task, failing))


def test_single_turn_episode_and_async_step():
    class Echo(MultiTurnTaskset):
        max_turns = 3

        def tasks(self):
            return [Task(idx=0, prompt="say done", answer="done")]

        async def step(self, task, messages, state):
            await asyncio.sleep(0)
            return None if messages[-1]["content"] == "done" else {"role": "tool", "content": "not yet"}

        @reward
        def finished(self, completion, answer):
            return completion == answer

    replies = iter(["working", "done"])
    episode = asyncio.run(run_episode(Echo(), Echo().tasks()[0], lambda m: asyncio.sleep(0, next(replies))))
    assert episode.outcome == "ok" and episode.score.reward == 1.0
    assert [m["role"] for m in episode.completion] == ["assistant", "tool", "assistant"]

    arithmetic = load_taskset("arithmetic", num_tasks=1)
    task = arithmetic.tasks()[0]
    one = asyncio.run(run_episode(arithmetic, task, lambda m: asyncio.sleep(0, task.answer)))
    assert (one.outcome, one.score.reward, len(one.completion)) == ("ok", 1.0, 1)
