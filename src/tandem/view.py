"""The combined live view of `tandem rl`: one progress bar and a line per step, from the children's metric files."""

from __future__ import annotations

import logging
from typing import Any

from tandem.jsonl import JsonlFollower
from tandem.orchestrator.main import ORCHESTRATOR_METRICS_FILE
from tandem.run import step_progress

logger = logging.getLogger(__name__)


class RlProgress:
    """Follows `metrics.jsonl` (trainer) and the orchestrator's metrics through `JsonlFollower`, so a file a
    resuming child rewrites is read again from its start: the rollout records kept for joining are dropped and
    rebuilt, and steps up to the one resumed from (the run's history) are not shown again."""

    def __init__(self, config, start_step: int):
        self.config = config
        self.start_step = start_step
        self.shown = start_step  # the last step a line was logged for
        self.trainer = JsonlFollower(config.run_dir / "metrics.jsonl")
        self.orchestrator = JsonlFollower(config.run_dir / ORCHESTRATOR_METRICS_FILE)
        self.rollouts: dict[int, dict[str, Any]] = {}
        self.progress, self.task = step_progress("rl", config.max_steps, start_step)

    def refresh(self) -> None:
        records = self.orchestrator.new_records()
        if self.orchestrator.restarted:
            self.rollouts.clear()
        for record in records:
            if record.get("kind") == "eval":
                if record.get("step", 0) > self.start_step:
                    logger.info(
                        "eval at step %d: %s",
                        record["step"],
                        {k: v for k, v in record.items() if k.endswith("/reward")},
                    )
            elif isinstance(record.get("step"), int):
                self.rollouts[record["step"]] = record
        records = self.trainer.new_records()
        if self.trainer.restarted:
            self.shown = self.start_step
        for record in records:
            step = record.get("step")
            if isinstance(step, int) and step > self.shown:
                self._show(step, record)
                self.shown = step

    def _show(self, step: int, record: dict[str, Any]) -> None:
        reward = self.rollouts.get(step, {}).get("reward", float("nan"))
        loss = record.get("loss", float("nan"))
        kl = _kl_by_lag(record)
        status = f"reward {reward:.3f}  loss {loss:+.4f}  KL {kl}"
        self.progress.update(self.task, completed=step, status=status)
        logger.info(
            "step %d/%d  reward %.3f  loss %+.4f  KL by policy lag %s  off_policy_kl %.2e  masked %.3f/%.3f"
            "  entropy %.3f  grad_norm %.3f",
            step,
            self.config.max_steps,
            reward,
            loss,
            kl,
            record.get("off_policy_kl", 0.0),
            record.get("masked_low", 0.0),
            record.get("masked_high", 0.0),
            record.get("entropy", 0.0),
            record.get("grad_norm", 0.0),
        )

    def close(self) -> None:
        self.progress.stop()


def _kl_by_lag(record: dict[str, Any]) -> str:
    """`lag0 3.1e-09 lag1 2.2e-03`: the trainer/sampler KL of the lags this step trained on (lag 0 is the pure
    trainer/inference mismatch); `-` when no metric says."""
    parts = []
    for key, value in record.items():
        if isinstance(value, float) and (key == "mismatch_kl" or key.startswith("off_policy_kl/lag")):
            lag = "lag0" if key == "mismatch_kl" else key.removeprefix("off_policy_kl/")
            parts.append(f"{lag} {value:.1e}")
    return " ".join(parts) or "-"
