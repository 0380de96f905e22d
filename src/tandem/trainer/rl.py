"""`tandem trainer`: the RL trainer. Step N reads batch N from the orchestrator, trains, publishes policy N.

Run alone as `tandem trainer @ trainer.toml` or under torchrun
(`torchrun --nproc-per-node N -m tandem.trainer.rl @ trainer.toml`); `tandem rl` starts it for you.
"""

from __future__ import annotations

import logging
import sys
import time
import warnings
from collections.abc import Callable

import torch

from tandem.config import load_config
from tandem.config.trainer import TrainerConfig
from tandem.images import PixelEncoder
from tandem.models.decoder import Images
from tandem.models.heads import Logprobs
from tandem.models.logprobs import IGNORE_INDEX
from tandem.run import exit_code, prepare_run_dir, setup_logging
from tandem.trainer import ckpt
from tandem.trainer.fused_loss import FusedPolicyLoss, PolicyLoss, PolicyTokens
from tandem.trainer.loop import Recipe, StepBatch, build_training, run_steps, to_device
from tandem.trainer.loss import LossInputs, k3, policy_loss
from tandem.trainer.monitor import Monitor
from tandem.trainer.parallel import World, init_distributed, shutdown_distributed
from tandem.trainer.publish import make_publisher
from tandem.transport.batches import (
    IMAGE_MASK,
    IMAGE_REFS,
    IMAGE_SIZES,
    KEPT_COUNTS,
    KEPT_IDS_FLAT,
    kept_matrix_from_csr,
    read_batch,
    unpack_refs,
    wait_for_batch,
)

logger = logging.getLogger(__name__)

warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")


def policy_tokens(micro: dict[str, torch.Tensor], kept_matrix: torch.Tensor | None) -> PolicyTokens:
    """The micro-batch's per-token loss inputs, flat `[T]`, over every position: off the loss tokens the weight,
    advantage and inference logprob are 0 (the trainer's logprob is 0 there too), so such a position adds exactly
    0 to the loss, its gradient and every metric, and nothing is indexed by a mask (no host sync)."""
    targets = micro["target_ids"].reshape(-1)
    on = targets != IGNORE_INDEX
    zero = torch.zeros((), device=targets.device)
    return PolicyTokens(
        targets=targets,
        temperatures=micro["temperatures"].reshape(-1),
        kept_matrix=kept_matrix.reshape(targets.numel(), -1) if kept_matrix is not None else None,
        inference_logprobs=torch.where(on, micro["inference_logprobs"].reshape(-1), zero),
        advantages=torch.where(on, micro["advantages"].reshape(-1), zero),
        weights=torch.where(on, micro["loss_weights"].reshape(-1), zero),
    )


LAGS = 4
"""Policy lags the KL is split by: 0, 1, 2, and 3 or more (a fixed set, so every rank sums the same metrics)."""
LAG_NAMES = ("mismatch_kl", *(f"off_policy_kl/lag{lag}" for lag in range(1, LAGS - 1)), f"off_policy_kl/lag{LAGS - 1}+")


def micro_batch_loss(
    model,
    micro: dict[str, torch.Tensor],
    config: TrainerConfig,
    device: torch.device,
    current_version: int,
    pixels: PixelEncoder | None = None,
):
    """Forward one micro-batch: trainer logprobs under the rollouts' temperatures and kept ids, then the loss.

    The KL estimate between trainer and sampler is split by each token's policy lag (the weights the trainer
    holds, `current_version`, minus the version that sampled it): at lag 0 it is the pure trainer/inference
    mismatch (`mismatch_kl`), at lag k it adds k optimizer steps of policy drift (`off_policy_kl/lag<k>`); over
    all tokens it is `off_policy_kl`. A vision-language model's images are read from the micro-batch's image
    references (`pixels`: the model's image processor) and processed here, as the server processed them.
    """
    kept_matrix = None
    if KEPT_COUNTS in micro and micro[KEPT_IDS_FLAT].numel():  # kept ids, stored as CSR (transport.batches)
        kept_matrix = kept_matrix_from_csr(micro[KEPT_COUNTS], micro[KEPT_IDS_FLAT], model.args.vocab_size, device)
    images = None
    if IMAGE_REFS in micro and micro[IMAGE_SIZES].numel():
        if pixels is None:
            raise ValueError("the batch has images, but the trainer's model takes none")
        pixel_values, grid_thw = pixels.encode(unpack_refs(micro[IMAGE_REFS], micro[IMAGE_SIZES]))
        images = Images(pixel_values.to(device), grid_thw.to(device), to_device(micro[IMAGE_MASK], device))
    skip = (KEPT_COUNTS, KEPT_IDS_FLAT, IMAGE_REFS, IMAGE_SIZES, IMAGE_MASK)
    micro = {name: to_device(tensor, device) for name, tensor in micro.items() if name not in skip}
    tokens = policy_tokens(micro, kept_matrix)
    loss, metrics, logprobs = _policy_loss(model, micro, tokens, config, images)
    with torch.no_grad():
        metrics["off_policy_kl"] = metrics.pop("mismatch_kl")
        lag = (current_version - micro["versions"].reshape(-1)).clamp(0, LAGS - 1)
        kl = k3(logprobs - tokens.inference_logprobs)
        for k, name in enumerate(LAG_NAMES):
            at_lag = (lag == k) * tokens.weights
            metrics[f"{name}_sum"] = (at_lag * kl).sum()
            metrics[f"{name}_weight"] = at_lag.sum()
        metrics["loss_tokens"] = (tokens.targets != IGNORE_INDEX).sum().float()
    return loss, metrics


