"""`tandem sft`: supervised fine-tuning on FSDP2.

Run as `tandem sft @ config.toml` (one process, or `--deploy.nproc N` to have it launch torchrun),
or by hand as `torchrun --nproc-per-node N -m tandem.trainer.sft @ config.toml` (multi-node too).
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule

from tandem.checkpoints import checkpoints_root
from tandem.config import ConfigError, load_config, to_toml
from tandem.config.sft import SftConfig, SftSpeedConfig
from tandem.models import ModelArgs
from tandem.run import atomic_write_text, claim_run_dir, exit_code, prepare_run_dir, setup_logging
from tandem.trainer import ckpt
from tandem.trainer.batching import DatasetSteps, FakeSteps, balance, single_documents, stack
from tandem.trainer.data import load_samples, pack, pad_each, read_jsonl
from tandem.trainer.gc_schedule import scheduled_gc
from tandem.trainer.model import build_training_model, export_hf, kernel_options, read_model_args
from tandem.trainer.monitor import Monitor, stop_if_diverged
from tandem.trainer.parallel import World, clip_grad_norm_, init_distributed, shutdown_distributed
from tandem.trainer.schedule import build_optimizer

logger = logging.getLogger(__name__)

# The loss head returns a reshaped (view) tensor that we only reduce, never modify in place.
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")


VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
"""A tokenizer's vocabulary is in one of these. Without any, transformers builds an empty tokenizer from
config.json's model type, and every row would tokenise to unknown tokens."""


def _load_tokenizer(config: SftConfig):
    """The model directory's tokenizer; a missing or unreadable one is a ConfigError naming the directory."""
    from transformers import AutoTokenizer

    source = Path(config.model.name)
    if not any((source / name).is_file() for name in VOCABULARY_FILES):
        raise ConfigError(f"model.name {source} holds no tokenizer (none of {', '.join(VOCABULARY_FILES)})")
    try:
        return AutoTokenizer.from_pretrained(config.model.name)
    except (OSError, ValueError) as error:  # tokenizer files transformers cannot read
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(f"cannot load a tokenizer from model.name {config.model.name}: {first_line}") from None


def _data_file(config: SftConfig) -> Path | None:
    """The local JSONL file `data.path` names, checked to be a file; None for a Hugging Face dataset name
    (anything that is neither an existing path nor a `.jsonl` one)."""
    path = Path(config.data.path)
    if not (path.suffix == ".jsonl" or path.exists()):
        return None
    if not path.exists():
        raise ConfigError(f"data.path {path}: no such file")
    if not path.is_file():
        raise ConfigError(f"data.path {path} is not a file (a JSONL file of prompt/completion or messages rows)")
    return path


@dataclass
class SftInputs:
    """What a run reads, checked before anything is built: the model's architecture, the tokenizer and the
    local data file (None for fake data; `data` is None for a Hugging Face dataset too)."""

    args: ModelArgs
    tokenizer: Any | None
    data: Path | None


def check_inputs(config: SftConfig) -> SftInputs:
    """Every path the run reads (model directory, config.json, weights, tokenizer, data file) checked, and the
    small ones read, before the run directory or the model is touched: a mistake is one ConfigError."""
    args = read_model_args(config)
    if config.data.fake:
        return SftInputs(args, None, None)
    if not config.data.path:
        raise ConfigError("no training data: set data.path (a JSONL file or dataset name) or data.fake = true")
    data = _data_file(config)
    return SftInputs(args, _load_tokenizer(config), data)


def _hf_rows(config: SftConfig):
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            f"data.path {config.data.path!r} is not a local file, and loading it as a Hugging Face dataset "
            "needs `pip install datasets`"
        ) from None
    dataset = datasets.load_dataset(config.data.path, split=config.data.split)
    return ((index + 1, row) for index, row in enumerate(dataset))


