"""benchmarks/rl_learning.py --smoke: the GPU learning run's every part (prepare, SFT from scratch on mixed answers,
RL with held-out evals, the summary) at a tiny size on CPU."""

from __future__ import annotations

import json
import subprocess
import sys

from support.paths import REPO


def test_the_learning_benchmark_runs_end_to_end(tmp_path):
    out = tmp_path / "out"
    command = [sys.executable, str(REPO / "benchmarks" / "rl_learning.py"), "--smoke", "--out-dir", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / "results.json").read_text())
    assert [step for step, _ in result["held_out"]] == [0, 2, 4]
    assert all(0.0 <= reward <= 1.0 for _, reward in result["held_out"])
    assert len(result["rl_train_reward"]) == 4 and result["rl_step_s"] > 0
    assert "held-out greedy reward" in done.stdout
