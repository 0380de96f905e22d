"""`tandem sft`: supervised fine-tuning on FSDP2.

Run as `tandem sft @ config.toml` (one process, or `--deploy.nproc N` to have it launch torchrun),
or by hand as `torchrun --nproc-per-node N -m tandem.trainer.sft @ config.toml` (multi-node too).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tandem.config import ConfigError, load_config, to_toml
from tandem.config.sft import SftConfig
from tandem.files import atomic_write_text
from tandem.images import ImageError, PixelEncoder
from tandem.models import ModelArgs
from tandem.models.decoder import Images
from tandem.models.heads import Logprobs, NllSum
from tandem.run import claim_run_dir, exit_code, prepare_run_dir, setup_logging
from tandem.trainer import ckpt
from tandem.trainer.batching import DatasetSteps, FakeSteps, balance_rows, single_documents, stack
from tandem.trainer.data import VisionTokens, load_samples, pack, pad_each, read_jsonl
from tandem.trainer.dataset import load_hf_dataset, local_data_file
from tandem.trainer.loop import Recipe, StepBatch, build_training, run_steps
from tandem.trainer.model import export_hf, read_model_args
from tandem.trainer.monitor import Monitor
from tandem.trainer.parallel import World, init_distributed, shutdown_distributed

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


@dataclass
class SftInputs:
    """What a run reads, checked before anything is built: the model's architecture, the tokenizer, and the
    local JSONL file (`data`) or the loaded Hugging Face dataset (`dataset`); all but `args` None for fake data."""

    args: ModelArgs
    tokenizer: Any | None
    data: Path | None
    dataset: Any | None = None
    pixels: PixelEncoder | None = None  # a vision-language model's image processor (rows with images)


def check_inputs(config: SftConfig) -> SftInputs:
    """Every path the run reads (model directory, config.json, weights, tokenizer, data file) checked, and the
    small ones read, and a dataset directory or Hub dataset loaded (downloaded into the Hugging Face cache the
    first time), before the run directory or the model is touched: a mistake is one ConfigError."""
    args = read_model_args(config)
    if config.data.fake:
        return SftInputs(args, None, None)
    if not config.data.path:
        raise ConfigError(
            "no training data: set data.path (a JSONL file, dataset directory or Hub dataset id) or data.fake = true"
        )
    data = local_data_file(config)
    tokenizer = _load_tokenizer(config)
    pixels = None
    if args.vision_config is not None:
        try:
            pixels = PixelEncoder(config.model.name)
        except ImageError as error:
            raise ConfigError(f"model.name: {error}") from None
    return SftInputs(args, tokenizer, data, None if data is not None else load_hf_dataset(config), pixels)


def build_steps(config: SftConfig, inputs: SftInputs):
    """The per-step row source: fake random rows, or the tokenised, packed dataset."""
    if config.data.fake:
        return FakeSteps(inputs.args.vocab_size, config.seq_len, config.batch_size, config.seed)
    tokenizer = inputs.tokenizer
    rows = read_jsonl(inputs.data) if inputs.data is not None else enumerate(inputs.dataset, start=1)
    vision = None
    if inputs.pixels is not None and inputs.args.image_token_id is not None:
        vision = VisionTokens(inputs.args.image_token_id, inputs.pixels)
    samples, report = load_samples(rows, tokenizer, config.seq_len, config.data.on_bad_row, vision)
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


class SftRecipe(Recipe):
    """Dataset rows in, the summed NLL of every loss token over the step's loss-token count out."""

    def __init__(
        self, config: SftConfig, world: World, steps, micro_steps: int, pixels: PixelEncoder | None = None
    ) -> None:
        self.config, self.world, self.steps, self.micro_steps = config, world, steps, micro_steps
        self.pixels = pixels

    def batch(self, step: int) -> StepBatch:
        rows = self.steps(step - 1)
        mine = balance_rows(rows, self.world.world_size)[self.world.rank]
        size = self.config.micro_batch_size
        micros = [mine[index * size : (index + 1) * size] for index in range(self.micro_steps)]
        loss_tokens = sum(int(row.loss_mask.sum()) for row in rows)
        return StepBatch(step, micros, sum(r.num_real for r in rows), {"loss_tokens": loss_tokens})

    def loss(self, model: torch.nn.Module, micro: list, batch: StepBatch) -> tuple[torch.Tensor, dict]:
        nll = _micro_batch_nll(model, micro, self.config, self.world.device, self.pixels)
        return nll / batch.values["loss_tokens"], {}


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
    training = build_training(config, world)
    start_step = ckpt.resume_step(config, training.model, training.optimizer, training.scheduler)
    monitor = Monitor(config, world, training.info, start_step)
    try:
        recipe = SftRecipe(config, world, steps, micro_steps, inputs.pixels)
        run_steps(config, world, training, recipe, start_step, monitor)
        if config.speed.save_final:
            export_hf(training.model, training.info, config.run_dir / "hf" / "final", world, config.model.dtype)
    finally:
        monitor.close()
    if world.is_main and config.speed.save_final:
        what = "LoRA adapter (PEFT format)" if config.model.lora.enabled else "Hugging Face checkpoint"
        logger.info("done: %d steps; %s in %s", config.max_steps, what, config.run_dir / "hf" / "final")
    del training
    shutdown_distributed()
    return 0


def _micro_batch_nll(
    model: torch.nn.Module, rows: list, config: SftConfig, device: torch.device, pixels: PixelEncoder | None = None
) -> torch.Tensor:
    """Summed NLL of one micro-batch's loss tokens (a scalar to backpropagate); the rows' images are read and
    processed here, from their references (`pixels`)."""
    inputs = stack(rows, device)
    targets = inputs["target_ids"].masked_fill(~inputs["loss_mask"], -100)
    positions = None if single_documents(rows) else inputs["position_ids"]
    images = None
    refs = [ref for row in rows for ref in row.images]
    if refs and pixels is not None:
        pixel_values, grid_thw = pixels.encode(refs)
        images = Images(pixel_values.to(device), grid_thw.to(device))
    if config.speed.fused_loss:
        return model(inputs["input_ids"], positions, images=images, head=NllSum(targets, config.loss_chunk_size))
    head = Logprobs(targets, chunk_size=config.loss_chunk_size, with_entropy=False)
    return -model(inputs["input_ids"], positions, images=images, head=head).logprobs.sum()


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