def build_steps(config: SftConfig, inputs: SftInputs):
    """The per-step row source: fake random rows, or the tokenised, packed dataset."""
    if config.data.fake:
        return FakeSteps(inputs.args.vocab_size, config.seq_len, config.batch_size, config.seed)
    tokenizer = inputs.tokenizer
    rows = read_jsonl(inputs.data) if inputs.data is not None else _hf_rows(config)
    samples, report = load_samples(rows, tokenizer, config.seq_len, config.data.on_bad_row)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    packed = (pack if config.data.pack else pad_each)(samples, config.seq_len, pad_id)
    logger.info(
        "data: %d samples (%d bad rows skipped) in %d rows of %d tokens (%.0f%% filled)",
        len(samples),
        report.total,
        len(packed),
        config.seq_len,
        100 * sum(r.num_real for r in packed) / (len(packed) * config.seq_len),
    )
    return DatasetSteps(packed, config.batch_size, config.seed)


def _check_split(config: SftConfig, world: World) -> int:
    """Micro-batches per rank per step; the batch must split evenly over ranks and micro-batches."""
    per_rank, remainder = divmod(config.batch_size, world.world_size * config.micro_batch_size)
    if remainder or per_rank == 0:
        raise ConfigError(
            f"batch_size {config.batch_size} must be a multiple of world size {world.world_size} "
            f"x micro_batch_size {config.micro_batch_size}"
        )
    return per_rank


_SDPA = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}


def _sdpa_priority(names: tuple[str, ...]) -> contextlib.AbstractContextManager:
    """SDPA kernels in the given order of preference (read when a block is traced, so compiled blocks too)."""
    if not names:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, _SDPA[name]) for name in names], set_priority=True)


@contextlib.contextmanager
def _sync_check(mode: str, device: torch.device, active: bool):
    """Warn or fail on host-device syncs inside the block; the first step is exempt (it compiles and autotunes)."""
    if mode == "off" or device.type != "cuda" or not active:
        yield
        return
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _model_runtime(speed: SftSpeedConfig, device: torch.device) -> dict:
    kernels = kernel_options(device, rope=speed.rope_kernel, swiglu=speed.swiglu_kernel)
    return {**kernels, "moe_balanced_routing": speed.moe_balanced_routing}


