"""The orchestrator's loop in-process, for its tests: a config for a tiny model, a fake trainer, a fake admin.

The pool that answers the prompts is each test's own (what it answers is what the test is about); the rest of
an orchestrator run is the same for every test and lives here.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from support.jsonl import read_jsonl
from tandem.config.orchestrator import OrchestratorConfig
from tandem.orchestrator.main import Orchestrator
from tandem.transport.policies import mark_complete, policy_dir


class FakeAdmin:
    """A server's admin routes, as the file follower calls them: records each policy it is told to load."""

    def __init__(self) -> None:
        self.loads: list[tuple[str, int]] = []

    async def request(self, method: str, route: str, body: dict[str, Any] | None = None) -> None:
        if route == "/update_weights":
            assert body is not None
            assert (Path(body["path"]) / "COMPLETE").exists(), f"told to load {body['path']}, which is gone"
            self.loads.append((body["path"], body["version"]))


async def fake_trainer(run_dir: Path, max_steps: int) -> None:
    """Publishes policy N once batch N exists, like the trainer would after training it."""
    for step in range(1, max_steps + 1):
        while not (run_dir / "batches" / f"step-{step:06d}.safetensors").exists():
            await asyncio.sleep(0.01)
        path = policy_dir(run_dir / "policies", step)
        path.mkdir(parents=True)
        mark_complete(path)


def make_config(tmp_path: Path, model_dir: Path, **overrides: Any) -> OrchestratorConfig:
    """Run "run" under `tmp_path` on reverse_text: 4 steps of 2 groups of 4, with `overrides` on top."""
    values = {
        "model": str(model_dir), "seq_len": 256, "batch_size": 8, "group_size": 4, "max_steps": 4,
        "output_dir": str(tmp_path), "run_name": "run", "source": [{"id": "reverse_text"}],
    }  # fmt: skip
    values.update(overrides)
    return OrchestratorConfig.model_validate(values)


def run_orchestrator(config: OrchestratorConfig, pool: Any, with_trainer: bool = True) -> list[dict[str, Any]]:
    """Run the orchestrator on `pool` to `config.max_steps` (with `fake_trainer` publishing policies, unless
    `with_trainer` is off) and return its metrics records."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.model.name)
    pool.tokenizer = tokenizer
    orchestrator = Orchestrator(config, tokenizer, pool)

    async def both() -> None:
        trainer = [fake_trainer(config.run_dir, config.max_steps)] if with_trainer else []
        await asyncio.gather(orchestrator.run(config.resume_step), *trainer)

    asyncio.run(asyncio.wait_for(both(), 60))
    return read_jsonl(config.run_dir / "orchestrator_metrics.jsonl")
