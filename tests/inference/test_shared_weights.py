"""The `shared` weight transport into a running built-in engine (CPU: POSIX shared memory): a hand-off leaves the
model bit-identical to loading the same policy's directory, and the engine then scores exactly as a fresh one
loaded from it; a server that cannot take the policy fails the trainer with its reason, and a server maps only
a valid handle."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from support.inference import ServerThread
from support.polling import wait_until
from tandem.inference.weights import read_weights
from tandem.models import load_model, save_model
from tandem.transport.weights.control import ControlSender, JoinRequest, WeightTransportError
from tandem.transport.weights.shared import SharedSender
from tandem.wire.protocol import SamplingParams


def _policy(path, seed: int):
    """The model at `path` with every weight moved a little: a policy the engine does not serve yet."""
    model = load_model(path, dtype=torch.float32, device="cpu")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.02)
    return model


def _manifest(model):
    return [(name, param.dtype, tuple(param.shape)) for name, param in model.named_parameters()]


def _join(server: ServerThread, sender) -> None:
    join = JoinRequest(**sender.rendezvous.model_dump(), rank=1, world_size=2)
    assert httpx.post(f"{server.url}/weights/join", json=join.model_dump()).status_code == 202


def _status(server: ServerThread) -> dict:
    return httpx.get(f"{server.url}/weights").json()


def _logprobs(engine, prompt):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    (sample,) = engine.generate([prompt], params)[0]
    return sample.token_ids, sample.logprobs


def test_a_shared_hand_off_equals_loading_the_policy_directory(make_engine, model_dir, tokenizer, tmp_path):
    engine = make_engine()
    server = ServerThread(engine, tokenizer, tmp_path)
    policies = [_policy(model_dir(), seed) for seed in (1, 2)]
    sender = SharedSender(_manifest(policies[0]), torch.device("cpu"), "127.0.0.1", 0, timeout_s=60)
    try:
        _join(server, sender)
        assert sender.connect() == 1
        for version, policy in enumerate(policies, start=1):
            path = tmp_path / f"policy-{version}"
            save_model(policy, path, dtype=torch.float32)
            sender.send(version, (param.detach() for _, param in policy.named_parameters()))
            sender.settle()  # every server serves it
            assert engine.version == version and _status(server)["policy_version"] == version
            loaded = read_weights(path, engine.model)  # the file path's tensors for the same policy
            for name, param in engine.model.named_parameters():
                assert torch.equal(param, loaded[name]), (version, name)
        prompt = tokenizer("the quick brown fox", add_special_tokens=False)["input_ids"]
        fresh = make_engine(path=tmp_path / "policy-2")
        assert _logprobs(engine, prompt) == _logprobs(fresh, prompt)
        sender.close()
        wait_until(lambda: _status(server)["state"] == "stopped", "the server to stop listening")
        assert _status(server)["policies"] == 2
    finally:
        sender.close()
        server.stop()


def test_a_server_refusing_the_layout_fails_the_trainer_naming_it(make_engine, model_dir, tokenizer, tmp_path):
    engine = make_engine()
    server = ServerThread(engine, tokenizer, tmp_path)
    policy = _policy(model_dir(), 1)
    manifest = [(name.replace("norm", "other"), dtype, shape) for name, dtype, shape in _manifest(policy)]
    sender = SharedSender(manifest, torch.device("cpu"), "127.0.0.1", 0, timeout_s=60)
    try:
        _join(server, sender)
        sender.connect()
        sender.send(1, (param.detach() for _, param in policy.named_parameters()))  # returns before the answer
        with pytest.raises(WeightTransportError, match=r"policy 1 \(inference rank 1\): refused: .* different model"):
            sender.send(2, (param.detach() for _, param in policy.named_parameters()))
        wait_until(lambda: _status(server)["state"] == "failed", "the server to report the failure")
        assert "different model" in _status(server)["error"] and engine.version == 0
    finally:
        sender.close()
        server.stop()


@pytest.mark.parametrize(
    "handle",
    [
        {"kind": "posix_shm", "name": "../../etc/passwd", "nbytes": 64},
        {"kind": "posix_shm", "name": "tandem-w-1-0123456789abcdef", "nbytes": 64},  # our pattern, but gone
        {"kind": "pickle", "data": "gASVAAAAAAAAAAA="},
    ],
)
def test_a_server_maps_only_a_valid_handle_and_says_why_not(make_engine, tokenizer, tmp_path, handle):
    server = ServerThread(make_engine(), tokenizer, tmp_path)
    control = ControlSender("shared", "127.0.0.1", 0, timeout_s=30)
    try:
        _join(server, control)
        assert control.wait_for_members() == 2
        control.store.set("buffer/1", json.dumps(handle))
        with pytest.raises(WeightTransportError, match=r"inference rank 1 joining .* cannot map the trainer's shared"):
            control.wait_joined()
        wait_until(lambda: _status(server)["state"] == "failed", "the server to report the failure")
    finally:
        server.stop()
