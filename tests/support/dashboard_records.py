"""Records in the formats tandem writes, for the dashboard's tests: trace, rollout and heartbeat lines."""

from __future__ import annotations


def trace(index: int, source: str, outcome: str, reward: float) -> dict:
    return {
        "key": f"k{index}", "source": source, "task": {"id": f"t{index // 2}"}, "rollout": index % 2,
        "prompt": [{"role": "user", "content": f"question {index}"}], "completion": f"answer {index}",
        "reward": reward, "metrics": {"exact": reward}, "outcome": outcome,
        "tokens": {"prompt": 5, "completion": 3}, "latency_s": 0.1,
    }  # fmt: skip


TOOL_EPISODE = [  # a multi-turn rollout's completion: a reply that calls a tool, its result, the answer
    {"role": "assistant", "content": "let me compute", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "calculate", "arguments": '{"expression": "6*7"}'}}
    ]},
    {"role": "tool", "content": "42", "tool_call_id": "call_1", "name": "calculate"},
    {"role": "assistant", "content": "It is 42."},
]  # fmt: skip


def rollout(index: int) -> dict:
    """A line of `rollouts.jsonl`, exactly the keys the orchestrator writes: two per step, steps 1-5 (the last
    one a tool episode)."""
    step = index // 2 + 1
    completion = TOOL_EPISODE if index == 9 else f"esrever {index}"
    return {
        "step": step, "source": "a" if index % 2 == 0 else "b", "task_id": f"t{index}",
        "prompt": [{"role": "user", "content": f"reverse {index}"}], "completion": completion,
        "reward": 1.0 if index % 3 == 0 else 0.0, "advantage": 0.5 if index % 3 == 0 else -0.5,
        "outcome": "truncated" if index % 4 == 3 else "ok", "version": step - 1, "metrics": {"exact": index % 3 == 0},
    }  # fmt: skip


def heartbeat(index: int) -> dict:
    """A line of `inference_metrics.jsonl`, as the inference server appends every few seconds while it serves."""
    return {
        "time": 1_800_000_000.0 + 5 * index, "requests": 10 * index, "tokens_per_s": 100.0 + index,
        "running": index % 3, "waiting": index % 2, "kv_usage": 0.04 * index,
    }  # fmt: skip
