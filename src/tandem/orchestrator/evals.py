"""Online evals during RL: the eval stack's rollouts and summaries, run against the servers training uses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tandem.client import OpenAIClient
from tandem.config.orchestrator import OnlineEvalConfig
from tandem.eval.concurrency import AdaptiveLimiter, AimdController
from tandem.eval.runner import load_source, pending_rollouts, run_rollouts, serving
from tandem.eval.summary import summarize_source
from tandem.jsonl import JsonlWriter


async def run_online_eval(
    config: OnlineEvalConfig, base_url: str, api_key: str | None, out_dir: Path
) -> dict[str, Any]:
    """Every source's rollouts once; traces under `out_dir`, started anew (a resumed run evaluates a step again);
    flat `eval/<source>/<metric>` numbers back."""
    sources = [load_source(source) for source in config.source]
    limiter = AdaptiveLimiter(AimdController(config.concurrency))
    records: list[dict[str, Any]] = []
    async with OpenAIClient(base_url, api_key=api_key, on_feedback=limiter.record) as client:
        model = (await client.models())[0]
        with JsonlWriter(out_dir / "traces.jsonl", truncate=True) as writer:  # every rollout runs again
            async with serving(sources):
                await run_rollouts(pending_rollouts(sources, set()), client, model, limiter, writer, records.append)
    metrics: dict[str, Any] = {}
    for source in sources:
        summary = summarize_source(
            [r for r in records if r["source"] == source.name],
            expected=source.expected,
            rollouts_per_task=source.config.rollouts_per_task,
            pass_threshold=source.config.pass_threshold,
        )
        prefix = f"eval/{source.name}"
        metrics[f"{prefix}/reward"] = summary["mean_reward"]
        metrics.update({f"{prefix}/pass@{k}": v for k, v in summary["pass_at_k"].items()})
        metrics.update({f"{prefix}/{outcome}": n for outcome, n in summary["outcomes"].items()})
    return metrics
