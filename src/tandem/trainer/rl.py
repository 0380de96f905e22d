"""`tandem trainer`: the RL trainer. Step N reads batch N from the orchestrator, trains, publishes policy N.

Run alone as `tandem trainer @ trainer.toml` or under torchrun
(`torchrun --nproc-per-node N -m tandem.trainer.rl @ trainer.toml`); `tandem rl` starts it for you.
"""

from __future__ import annotations

import logging
import sys
import time
import warnings

import torch

from tandem.checkpoints import checkpoints_root
from tandem.config import load_config
from tandem.config.trainer import TrainerConfig
from tandem.run import exit_code, prepare_run_dir, setup_logging
from tandem.trainer import ckpt
from tandem.trainer.gc_schedule import scheduled_gc
from tandem.trainer.loss import LossInputs, k3, policy_loss
from tandem.trainer.model import build_training_model
from tandem.trainer.monitor import Monitor, stop_if_diverged
from tandem.trainer.parallel import clip_grad_norm_, init_distributed, shutdown_distributed
from tandem.trainer.publish import make_publisher
from tandem.trainer.schedule import build_optimizer
from tandem.transport.batches import kept_ids_matrix, read_batch, wait_for_batch

logger = logging.getLogger(__name__)

warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")


def micro_batch_loss(
    model, micro: dict[str, torch.Tensor], config: TrainerConfig, device: torch.device, current_version: int
):
    """Forward one micro-batch: trainer logprobs under the rollouts' temperatures and sampling masks, then the loss.

    Tokens sampled by exactly the weights the trainer holds (`current_version`) measure the pure
    trainer/inference mismatch (`mismatch_kl`); over all tokens the same estimator also includes the
    policy lag of asynchronous sampling (`off_policy_kl`).
    """
    kept = None
    if "kept_counts" in micro and micro["kept_ids"].numel():  # sampling masks, stored compactly (transport.batches)
        kept = kept_ids_matrix(micro["kept_counts"], micro["kept_ids"], model.args.vocab_size, device)
    micro = {name: tensor.to(device) for name, tensor in micro.items() if not name.startswith("kept_")}
    loss_tokens = micro["target_ids"] != -100
    out = model(
        micro["input_ids"],
        micro["position_ids"],
        targets=micro["target_ids"],
        temperature=micro["temperatures"],
        kept_ids=kept,
        chunk_size=config.loss_chunk_size,
    )
    inputs = LossInputs(
        logprobs=out.logprobs[loss_tokens],
        inference_logprobs=micro["inference_logprobs"][loss_tokens],
        advantages=micro["advantages"][loss_tokens],
        weights=micro["loss_weights"][loss_tokens],
        entropy=out.entropy[loss_tokens] if out.entropy is not None else None,
    )
    loss, metrics = policy_loss(config.loss, inputs)
    with torch.no_grad():
        on_policy = (micro["versions"][loss_tokens] == current_version) * inputs.weights
        metrics["off_policy_kl"] = metrics.pop("mismatch_kl")
        metrics["mismatch_kl_sum"] = (on_policy * k3(inputs.logprobs - inputs.inference_logprobs)).sum()
        metrics["on_policy_weight"] = on_policy.sum()
        metrics["loss_tokens"] = loss_tokens.sum().float()
    return loss, metrics


def train(config: TrainerConfig) -> int:
    world = init_distributed()
    if world.is_main:
        prepare_run_dir(config, "trainer")
    else:
        setup_logging("warning")
    torch.manual_seed(config.seed)
    model, info = build_training_model(config, world)
    optimizer, scheduler = build_optimizer(model, config)
    run_dir = config.run_dir
    ckpt_root, batches = checkpoints_root(run_dir), run_dir / "batches"
    start_step = ckpt.resume_step(config, model, optimizer, scheduler)
    publisher = make_publisher(config, world, model, info)
    publisher.resumed(start_step)
    monitor = Monitor(config, world, info, start_step)
    try:
        with scheduled_gc(config.gc_interval) as after_step:
            for step in range(start_step + 1, config.max_steps + 1):
                waiting = time.monotonic()
                wait_for_batch(batches, step, config.batch_timeout_s)
                idle_s = time.monotonic() - waiting  # trainer idle time: waiting for the orchestrator
                monitor.start_step()
                after_step(step - 1)  # timed with the step, as torchtitan times its collections
                micros, header = read_batch(batches, step, world.rank, world.world_size)
                sums: dict[str, torch.Tensor] = {}
                for index, micro in enumerate(micros):
                    model.set_requires_gradient_sync(index == len(micros) - 1)
                    loss, metrics = micro_batch_loss(model, micro, config, world.device, current_version=step - 1)
                    # Weights already sum to 1 over the whole batch; FSDP averages over ranks, so undo that.
                    (loss * world.world_size).backward()
                    for name, value in {"loss": loss.detach(), **metrics}.items():
                        sums[name] = sums.get(name, 0) + value
                grad_norm = clip_grad_norm_(model, config.optim.max_grad_norm, optimizer)
                lr = scheduler.get_last_lr()[0]
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                stop_if_diverged(step, world, loss=sums["loss"], grad_norm=grad_norm)
                publisher.publish(step)
                monitor.end_step(
                    step,
                    sums=sums,
                    values={
                        "grad_norm": grad_norm,
                        "lr": lr,
                        "samples": header.get("num_samples", 0),
                        "idle_s": idle_s,
                    },
                    real_tokens=header.get("num_tokens", 0),
                    ratios={"mismatch_kl": ("mismatch_kl_sum", "on_policy_weight")},
                )
                if config.ckpt.interval and step % config.ckpt.interval == 0:
                    ckpt.save_checkpoint(ckpt_root, step, model, optimizer, scheduler, {}, config.ckpt.keep)
    finally:
        monitor.close()
        publisher.close()
    del model, optimizer, scheduler, publisher
    shutdown_distributed()
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m tandem.trainer.rl @ trainer.toml`, the torchrun entry point."""
    argv = sys.argv[1:] if argv is None else argv
    return exit_code("trainer", lambda: train(load_config(TrainerConfig, argv)[0]))


if __name__ == "__main__":
    sys.exit(main())