def _policy_loss(
    model, micro: dict[str, torch.Tensor], tokens: PolicyTokens, config: TrainerConfig, images: Images | None = None
) -> PolicyLoss:
    """The micro-batch's loss, metrics and detached trainer logprobs `[T]`: fused into the model's head
    (`speed.fused_loss`), or the chunked logprobs then `policy_loss`."""
    chunk_size = config.loss_chunk_size
    if config.speed.fused_loss:
        head = FusedPolicyLoss(tokens, config.loss, chunk_size)
        return model(micro["input_ids"], micro["position_ids"], images=images, head=head)
    targets, kept_matrix = micro["target_ids"], tokens.kept_matrix
    head = Logprobs(
        targets,
        temperature=micro["temperatures"],
        kept_matrix=kept_matrix.view(*targets.shape, -1) if kept_matrix is not None else None,
        chunk_size=chunk_size,
    )
    out = model(micro["input_ids"], micro["position_ids"], images=images, head=head)
    logprobs = out.logprobs.reshape(-1)
    inputs = LossInputs(
        logprobs=logprobs,
        inference_logprobs=tokens.inference_logprobs,
        advantages=tokens.advantages,
        weights=tokens.weights,
        entropy=out.entropy.reshape(-1) if out.entropy is not None else None,
    )
    loss, metrics = policy_loss(config.loss, inputs)
    return PolicyLoss(loss, metrics, logprobs.detach())


class RlRecipe(Recipe):
    """Batch N from the orchestrator in, the policy loss out; policy N published after the optimizer step."""

    ratios = {name: (f"{name}_sum", f"{name}_weight") for name in LAG_NAMES}  # noqa: RUF012 (read only)

    def __init__(
        self, config: TrainerConfig, world: World, publish: Callable[[int], None], pixels: PixelEncoder | None = None
    ) -> None:
        self.config, self.world, self.publish, self.pixels = config, world, publish, pixels
        self.batches = config.run_dir / "batches"

    def wait(self, step: int) -> dict[str, float]:
        waiting = time.monotonic()
        wait_for_batch(self.batches, step, self.config.batch_timeout_s)
        return {"idle_s": time.monotonic() - waiting}  # trainer idle time: waiting for the orchestrator

    def batch(self, step: int) -> StepBatch:
        micros, header = read_batch(self.batches, step, self.world.rank, self.world.world_size)
        return StepBatch(step, micros, header.get("num_tokens", 0), {"samples": header.get("num_samples", 0)})

    def loss(self, model: torch.nn.Module, micro: dict, batch: StepBatch) -> tuple[torch.Tensor, dict]:
        # Weights sum to 1 over the whole batch: each micro-batch's loss is its share already.
        version = batch.step - 1
        return micro_batch_loss(model, micro, self.config, self.world.device, version, self.pixels)

    def after_update(self, step: int) -> dict[str, float]:
        start = time.monotonic()
        self.publish(step)
        return {"publish_s": time.monotonic() - start}  # the hand-off's wall time on the trainer


def train(config: TrainerConfig) -> int:
    world = init_distributed()
    if world.is_main:
        prepare_run_dir(config, "trainer")
    else:
        setup_logging("warning")
    torch.manual_seed(config.seed)
    training = build_training(config, world)
    start_step = ckpt.resume_step(config, training.model, training.optimizer, training.scheduler)
    publisher = make_publisher(config, world, training.model, training.info)
    publisher.resumed(start_step)
    monitor = Monitor(config, world, training.info, start_step)
    try:
        pixels = PixelEncoder(config.model.name) if training.info.args.vision_config is not None else None
        recipe = RlRecipe(config, world, publisher.publish, pixels)
        run_steps(config, world, training, recipe, start_step, monitor)
    finally:
        monitor.close()
        publisher.close()
    del training, publisher
    shutdown_distributed()
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m tandem.trainer.rl @ trainer.toml`, the torchrun entry point."""
    argv = sys.argv[1:] if argv is None else argv
    return exit_code("trainer", lambda: train(load_config(TrainerConfig, argv)[0]))


if __name__ == "__main__":
    sys.exit(main())
