"""The weight broadcast over gloo between processes: whole policies arrive, and a dead or silent peer is an error
within the timeout, on either end, never a hang."""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import signal
import time

import pytest
import torch

from tandem.transport.weights.broadcast import BroadcastReceiver, BroadcastSender
from tandem.transport.weights.control import JoinRequest, WeightTransportError

# Peers fork from a server that has imported torch once (the test process itself is never forked).
multiprocessing.forkserver.set_forkserver_preload(["torch", "tandem.transport.weights.broadcast"])
CTX = multiprocessing.get_context("forkserver")
SHAPES = {"embed_tokens.weight": (64, 16), "layers.0.mlp.experts.gate_up_proj": (4, 8, 16), "norm.weight": (16,)}


def _policy(version: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(version)
    return {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}


def _manifest(dtype=torch.float32):
    return [(name, dtype, shape) for name, shape in SHAPES.items()]


def _receive(join: dict, dtype: torch.dtype, out: str, behaviour: str) -> None:
    """A server's end: receive every offered policy into `dtype` weights, save each to `out`."""
    from safetensors.torch import save_file

    receiver = BroadcastReceiver(JoinRequest(**join))
    receiver.connect()
    targets = {name: torch.zeros(shape, dtype=dtype) for name, shape in SHAPES.items()}
    if behaviour == "other model":
        targets["lm_head.weight"] = targets.pop("norm.weight")
    while (offer := receiver.next_offer(lambda: True)) is not None:
        problem = receiver.check(offer, targets)
        if problem:
            receiver.control.answer("ready", offer, problem)
            return
        if behaviour in ("die", "stop"):
            receiver.control.answer("ready", offer)  # say yes, then never take part
            os.kill(os.getpid(), signal.SIGKILL if behaviour == "die" else signal.SIGSTOP)
        receiver.receive(offer, targets)
        save_file({k: v.contiguous() for k, v in targets.items()}, f"{out}-{offer.version}.safetensors")
        receiver.acknowledge(offer)


def _start_receivers(sender: BroadcastSender, tmp_path, dtypes, behaviour="ok"):
    processes = []
    for rank, dtype in enumerate(dtypes, start=1):
        join = {**sender.rendezvous.model_dump(), "rank": rank, "world_size": len(dtypes) + 1}
        process = CTX.Process(target=_receive, args=(join, dtype, str(tmp_path / f"rank{rank}"), behaviour))
        process.start()
        processes.append(process)
    return processes


def _reap(processes) -> None:
    for process in processes:
        if process.is_alive():
            os.kill(process.pid, signal.SIGKILL)
        process.join(30)


def test_every_server_gets_each_policy_whole_and_in_order(tmp_path):
    from safetensors.torch import load_file

    sender = BroadcastSender("127.0.0.1", 0, "gloo", timeout_s=60)
    receivers = _start_receivers(sender, tmp_path, [torch.float32, torch.bfloat16])  # in place; through staging
    try:
        assert sender.connect() == 2
        for version in (1, 2):
            sender.send(version, _manifest(), iter(_policy(version).values()))
        sender.close()  # receivers see the end of the broadcast and stop
        for process in receivers:
            process.join(30)
            assert process.exitcode == 0
    finally:
        _reap(receivers)
    for version in (1, 2):
        sent = _policy(version)
        for name, tensor in load_file(tmp_path / f"rank1-{version}.safetensors").items():
            assert torch.equal(tensor, sent[name]), (version, name)
        for name, tensor in load_file(tmp_path / f"rank2-{version}.safetensors").items():
            assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, sent[name].to(torch.bfloat16))


@pytest.mark.parametrize("behaviour", ["die", "stop"])
def test_a_server_that_dies_or_stops_answering_fails_the_trainer_within_the_timeout(tmp_path, behaviour):
    timeout = 3.0
    sender = BroadcastSender("127.0.0.1", 0, "gloo", timeout_s=60)
    receivers = _start_receivers(sender, tmp_path, [torch.float32], behaviour)
    try:
        sender.connect()  # joining may take a process start; the sending is what this test times
        sender.timeout_s = timeout
        started = time.monotonic()
        with pytest.raises(WeightTransportError, match=r"sending policy 1: .*(did not answer within 3s|failed)"):
            sender.send(1, _manifest(), iter(_policy(1).values()))
        assert time.monotonic() - started < timeout + 2
        sender.close()
    finally:
        _reap(receivers)


def test_a_server_with_another_model_refuses_with_its_reason(tmp_path):
    sender = BroadcastSender("127.0.0.1", 0, "gloo", timeout_s=30)
    receivers = _start_receivers(sender, tmp_path, [torch.float32], "other model")
    try:
        sender.connect()
        with pytest.raises(WeightTransportError, match=r"rank 1\): refused: policy 1 holds a different model.*norm"):
            sender.send(1, _manifest(), iter(_policy(1).values()))
    finally:
        sender.close()
        _reap(receivers)


def _send_then_die(port_file: str) -> None:
    sender = BroadcastSender("127.0.0.1", 0, "gloo", timeout_s=30)
    with open(port_file + ".tmp", "w") as handle:
        handle.write(str(sender.rendezvous.port))
    os.replace(port_file + ".tmp", port_file)
    sender.connect()
    tensors = iter(_policy(1).values())

    def first_then_die():
        yield next(tensors)
        os.kill(os.getpid(), signal.SIGKILL)
        yield from tensors

    sender.send(1, _manifest(), first_then_die())


def test_a_server_whose_trainer_dies_mid_policy_fails_within_the_timeout(tmp_path):
    port_file = tmp_path / "port"
    trainer = CTX.Process(target=_send_then_die, args=(str(port_file),))
    trainer.start()
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            assert time.monotonic() < deadline and trainer.is_alive()
            time.sleep(0.05)
        join = JoinRequest(
            kind="broadcast",
            host="127.0.0.1",
            port=int(port_file.read_text()),
            backend="gloo",
            timeout_s=3.0,
            rank=1,
            world_size=2,
        )
        receiver = BroadcastReceiver(join)
        receiver.connect()
        offer = receiver.next_offer(lambda: True)
        targets = {name: torch.zeros(shape) for name, shape in SHAPES.items()}
        assert receiver.check(offer, targets) is None
        started = time.monotonic()
        with pytest.raises(WeightTransportError, match="receiving policy 1"):
            receiver.receive(offer, targets)
        assert time.monotonic() - started < join.timeout_s + 2
        receiver.close()
    finally:
        _reap([trainer])


def test_no_server_joining_is_an_error_within_the_timeout():
    sender = BroadcastSender("127.0.0.1", 0, "gloo", timeout_s=0.5)
    started = time.monotonic()
    with pytest.raises(WeightTransportError, match=r"waiting for inference servers to join .* no answer within 0.5s"):
        sender.connect()
    assert time.monotonic() - started < 3
