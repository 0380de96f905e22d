"""A verifiers source's group: `group_size` verifiers episodes of one task, each trainable branch one sample.

verifiers runs the episodes (`VerifiersEnv.episodes`), its harnesses sampling through the orchestrator's
`TokenGateway`. What trains comes from each episode's traces, as prime-rl takes it:

- only traces of trainable agents train; a trace that is not `ok` (an error anywhere in its episode) or timed
  out is its own outcome (`rollout_error` / `rollout_timeout`) and never trains; a group left with no trace
  to train is dropped (`error` / `timeout`);
- each of a trace's branches (root-to-leaf paths of its message graph) is one sample scored with the trace's
  reward, its sampled mask the loss mask; a sampled message shared by several branches trains in the first only;
- every sampled message must be, token for token, a call the gateway recorded for that trace with exactly the
  branch's tokens before it as the prompt; its logprobs, kept ids and policy versions are the call's. A branch
  that differs from what the engine ran (a harness that edits history, a renderer that does not bridge) is not
  trained: the group counts it as an error rather than train on tokens the policy never sampled.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tandem.envs.verifiers import VerifiersEnv
from tandem.orchestrator.pool import Completion
from tandem.orchestrator.token_gateway import Call

logger = logging.getLogger(__name__)


class TokenMismatch(ValueError):
    """A branch's tokens are not what the engine ran."""


@dataclass
class Member:
    """One trainable branch: its prompt (the tokens before its first trained token) and the rest."""

    prompt_ids: list[int]
    completion: Completion
    reward: float
    metrics: dict[str, float]


def trace_outcome(episode: Any, trace: Any) -> str | None:
    """Why a trainable agent's trace does not train (`error`, `timeout`), or None when it does."""
    if episode.is_timeout or trace.is_timeout:
        return "timeout"
    if not (episode.ok and trace.ok):
        return "error"
    return None


def _branch_masks(trace: Any) -> list[tuple[Any, list[list[bool]]]]:
    """Each trainable branch with its per-node loss masks: a sampled node already trained in an earlier branch
    of the trace is context in later ones."""
    trained: set[int] = set()
    branches = []
    for branch in trace.branches:
        if not branch.trainable:
            continue
        masks = []
        for node in branch.nodes:
            sampled = node.sampled and any(node.mask)
            masks.append([False] * len(node.mask) if sampled and id(node) in trained else list(node.mask))
            if sampled:
                trained.add(id(node))
        if any(any(mask) for mask in masks):
            branches.append((branch, masks))
    return branches


def branch_completion(branch: Any, masks: list[list[bool]], calls: Sequence[Call]) -> tuple[list[int], Completion]:
    """A branch as one sample: its prompt ids and its completion, with every sampled message checked against
    the call that produced it (`TokenMismatch` otherwise)."""
    tokens: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    kept: list[list[int] | None] = []
    trained: list[bool] = []
    any_kept = False
    unused = list(calls)
    finish = "stop"
    for node, mask in zip(branch.nodes, masks, strict=True):
        ids = list(node.token_ids)
        if not (node.sampled and any(node.mask)):
            _context(ids, tokens, logprobs, versions, kept, trained)
            continue
        start = node.mask.index(True)
        sampled = ids[start:]
        if not all(node.mask[start:]):
            raise TokenMismatch("a sampled message's tokens are not one contiguous completion")
        _context(ids[:start], tokens, logprobs, versions, kept, trained)
        call = next((c for c in unused if c.completion.token_ids == sampled and c.prompt_ids == tokens), None)
        if call is None:
            raise TokenMismatch(
                f"a sampled message ({len(sampled)} tokens after {len(tokens)}) matches no call the engine ran "
                "with exactly the branch's tokens before it"
            )
        unused.remove(call)
        done = call.completion
        tokens += sampled
        logprobs += done.logprobs
        versions += done.versions
        if done.kept_ids is not None:
            any_kept = True
            kept += done.kept_ids
        else:
            kept += [[] for _ in sampled]
        trained += mask[start:]
        finish = done.finish_reason
    first = trained.index(True)
    last = len(trained) - trained[::-1].index(True)  # trailing context trains nothing: left off
    completion = Completion(
        tokens[first:last],
        logprobs[first:last],
        versions[first:last],
        finish,
        kept[first:last] if any_kept else None,
        trained[first:last],
    )
    return tokens[:first], completion


def _context(
    ids: list[int],
    tokens: list[int],
    logprobs: list[float],
    versions: list[int],
    kept: list[list[int] | None],
    trained: list[bool],
) -> None:
    """Append tokens the model did not sample (the environment's, the template's): no loss, no logprob."""
    version = versions[-1] if versions else 0
    tokens += ids
    logprobs += [0.0] * len(ids)
    versions += [version] * len(ids)
    kept += [[] for _ in ids]
    trained += [False] * len(ids)


@dataclass
class EpisodeResults:
    """What a group's episodes gave: the members that train, the outcomes of the traces that do not, and the
    last error one of them reported (for the message when every group fails)."""

    members: list[Member]
    outcomes: Counter[str]
    last_error: str | None = None


def _error_text(episode: Any, trace: Any) -> str | None:
    error = trace.errors[-1] if trace.errors else episode.errors[-1] if episode.errors else None
    return None if error is None else f"{error.type}: {error.message}"


def episode_members(episode: Any, calls: dict[str, list[Call]], results: EpisodeResults) -> None:
    """Add the trainable branches of one episode to `results`; count every trace that does not train."""
    if not episode.traces and episode.errors:
        results.outcomes["timeout" if episode.is_timeout else "error"] += 1
        results.last_error = f"{episode.errors[-1].type}: {episode.errors[-1].message}"
    for trace in episode.traces:
        if not trace.agent.trainable:
            continue
        outcome = trace_outcome(episode, trace)
        if outcome is not None:
            results.outcomes[outcome] += 1
            results.last_error = _error_text(episode, trace) or results.last_error
            continue
        metrics = {k: float(v) for k, v in trace.metrics.items() if v is not None}
        metrics |= {"truncated": float(trace.is_truncated), "turns": float(trace.num_turns)}
        try:
            branches = [branch_completion(b, m, calls.get(trace.id, [])) for b, m in _branch_masks(trace)]
        except TokenMismatch as error:
            logger.warning("a verifiers trace is not trained: %s", error)
            results.outcomes["error"] += 1
            results.last_error = str(error)
            continue
        results.members += [Member(prompt, completion, trace.reward, metrics) for prompt, completion in branches]


def episode_sampling(config: Any, seed: int) -> dict[str, Any]:
    """The sampling an episode's harness asks for (the gateway applies the source's own settings anyway): the
    token budget, and the seed its calls are recorded and seeded by."""
    return {"temperature": config.temperature, "max_tokens": config.max_tokens, "seed": seed}


async def run_episodes(
    env: VerifiersEnv, task: Any, contexts: Sequence[Any], seeds: Sequence[int], take: Any
) -> EpisodeResults:
    """The results of `len(contexts)` episodes of `task`; `take(seed)` hands over the gateway's calls of the
    episode seeded `seed`."""
    episodes = await env.episodes(task, contexts)
    results = EpisodeResults([], Counter())
    for episode, seed in zip(episodes, seeds, strict=True):
        episode_members(episode, take(seed), results)
    return results
