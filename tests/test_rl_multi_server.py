"""`tandem rl` over several devices and servers: the environment each child gets, and two CPU inference servers fed
by the trainer's weight broadcast, end to end."""

from __future__ import annotations

import pytest

from support.jsonl import read_jsonl, read_metrics
from support.runs import tandem_rl
from tandem.config.rl import RlConfig, RlDeployConfig
from tandem.launch import child_envs, server_configs


def test_each_child_sees_only_its_gpus():
    split = RlDeployConfig(trainer_gpus=[1, 2], inference_gpus=[0, 3], inference_servers=2)
    assert split.trainer_nproc == 2  # one trainer process per trainer GPU
    assert child_envs(split, {}) == {
        "trainer": {"CUDA_VISIBLE_DEVICES": "1,2"},
        "inference-0": {"CUDA_VISIBLE_DEVICES": "0"},
        "inference-1": {"CUDA_VISIBLE_DEVICES": "3"},
        "orchestrator": {"CUDA_VISIBLE_DEVICES": ""},
    }
    # inference on GPU 0, a CPU trainer: the trainer must not see the GPU (it would pick it up)
    assert child_envs(RlDeployConfig(inference_gpus=[0]), {})["trainer"] == {"CUDA_VISIBLE_DEVICES": ""}
    assert child_envs(RlDeployConfig(trainer_gpus=[0]), {})["inference"] == {"CUDA_VISIBLE_DEVICES": ""}
    # no GPUs named: everything shares what there is; on CPU one thread each unless the user chose
    assert child_envs(RlDeployConfig(), {}) == {
        "trainer": {"OMP_NUM_THREADS": "1"},
        "inference": {"OMP_NUM_THREADS": "1"},
        "orchestrator": {"CUDA_VISIBLE_DEVICES": ""},
    }
    assert child_envs(RlDeployConfig(), {"OMP_NUM_THREADS": "4"})["trainer"] == {}
    with pytest.raises(ValueError, match="trainer_nproc 3 does not match the 2 trainer_gpus"):
        RlDeployConfig(trainer_gpus=[0, 1], trainer_nproc=3)
    with pytest.raises(ValueError, match="do not split evenly over 2 inference_servers"):
        RlDeployConfig(inference_gpus=[0, 1, 2], inference_servers=2)


def test_several_servers_keep_their_own_run_files(tmp_path):
    config = RlConfig.model_validate(
        {"output_dir": str(tmp_path), "run_name": "rl", "deploy": {"inference_servers": 2}}
    )
    servers = server_configs(config)
    assert list(servers) == ["inference-0", "inference-1"]
    assert [s.run_dir for s in servers.values()] == [tmp_path / "rl" / "servers" / f"inference-{k}" for k in (0, 1)]
    assert all(s.weights_dir == tmp_path for s in servers.values())  # policies under <run>/policies stay loadable
    single = server_configs(RlConfig.model_validate({"output_dir": str(tmp_path), "run_name": "rl"}))
    assert single["inference"].run_dir == tmp_path / "rl"


@pytest.mark.slow
def test_two_servers_fed_by_the_weight_broadcast_serve_every_policy_exactly(tiny_model_dir, tmp_path):
    sources = tmp_path / "sources.toml"
    sources.write_text('[[orchestrator.source]]\nid = "reverse_text"\nsampling = { max_tokens = 16 }\n')
    tandem_rl(
        tiny_model_dir("qwen3"), tmp_path, "@", str(sources), "--max-steps", "3", "--orchestrator.async-level", "0",
        "--orchestrator.no-filter-zero-advantage", "--trainer.optim.lr", "1e-2", "--deploy.inference-servers", "2",
        "--trainer.weights.transport", "broadcast", "--trainer.weights.timeout-s", "60",
    )  # fmt: skip
    run_dir = tmp_path / "rl"
    trainer, rollouts = read_metrics(run_dir), read_jsonl(run_dir / "orchestrator_metrics.jsonl")
    assert [r["step"] for r in trainer] == [r["step"] for r in rollouts] == [1, 2, 3]
    assert [r["policy_version"] for r in rollouts] == [0, 1, 2]
    # On-policy (async 0), batch N is sampled by policy N-1, which the trainer holds at step N: the servers
    # hold exactly the trainer's weights. (Stale weights labelled with the new version give ~4e-2 here.)
    assert all(abs(r["mismatch_kl"]) < 1e-6 for r in trainer), trainer
    assert min(rollouts[-1]["inference_requests"]) > 0  # both servers sampled rollouts
    for k in (0, 1):
        log = (run_dir / "servers" / f"inference-{k}" / "logs" / "inference.log").read_text()
        assert f"as rank {k + 1}" in log
        assert "received policy 1 over the broadcast" in log and "received policy 2 over the broadcast" in log
    # nothing but the final policy (the run's result) went to disk, and the rendezvous is gone
    assert sorted(p.name for p in (run_dir / "policies").iterdir()) == ["step-000003"]
    assert (run_dir / "policies" / "step-000003" / "COMPLETE").exists()
    assert not (run_dir / "weight_broadcast.json").exists()
    assert 'weight_transport = "broadcast"' in (run_dir / "orchestrator.toml").read_text()  # tandem rl wired it