def train(config: SftConfig) -> int:
    inputs = check_inputs(config)
    world = init_distributed()
    micro_steps = _check_split(config, world)
    if world.is_main:
        claim_run_dir(config.run_dir, resume=config.resume.enabled, overwrite=config.overwrite)
        prepare_run_dir(config)
    else:
        setup_logging("warning")
    torch.manual_seed(config.seed)
    steps = build_steps(config, inputs)  # before the model: a bad dataset fails without building it
    speed = config.speed
    model, info = build_training_model(
        config, world, shard=speed.fsdp_single_process, **_model_runtime(speed, world.device)
    )
    optimizer, scheduler = build_optimizer(model, config, fused=speed.fused_optimizer)
    ckpt_root = checkpoints_root(config.run_dir)
    start_step = ckpt.resume_step(config, model, optimizer, scheduler)
    monitor = Monitor(config, world, info, start_step)
    try:
        with scheduled_gc(config.gc_interval) as after_step:
            for step in range(start_step, config.max_steps):
                monitor.start_step()
                after_step(step)  # timed with the step, as torchtitan times its collections
                with _sync_check(speed.sync_debug, world.device, active=step > start_step):
                    batch = steps(step)
                    global_loss_tokens = sum(int(row.loss_mask.sum()) for row in batch)
                    mine = balance(batch, world.world_size)[world.rank]
                    loss_sum = torch.zeros((), device=world.device)
                    for micro in range(micro_steps):
                        rows = mine[micro * config.micro_batch_size : (micro + 1) * config.micro_batch_size]
                        if isinstance(model, FSDPModule):  # not with speed.fsdp_single_process off
                            model.set_requires_gradient_sync(micro == micro_steps - 1)
                        nll = _micro_batch_nll(model, rows, config, world.device)
                        # FSDP averages gradients over ranks; scaling by world size makes the result the sum
                        # over every rank's tokens divided by the global token count, however the batch is split.
                        (nll * (world.world_size / global_loss_tokens)).backward()
                        loss_sum += nll.detach()
                    grad_norm = clip_grad_norm_(model, config.optim.max_grad_norm, optimizer)
                    lr = scheduler.get_last_lr()[0]
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad(set_to_none=True)
                stop_if_diverged(step + 1, world, loss=loss_sum, grad_norm=grad_norm)
                monitor.end_step(
                    step + 1,
                    sums={"loss": loss_sum / global_loss_tokens},
                    values={"grad_norm": grad_norm, "lr": lr, "loss_tokens": global_loss_tokens},
                    real_tokens=sum(r.num_real for r in batch),
                )
                done = step + 1
                if config.ckpt.interval and done % config.ckpt.interval == 0 and done < config.max_steps:
                    ckpt.save_checkpoint(ckpt_root, done, model, optimizer, scheduler, {}, config.ckpt.keep)
                if config.ckpt.hf_interval and done % config.ckpt.hf_interval == 0 and done < config.max_steps:
                    export_hf(model, info, config.run_dir / "hf" / f"step-{done:06d}", world, config.model.dtype)
        if speed.save_final:
            ckpt.save_checkpoint(ckpt_root, config.max_steps, model, optimizer, scheduler, {}, config.ckpt.keep)
            export_hf(model, info, config.run_dir / "hf" / "final", world, config.model.dtype)
    finally:
        monitor.close()
    if world.is_main and speed.save_final:
        logger.info("done: %d steps; Hugging Face checkpoint in %s", config.max_steps, config.run_dir / "hf" / "final")
    del model, optimizer, scheduler
    shutdown_distributed()
    return 0


def _micro_batch_nll(model: torch.nn.Module, rows: list, config: SftConfig, device: torch.device) -> torch.Tensor:
    """Summed NLL of one micro-batch's loss tokens (a scalar to backpropagate)."""
    inputs = stack(rows, device)
    targets = inputs["target_ids"].masked_fill(~inputs["loss_mask"], -100)
    positions = None if single_documents(rows) else inputs["position_ids"]
    with _sdpa_priority(config.speed.sdpa_backends):
        if config.speed.fused_loss:
            return model(
                inputs["input_ids"], positions, targets=targets, chunk_size=config.loss_chunk_size, nll_sum=True
            )
        out = model(
            inputs["input_ids"], positions, targets=targets, chunk_size=config.loss_chunk_size, with_entropy=False
        )
    return -out.logprobs.sum()


def launch(config: SftConfig) -> int:
    """`tandem sft` entry: train in this process, or launch torchrun with `deploy.nproc` processes."""
    if config.deploy.nproc == 1 or "LOCAL_RANK" in os.environ:
        return train(config)
    check_inputs(config)  # one message from here, not one from every rank
    claim_run_dir(config.run_dir, resume=config.resume.enabled, overwrite=config.overwrite)
    resolved = config.run_dir / "sft.toml"  # `overwrite` is not saved: the ranks find only this file and logs
    atomic_write_text(resolved, to_toml(config))
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={config.deploy.nproc}",
        "-m",
        "tandem.trainer.sft",
        "@",
        str(resolved),
    ]
    logging.getLogger("tandem").info("launching: %s", " ".join(command))
    return subprocess.call(command)


def main(argv: list[str] | None = None) -> int:
    """`python -m tandem.trainer.sft @ config.toml [--flags]`, the torchrun entry point."""
    argv = sys.argv[1:] if argv is None else argv
    return exit_code("sft", lambda: train(load_config(SftConfig, argv)[0]))


if __name__ == "__main__":
    sys.exit(main())
