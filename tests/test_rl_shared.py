"""`tandem rl` with the default weight transport: auto picks `shared` for the built-in engine on the trainer's
devices (here the CPU: POSIX shared memory), the servers serve every policy exactly, and what every server has
moved past is pruned."""

from __future__ import annotations

import pytest

from support.jsonl import read_jsonl, read_metrics
from support.runs import tandem_rl, write_rl_sources
from tandem.config import load_config
from tandem.config.rl import RlConfig
from tandem.launch import weight_transport


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], "shared"),  # one machine, devices shared (or none)
        (["--deploy.inference-gpus", "[0]"], "shared"),  # the trainer on CPU: shared memory
        (["--deploy.trainer-gpus", "[0]", "--deploy.inference-gpus", "[0]"], "shared"),  # one GPU, both processes
        (["--deploy.trainer-gpus", "[1]", "--deploy.inference-gpus", "[0]"], "broadcast"),  # NCCL across GPUs
        (["--deploy.trainer-gpus", "[0]"], "file"),  # inference on CPU cannot map the trainer's GPU
        (["--inference.engine", "vllm"], "file"),
        (["--trainer.weights.transport", "broadcast"], "broadcast"),
    ],
)
def test_auto_picks_the_transport_the_deployment_allows(argv, expected):
    assert weight_transport(load_config(RlConfig, argv)[0])[0] == expected


def test_vllm_refuses_an_in_memory_transport():
    with pytest.raises(ValueError, match='transport = "shared" needs the built-in engine'):
        load_config(RlConfig, ["--inference.engine", "vllm", "--trainer.weights.transport", "shared"])


@pytest.mark.slow
def test_rl_hands_each_policy_over_in_shared_memory_and_prunes(tiny_model_dir, tmp_path):
    result = tandem_rl(
        tiny_model_dir("qwen3"), tmp_path, "@", write_rl_sources(tmp_path), "--max-steps", "3",
        "--orchestrator.async-level", "0", "--orchestrator.no-filter-zero-advantage", "--trainer.optim.lr", "1e-2",
        "--orchestrator.eval.interval", "0",
    )  # fmt: skip
    assert "weight transport: shared" in result.stderr
    run_dir = tmp_path / "rl"
    assert 'transport = "shared"' in (run_dir / "trainer.toml").read_text()
    assert 'weight_transport = "shared"' in (run_dir / "orchestrator.toml").read_text()
    trainer, rollouts = read_metrics(run_dir), read_jsonl(run_dir / "orchestrator_metrics.jsonl")
    assert [r["step"] for r in trainer] == [r["step"] for r in rollouts] == [1, 2, 3]
    assert [r["policy_version"] for r in rollouts] == [0, 1, 2]
    # On-policy (async 0): batch N is sampled by policy N-1, the weights the trainer holds at step N. Stale
    # weights labelled with the new version give ~4e-2 here.
    assert all(abs(r["mismatch_kl"]) < 1e-6 for r in trainer), trainer
    log = (run_dir / "logs" / "inference.log").read_text()
    assert "received policy 1 over the shared" in log and "received policy 2 over the shared" in log
    # only the final policy (the run's result) went to disk; the rendezvous is gone
    assert sorted(p.name for p in (run_dir / "policies").iterdir()) == ["step-000003"]
    assert not (run_dir / "weights_rendezvous.json").exists()
    # servers reached policy 2 before batch 3: batches 1 and 2 (trained) were pruned, batch 3 may remain
    assert {p.name for p in (run_dir / "batches").iterdir()} <= {"step-000003.safetensors"}
