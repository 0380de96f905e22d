"""How the RL trainer hands policy N to inference: a Hugging Face directory, or a broadcast (`[trainer.weights]`).

`file` (default): `<run>/policies/step-<N>/`, marked complete last; the orchestrator has every server load it.
`broadcast`: trainer rank 0 sends the weights to every inference server over torch.distributed
(`tandem.transport.broadcast`), gathered one tensor at a time on the trainer's devices, so neither side holds a
second full copy and nothing touches the disk. The final policy is written as a directory either way: it is the
run's result.
"""

from __future__ import annotations

import logging

import torch

from tandem.config.trainer import TrainerConfig
from tandem.files import atomic_write_text
from tandem.trainer.model import ModelInfo, export_hf
from tandem.trainer.parallel import DTYPES, World, full_shapes, full_tensors
from tandem.transport.broadcast import WeightSender, announce_path
from tandem.transport.policies import mark_complete, policy_dir

logger = logging.getLogger(__name__)


class Publisher:
    """Writes policies as directories; `BroadcastPublisher` sends all but the last one instead."""

    def __init__(self, config: TrainerConfig, world: World, model: torch.nn.Module, info: ModelInfo) -> None:
        self.config, self.world, self.model, self.info = config, world, model, info

    def publish(self, version: int) -> None:
        path = policy_dir(self.config.run_dir / "policies", version)
        export_hf(self.model, self.info, path, self.world, self.config.model.dtype)
        if self.world.is_main:
            mark_complete(path)

    def resumed(self, version: int) -> None:
        """Training continues from checkpoint `version`: its policy directory is still there."""

    def close(self) -> None:
        pass


class BroadcastPublisher(Publisher):
    def __init__(self, config: TrainerConfig, world: World, model: torch.nn.Module, info: ModelInfo) -> None:
        super().__init__(config, world, model, info)
        weights = config.weights
        backend = weights.backend if weights.backend != "auto" else "nccl" if world.device.type == "cuda" else "gloo"
        self.dtype = DTYPES[config.model.dtype]
        self.sender = None
        if world.is_main:
            self.sender = WeightSender(weights.host, weights.port, backend, weights.timeout_s)
            announce = announce_path(config.run_dir)
            atomic_write_text(announce, self.sender.rendezvous.model_dump_json() + "\n")
            logger.info("weight broadcast: waiting for inference servers at %s", announce)
            self.sender.connect()

    def publish(self, version: int) -> None:
        if version == self.config.max_steps:
            super().publish(version)
            return
        manifest = [(name, self.dtype, shape) for name, shape in full_shapes(self.model).items()]
        tensors = (tensor.to(self.dtype) for _, tensor in full_tensors(self.model))  # collective: every rank
        if self.sender is not None:
            self.sender.send(version, manifest, tensors)
        else:
            for _ in tensors:
                pass

    def resumed(self, version: int) -> None:
        """The servers start from the initial weights: send them the checkpoint's policy first."""
        if version:
            self.publish(version)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
            announce_path(self.config.run_dir).unlink(missing_ok=True)


def make_publisher(config: TrainerConfig, world: World, model: torch.nn.Module, info: ModelInfo) -> Publisher:
    cls = BroadcastPublisher if config.weights.transport == "broadcast" else Publisher
    return cls(config, world, model, info)
