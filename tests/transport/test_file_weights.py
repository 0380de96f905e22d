"""The file weight transport's trainer end on resume: a checkpoint's policy the orchestrator pruned is written
again, one still there is not; pruning keeps the served policy and everything newer."""

from __future__ import annotations

import torch

from tandem.transport.policies import latest_policy, mark_complete, policy_dir, prune_policies
from tandem.transport.weights.base import PolicySource
from tandem.transport.weights.file import FilePublisher


def _publisher(run_dir, exported):
    def export(version):
        path = policy_dir(run_dir / "policies", version)
        path.mkdir(parents=True)
        mark_complete(path)
        exported.append(version)

    source = PolicySource(run_dir, 10, True, torch.device("cpu"), [], lambda: iter(()), export)
    return FilePublisher(source)


def test_resuming_rewrites_a_pruned_checkpoint_policy_only(tmp_path):
    exported: list[int] = []
    publisher = _publisher(tmp_path, exported)
    for version in (1, 2, 3):
        publisher.publish(version)
    assert prune_policies(tmp_path / "policies", served=3) == [1, 2]
    assert latest_policy(tmp_path / "policies") == 3
    publisher.resumed(2)  # checkpoint 2: its policy is gone, the servers of a fresh run need it
    publisher.resumed(3)  # still there
    publisher.resumed(0)  # the initial weights: the servers start from them
    assert exported == [1, 2, 3, 2]
    assert (policy_dir(tmp_path / "policies", 2) / "COMPLETE").exists()


def test_pruning_keeps_the_served_policy_and_newer(tmp_path):
    root = tmp_path / "policies"
    for version in (1, 4, 5, 6):
        policy_dir(root, version).mkdir(parents=True)
    (root / ".step-000007.tmp-abc").mkdir()  # a save in progress
    assert prune_policies(root, served=5) == [1, 4]
    assert sorted(p.name for p in root.iterdir()) == [".step-000007.tmp-abc", "step-000005", "step-000006"]


def test_the_final_policy_prunes_every_older_one(tmp_path):
    """The orchestrator prunes only up to what every server serves and stops before the last policies: writing
    the final one leaves it alone in `policies/`, as the in-memory kinds do (`publish_final`)."""
    exported: list[int] = []
    publisher = _publisher(tmp_path, exported)
    for version in (7, 8, 9, 10):  # 10 is the final policy (max_steps)
        publisher.publish(version)
    assert sorted(p.name for p in (tmp_path / "policies").iterdir()) == ["step-000010"]
    assert exported == [7, 8, 9, 10]
