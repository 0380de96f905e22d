"""`tandem rl` on a verifiers environment: verifiers' own harness samples through the orchestrator, the reward of
a verifiers taskset rises, and the trainer scores every trained token exactly as the engine sampled it."""

from __future__ import annotations

import pytest

from support.jsonl import read_jsonl
from support.runs import reward_trend, tandem_rl
from support.verifiers_envs import QWEN3_MARKERS, on_path

pytest.importorskip("verifiers.v1", reason="needs the verifiers extra")
pytestmark = pytest.mark.slow

SOURCES = """
[[orchestrator.source]]
id = "vf_letters"
sampling = { temperature = 1.0, max_tokens = 12 }
[orchestrator.source.verifiers]
renderer = { name = "qwen3", enable_thinking = false }
[orchestrator.source.verifiers.env.agent]
harness = { id = "null" }
runtime = { type = "subprocess" }

[orchestrator.eval]
interval = 10
at_start = true
[[orchestrator.eval.source]]
id = "vf_letters"
select = { limit = 4 }
sampling = { temperature = 0.0, max_tokens = 12 }
[orchestrator.eval.source.verifiers.env.agent]
harness = { id = "null" }
runtime = { type = "subprocess" }
"""


def test_rl_on_a_verifiers_env_raises_its_reward_on_the_engines_own_tokens(tiny_model_dir, tmp_path, monkeypatch):
    on_path(monkeypatch)
    sources = tmp_path / "sources.toml"
    sources.write_text(SOURCES)
    tandem_rl(
        tiny_model_dir("qwen3", extra_special=QWEN3_MARKERS), tmp_path, "@", str(sources), "--max-steps", "20",
        "--orchestrator.batch-size", "32", "--orchestrator.group-size", "8", "--trainer.optim.lr", "3e-3",
        "--orchestrator.async-level", "0",
    )  # fmt: skip
    first, last, rewards, trainer = reward_trend(tmp_path / "rl", 20)
    # Measured 0.086 -> 0.155 on 2 CPU cores (batch-to-batch noise ~0.01).
    assert last > first + 0.04, rewards
    # async_level 0: every token is scored by the weights that sampled it, in the very context it was sampled in.
    assert all(abs(r["mismatch_kl"]) < 1e-6 for r in trainer), [r["mismatch_kl"] for r in trainer]
    # online evals of the same env (greedy, through verifiers' eval client and the servers' chat route)
    evals = [r for r in read_jsonl(tmp_path / "rl" / "orchestrator_metrics.jsonl") if r.get("kind") == "eval"]
    assert [e["step"] for e in evals] == [0, 10, 20]
    for evaluation in evals:
        assert evaluation["eval/vf_letters/ok"] + evaluation["eval/vf_letters/truncated"] == 4, evaluation
        assert 0.0 <= evaluation["eval/vf_letters/reward"] <= 1.0
