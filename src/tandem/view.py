"""The combined live view of `tandem rl`: one progress bar and a line per step, from the children's metric files."""

from __future__ import annotations

import logging
from typing import Any

from tandem.jsonl import JsonlFollower
from tandem.run import step_progress

logger = logging.getLogger(__name__)


class RlProgress:
    def __init__(self, config, start_step: int):
        self.config = config
        self.trainer = JsonlFollower(config.run_dir / "metrics.jsonl")
        self.orchestrator = JsonlFollower(config.run_dir / "orchestrator_metrics.jsonl")
        self.rollouts: dict[int, dict[str, Any]] = {}
        self.progress, self.task = step_progress("rl", config.max_steps, start_step)

    def refresh(self) -> None:
        for record in self.orchestrator.new_records():
            if record.get("kind") == "eval":
                logger.info(
                    "eval at step %d: %s", record["step"], {k: v for k, v in record.items() if k.endswith("/reward")}
                )
            else:
                self.rollouts[record["step"]] = record
        for record in self.trainer.new_records():
            step = record["step"]
            rollout = self.rollouts.get(step, {})
            reward = rollout.get("reward", float("nan"))
            mismatch = record.get("mismatch_kl")
            status = f"reward {reward:.3f}  loss {record['loss']:+.4f}  mismatch {mismatch if mismatch is None else f'{mismatch:.1e}'}"
            self.progress.update(self.task, completed=step, status=status)
            logger.info(
                "step %d/%d  reward %.3f  loss %+.4f  mismatch_kl %s  off_policy_kl %.2e  masked %.3f/%.3f  entropy %.3f"
                "  grad_norm %.3f",
                step,
                self.config.max_steps,
                reward,
                record["loss"],
                "n/a" if mismatch is None else f"{mismatch:.2e}",
                record.get("off_policy_kl", 0.0),
                record.get("masked_low", 0.0),
                record.get("masked_high", 0.0),
                record.get("entropy", 0.0),
                record.get("grad_norm", 0.0),
            )

    def close(self) -> None:
        self.progress.stop()
