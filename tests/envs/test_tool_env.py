"""Tool environments in the shared episode loop: calls answered by `tool` messages, failures as tool errors the
episode survives and counts, the same loop whether a server parsed the calls or the reply is raw text."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from tandem.envs import Task, load_taskset, reward, run_episode, tool_parsers
from tandem.envs.builtin.calculator import calculate
from tandem.envs.tool_env import TOOLBOX_KEY, ToolTaskset
from tandem.envs.tool_parsers import HermesParser
from tandem.envs.tools import ToolCall, ToolError

HERMES = HermesParser()


def call_text(name: str, **arguments) -> str:
    return HERMES.render([ToolCall(name, arguments)])


def scripted(*replies):
    """A generate() that answers with these replies in turn (str: raw text; dict: a parsed assistant message)."""
    seen: list[list[dict]] = []

    async def generate(messages):
        seen.append(list(messages))
        return replies[len(seen) - 1]

    generate.seen = seen
    return generate


def play(taskset, task, generate):
    return asyncio.run(run_episode(taskset, task, generate))


def test_calculator_episode_calls_the_tool_then_answers_from_its_result():
    taskset = load_taskset("calculator", num_tasks=1)
    task = taskset.tasks()[0]
    a, b = task.prompt.split("What is ")[1].split("?")[0].split(" * ")
    generate = scripted(call_text("calculate", expression=f"{a} * {b}"), f"The answer is {task.answer}.")
    episode = play(taskset, task, generate)

    assert episode.outcome == "ok" and episode.score.reward == 1.0
    assistant, tool, final = episode.completion
    assert tool == {
        "role": "tool",
        "content": task.answer,
        "tool_call_id": tool["tool_call_id"],
        "name": "calculate",
    }
    assert final == {"role": "assistant", "content": f"The answer is {task.answer}."}
    assert episode.score.metrics == {"correct": 1.0, "used_tool": 1.0, "tool_calls": 1.0, "tool_errors": 0.0}
    # the second request sees the call and its result
    assert generate.seen[1][-2:] == [assistant, tool]


def test_a_guess_without_the_tool_ends_the_episode_and_is_scored():
    taskset = load_taskset("calculator", num_tasks=1)
    task = taskset.tasks()[0]
    episode = play(taskset, task, scripted("12345"))
    assert len(episode.completion) == 1 and episode.score.reward == 0.0
    assert episode.score.metrics["tool_calls"] == 0.0 and episode.score.metrics["used_tool"] == 0.0


def test_every_kind_of_bad_call_is_answered_as_an_error_and_counted():
    taskset = load_taskset("calculator", num_tasks=1)
    task = taskset.tasks()[0]
    bad = "\n".join(
        [
            "<tool_call>\nnot json\n</tool_call>",  # malformed
            call_text("search", query="x"),  # unknown tool
            call_text("calculate", expr="1+1"),  # invalid arguments
            call_text("calculate", expression="1/0"),  # the tool reports an error
            call_text("calculate", expression="2+2"),  # fine
        ]
    )
    episode = play(taskset, task, scripted(bad, "4"))
    tools = [m for m in episode.completion if m["role"] == "tool"]
    texts = [m["content"] for m in tools]
    assert len(tools) == 5 and episode.outcome == "ok"
    assert "4" in texts
    assert any("unknown tool 'search'" in t for t in texts)
    assert any("missing required argument 'expression'" in t for t in texts)
    assert any("division by zero" in t for t in texts)
    assert any("malformed tool call" in t for t in texts)
    assert episode.score.metrics["tool_calls"] == 5.0 and episode.score.metrics["tool_errors"] == 4.0
    box = episode.state[TOOLBOX_KEY]
    assert dict(box.stats.errors) == {"malformed": 1, "unknown_tool": 1, "invalid_arguments": 1, "tool": 1}


def test_calls_a_server_parsed_are_run_and_malformed_text_it_left_is_an_error():
    """Eval's path: the OpenAI server returns `tool_calls` and leaves unreadable blocks in the content."""
    taskset = load_taskset("calculator", num_tasks=1)
    task = taskset.tasks()[0]
    parsed = {
        "role": "assistant",
        "content": "<tool_call>\n{oops\n</tool_call>",
        "tool_calls": [ToolCall("calculate", {"expression": "6*7"}, "call_abc").to_openai()],
    }
    episode = play(taskset, task, scripted(parsed, "42"))
    tools = [m for m in episode.completion if m["role"] == "tool"]
    assert tools[0]["tool_call_id"] == "call_abc" and tools[0]["content"] == "42"
    assert "malformed" in tools[1]["content"]
    assert episode.score.metrics["tool_errors"] == 1.0


class Recording(HermesParser):
    """Hermes, noting the thread each reply is parsed on."""

    name = "recording_hermes"

    def __init__(self) -> None:
        self.threads: list[str] = []

    def parse(self, text):
        self.threads.append(threading.current_thread().name)
        return super().parse(text)


