"""A verifiers source's rollout in an eval: one verifiers episode against the evaluated server, as a trace record.

verifiers runs the episode (`VerifiersEnv.episodes`) with its eval client, which streams chat completions from
the server as `vf-eval` does. The record has the fields of a native rollout's (`runner.run_rollout`), so resume,
the summary, online-eval metrics and the dashboard read both alike:

- the reward is the mean reward of the episode's trainable agents' traces (every trace's, if none is trainable):
  in a one-agent env, its trace's;
- an episode or trace that timed out is `timeout`, one verifiers marks not ok is `error` (with its last error),
  neither scored; one cut by a length or turn limit is `truncated`, and scored;
- the prompt is the evaluated trace's messages before its first reply, the completion the rest (each message
  named by its agent when several agents are evaluated), in OpenAI's chat shape as native traces are.

verifiers handles a failed model call itself (it retries, then fails the episode), so a rollout never raises
out of here but for a bug: `runner.run_rollout` still turns that into an `error` outcome.
"""

from __future__ import annotations

import time
from typing import Any

from tandem.envs.base import Task
from tandem.envs.verifiers import VerifiersEnv


async def verifiers_rollout(
    env: VerifiersEnv, task: Task, sampling: dict[str, Any], base_url: str, api_key: str | None, model: str
) -> dict[str, Any]:
    """Run one episode of `task` against `model` at `base_url`; the trace record's episode fields."""
    started = time.monotonic()
    (episode,) = await env.episodes(task, [env.eval_context(base_url, model, sampling, api_key)])
    traces = [trace for trace in episode.traces if trace.agent.trainable] or list(episode.traces)
    outcome, error = _outcome(episode, traces)
    scored = outcome in ("ok", "truncated")
    named = len(traces) > 1
    prompt: list[dict[str, Any]] = []
    completion: list[dict[str, Any]] = []
    for trace in traces:
        messages = [_chat_message(message) for message in trace.messages]
        first_reply = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))
        prompt = prompt or messages[:first_reply]
        completion += [{**m, "name": trace.agent.name} if named else m for m in messages[first_reply:]]
    return {
        "prompt": prompt or task.messages(),
        "completion": completion,
        "reward": sum(t.reward for t in traces) / len(traces) if scored and traces else 0.0,
        "metrics": _metrics(traces) if scored else {},
        "outcome": outcome,
        "error": error,
        "tokens": {"prompt": episode.num_input_tokens, "completion": episode.num_output_tokens},
        "latency_s": time.monotonic() - started,
        "turns": sum(trace.num_turns for trace in traces),
        "attempts": sum(1 for trace in traces for call in trace.calls if call.error is not None),
    }


def _chat_message(message: Any) -> dict[str, Any]:
    """A verifiers message in OpenAI's chat shape (a native trace's shape: tool calls under `function`)."""
    from verifiers.v1.dialects.chat import message_to_wire

    return {key: value for key, value in message_to_wire(message).items() if value is not None}


def _outcome(episode: Any, traces: list[Any]) -> tuple[str, str | None]:
    errors = [*episode.errors, *(error for trace in traces for error in trace.errors)]
    error = f"{errors[-1].type}: {errors[-1].message}" if errors else None
    if episode.is_timeout or any(trace.is_timeout for trace in traces):
        return "timeout", error
    if not episode.ok or not traces or not all(trace.ok for trace in traces):
        return "error", error or "verifiers marked the episode not ok"
    if any(trace.is_truncated for trace in traces):
        return "truncated", None
    return "ok", None


def _metrics(traces: list[Any]) -> dict[str, float]:
    """The traces' metrics (with each agent's name in front when there are several)."""
    named = len(traces) > 1
    return {
        f"{trace.agent.name}/{key}" if named else key: float(value)
        for trace in traces
        for key, value in trace.metrics.items()
        if value is not None
    }