def test_hostile_replies_are_tool_errors_parsed_off_the_event_loop(monkeypatch):
    """A 4,301-digit integer, JSON 1,000 deep and 80,000 unclosed tags: each a malformed call the model reads, the
    episode goes on (these once raised out of the parser and ended `tandem rl`)."""
    recording = Recording()
    monkeypatch.setitem(tool_parsers._PARSERS, Recording.name, recording)
    taskset = load_taskset("calculator", num_tasks=1)
    monkeypatch.setattr(taskset, "tool_parser", Recording.name)
    task = taskset.tasks()[0]
    replies = [
        '<tool_call>{"name": "calculate", "arguments": {"expression": ' + "1" * 4301 + "}}</tool_call>",
        '<tool_call>{"name": "calculate", "arguments": ' + "[" * 1000 + "]" * 1000 + "}</tool_call>",
        "<tool_call>" * 80_000,
        "I give up.",
    ]
    episode = play(taskset, task, scripted(*replies))
    texts = [m["content"] for m in episode.completion if m["role"] == "tool"]
    assert episode.outcome == "ok" and len(texts) == 3
    assert "more than 1000 digits" in texts[0] and "1001 deep" in texts[1] and "without a closing" in texts[2]
    assert all(t.startswith("Error: malformed tool call:") for t in texts)
    assert episode.score.metrics["tool_errors"] == 3.0
    assert len(recording.threads) == 4 and threading.main_thread().name not in recording.threads


class Slow(ToolTaskset):
    """Tools that misbehave: one sleeps past its timeout, one raises; the budget is two calls."""

    max_tool_calls = 2
    tool_timeout_s = 0.2

    def tasks(self):
        return [Task(idx=0, prompt="go")]

    def tools(self):
        async def nap(seconds: float) -> str:
            """Sleep."""
            await asyncio.sleep(seconds)
            return "rested"

        def boom() -> str:
            """Raise."""
            raise RuntimeError("kaput")

        return [nap, boom]

    @reward
    def done(self, completion: str) -> float:
        return float(completion == "done")


def test_timeouts_exceptions_and_the_budget_never_end_the_episode():
    taskset = Slow()
    replies = [call_text("nap", seconds=5), call_text("boom"), call_text("nap", seconds=0), "done"]
    episode = play(taskset, taskset.tasks()[0], scripted(*replies))
    texts = [m["content"] for m in episode.completion if m["role"] == "tool"]
    assert "timed out after 0.2 s" in texts[0]
    assert "boom raised RuntimeError: kaput" in texts[1]
    assert "tool budget exhausted" in texts[2]
    assert episode.score.reward == 1.0 and episode.score.metrics["tool_errors"] == 3.0


def test_tool_schemas_come_from_signatures_and_a_turn_limit_truncates():
    taskset = Slow()
    names = [t["function"]["name"] for t in taskset.tool_schemas()]
    assert names == ["nap", "boom"]
    assert taskset.tool_schemas()[0]["function"]["parameters"]["properties"] == {"seconds": {"type": "number"}}
    looping = scripted(*[call_text("boom")] * taskset.max_turns)
    assert play(taskset, taskset.tasks()[0], looping).outcome == "truncated"


@pytest.mark.parametrize(
    ("expression", "result"),
    [("123456 * 654321", "80779853376"), ("(2 + 3) ** 2 - 1", "24"), ("-7 // 2", "-4"), ("1.5 * 4", "6.0")],
)
def test_calculate_is_exact_arithmetic(expression, result):
    assert calculate(expression) == result


@pytest.mark.parametrize("expression", ["__import__('os').system('true')", "9 ** 9 ** 9", "x + 1", "open('f')", "1/0"])
def test_calculate_refuses_anything_else(expression):
    with pytest.raises(ToolError):
        calculate(expression)


def test_the_calculator_taskset_validates_its_args_and_offers_python():
    with pytest.raises(ValueError, match="digits"):
        load_taskset("calculator", digits=0)
    with pytest.raises(ValueError, match="operations"):
        load_taskset("calculator", operations=["div"])
    python = load_taskset("calculator", tool="python", num_tasks=1)
    assert [t["function"]["name"] for t in python.tool_schemas()] == ["python"]
    assert "python tool" in python.tasks()[0].prompt
    assert json.dumps(python.tool_schemas())  # JSON, as the chat template and the API take it


class Sandboxed(ToolTaskset):
    """The built-in python tool, with limits a test can wait for."""

    def tasks(self):
        return [Task(idx=0, prompt="run things")]

    def tools(self):
        from tandem.envs.sandbox import SandboxLimits, python_tool

        return [python_tool(SandboxLimits(wall_s=1.0, cpu_s=30, memory_mb=256))]

    @reward
    def done(self, completion: str) -> float:
        return float(completion == "done")


def test_runaway_code_in_the_python_tool_ends_in_tool_errors_and_the_episode_goes_on():
    codes = [
        "while True: pass",  # never ends: killed on the wall clock
        "blocks = [bytearray(1 << 20) for _ in range(10_000)]",  # a memory bomb: MemoryError
        "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=5)",  # no network
        "print(6 * 7)",
    ]
    taskset = Sandboxed()
    replies = [call_text("python", code=code) for code in codes] + ["done"]
    episode = play(taskset, taskset.tasks()[0], scripted(*replies))
    results = [m["content"] for m in episode.completion if m["role"] == "tool"]
    assert "wall-clock limit" in results[0]
    assert "MemoryError" in results[1]
    assert "Error" in results[2] and "42" not in results[2]
    assert results[3].strip() == "42"
    assert episode.outcome == "ok" and episode.score.reward == 1.0
    assert episode.score.metrics["tool_calls"] == 4.0 and episode.score.metrics["tool_errors"] == 3.0
