"""`tandem inference --model DIR`: load the model, start the engine, serve HTTP until SIGTERM or Ctrl-C.

Once the server accepts connections it prints `tandem inference listening on http://HOST:PORT` and writes
`<run_dir>/server.json` (`{"url", "pid", "model"}`, atomically; `startup.announce`), so a parent that passed
`--port 0` finds the port. While serving, it logs a one-line summary every `log_interval_s` and appends the same record to
`<run_dir>/inference_metrics.jsonl` (serving_log.py). With `engine = "vllm"` the same checks run and the same
file is written, but vLLM serves (`tandem.inference.vllm`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from pathlib import Path
from typing import Any

import torch
import uvicorn

from tandem.config import ConfigError
from tandem.config.inference import InferenceConfig
from tandem.images import PixelEncoder
from tandem.inference.engine import Engine
from tandem.inference.server import InferenceServer
from tandem.inference.serving_log import ServingSummary
from tandem.inference.startup import Terminated, announce, check_context, stop_on_sigterm
from tandem.kernels import triton_unavailable_reason
from tandem.model_kernels import kernel_options, resolve
from tandem.models import CausalLM, ModelRuntime, build_model, load_model
from tandem.models.lora import (
    LoraArgs,
    LoraError,
    apply_lora,
    fold_adapters,
    from_peft_state_dict,
    load_peft_adapter,
    read_adapter,
)
from tandem.net import ADMIN_TOKEN_ENV, admin_token, bind_server_socket, is_loopback
from tandem.run import prepare_run_dir, records_clean_stop

logger = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 5


def _model_dir(config: InferenceConfig) -> Path:
    if not config.model.name:
        raise ConfigError("no model to serve: pass --model DIR (a Hugging Face model directory)")
    path = Path(config.model.name).expanduser()
    if not path.is_dir():
        raise ConfigError(
            f"model `{config.model.name}` is not a local directory, nor a Hugging Face Hub id (`org/name`)"
        )
    if not (path / "config.json").is_file():
        raise ConfigError(f"{path} has no config.json; is it a Hugging Face model directory?")
    return path


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise ConfigError(f"device `{name}`: {error}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device `{name}`: CUDA is not available on this machine")
    return device


def eos_token_ids(model_dir: Path, tokenizer: Any) -> set[int]:
    """EOS ids from `generation_config.json` (an id or a list) and the tokenizer."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    generation = model_dir / "generation_config.json"
    if generation.is_file():
        value = json.loads(generation.read_text()).get("eos_token_id")
        ids |= set(value) if isinstance(value, list) else {value} if isinstance(value, int) else set()
    return ids


def _tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception as error:
        raise ConfigError(f"cannot load the tokenizer of {model_dir}: {error}") from None


def _admin_token(config: InferenceConfig) -> str | None:
    token = admin_token(config.admin_token)
    if not is_loopback(config.host) and token is None:
        raise ConfigError(
            f"binding {config.host} exposes the admin routes beyond this machine: set --admin-token "
            f"(or ${ADMIN_TOKEN_ENV}), or bind 127.0.0.1"
        )
    return token


def lora_to_serve(config: InferenceConfig, model_dir: Path) -> LoraArgs | None:
    """The adapters the served model gets, checked before anything is allocated: `inference.lora_adapter` (a PEFT
    adapter directory that fits the base: every key and shape, on a model built on the meta device) and/or
    `model.lora` (zero-initialised adapters of that shape, what `tandem rl` serves until the trainer's first
    hand-off); both set, they must agree. None: no adapters. ConfigError naming the setting otherwise."""
    section = config.model.lora
    wanted = None
    try:
        if section.enabled:
            wanted = LoraArgs.of(section, dropout=0.0)
        if config.lora_adapter is None and wanted is not None:
            apply_lora(build_model(model_dir, device="meta"), wanted)
    except LoraError as error:
        raise ConfigError(f"model.lora: {error}") from None
    if config.lora_adapter is None:
        return wanted
    path = Path(config.lora_adapter).expanduser()
    try:
        args, tensors = read_adapter(path)
    except LoraError as error:
        raise ConfigError(f"inference.lora_adapter: {error}") from None
    if wanted is not None and wanted.layout != args.layout:
        raise ConfigError(f"inference.lora_adapter {path} has {args}; model.lora asks for {wanted}")
    skeleton = build_model(model_dir, device="meta")
    try:
        apply_lora(skeleton, args)
        shapes = {name: tuple(p.shape) for name, p in skeleton.named_parameters()}
        for name, tensor in from_peft_state_dict(skeleton, tensors).items():
            if tuple(tensor.shape) != shapes[name]:
                raise LoraError(f"{name} has shape {tuple(tensor.shape)}, the base model's {shapes[name]}")
    except LoraError as error:
        raise ConfigError(f"inference.lora_adapter {path} does not fit the base model {model_dir}: {error}") from None
    return args


def served_names(config: InferenceConfig, model_dir: Path) -> tuple[str, str | None]:
    """The model ids clients ask for: the served model's, and the base model's when it is served beside an
    unfolded adapter directory (else None). With an adapter directory, its id is `lora_name`, else (base served too)
    the adapter directory's name, else (folded) `served_model_name` or the adapter directory's name; the base's is
    `served_model_name` or the model directory's name. ConfigError when the two would be the same."""
    base = config.served_model_name or model_dir.resolve().name
    if config.lora_adapter is None:
        return config.lora_name or base, None
    directory = Path(config.lora_adapter).resolve().name
    if config.folds_lora:
        return config.lora_name or config.served_model_name or directory, None
    adapter = config.lora_name or directory
    if adapter == base:
        raise ConfigError(
            f"the adapter and the base model would both be served as `{base}`: set inference.lora_name or "
            "inference.served_model_name"
        )
    return adapter, base


def recurrent_kernels(setting: str, device: torch.device) -> dict[str, str]:
    """The hybrid layers' kernel options (`delta_scan_backend`, `ssd_backend`: chunked prefill and the decode step)
    for an `inference.recurrent_kernels` setting."""
    choice = resolve(setting, device)
    if choice == "triton" and (reason := triton_unavailable_reason(device.type)) is not None:
        raise ConfigError(f"inference.recurrent_kernels = triton: {reason}")
    kernels = kernel_options(device, delta_scan=choice, ssd=choice)
    return {name: kernels[name] for name in ("delta_scan_backend", "ssd_backend")}


def load_served_model(
    config: InferenceConfig, model_dir: Path, device: torch.device, lora: LoraArgs | None
) -> CausalLM:
    """The model the engine serves: the checkpoint at `model_dir`, with `lora` (from `lora_to_serve`) adapters
    added, loaded from `inference.lora_adapter` if set, and folded into the weights if `folds_lora`. A
    hand-off then swaps only the adapters."""
    model = load_model(
        model_dir,
        dtype=getattr(torch, config.model.dtype),
        device=device,
        runtime=ModelRuntime(
            attn_backend=config.model.attn_backend,
            moe_backend=config.model.moe_backend,
            freeze_router=bool(config.model.freeze_router),
            **recurrent_kernels(config.recurrent_kernels, device),
        ),
    )
    if lora is None:
        return model
    apply_lora(model, lora, seed=0)
    if config.lora_adapter is not None:
        try:
            load_peft_adapter(model, config.lora_adapter)  # checked by `lora_to_serve`, read again here
        except LoraError as error:
            raise ConfigError(f"inference.lora_adapter: {error}") from None
    folded = config.folds_lora
    if folded:
        fold_adapters(model)
    how = "folded into the weights" if folded else "unfolded, the base model served beside them"
    logger.info("LoRA adapters: %s, %s", lora, how)
    return model


def run(config: InferenceConfig) -> int:
    model_dir = _model_dir(config)
    admin_token = _admin_token(config)
    check_context(config.seq_len, model_dir)
    lora = lora_to_serve(config, model_dir)
    with bind_server_socket(config.host, config.port) as sock:  # a port in use ends here, before the model loads
        if config.engine == "vllm":
            from tandem.inference.vllm.launch import serve

            sock.close()  # vLLM binds the port itself
            return serve(config, model_dir, admin_token, lora)
        device = _device(config.device)
        stop_on_sigterm()
        run_dir = prepare_run_dir(config)
        with records_clean_stop(run_dir, config.command):
            _run_engine(config, model_dir, device, lora, admin_token, run_dir, sock)
    return 0


def _run_engine(
    config: InferenceConfig,
    model_dir: Path,
    device: torch.device,
    lora: LoraArgs | None,
    admin_token: str | None,
    run_dir: Path,
    sock: socket.socket,
) -> None:
    """Load the model, start the engine and serve on `sock` until SIGTERM (or Ctrl-C); the engine stops either way."""
    engine = server = None
    try:
        model = load_served_model(config, model_dir, device, lora)
        tokenizer = _tokenizer(model_dir)
        # images: data URLs in requests
        pixels = PixelEncoder(model_dir, max_image_pixels=config.max_image_pixels) if model.visual is not None else None
        engine = Engine(
            model, config, tokenizer=tokenizer, eos_token_ids=eos_token_ids(model_dir, tokenizer), pixels=pixels
        )
        engine.start()
        name, base_name = served_names(config, model_dir)
        logger.info(
            "serving %s as `%s`%s on %s (%s), context %d",
            model_dir,
            name,
            f" and the base model as `{base_name}`" if base_name else "",
            device,
            config.model.dtype,
            config.seq_len,
        )
        server = InferenceServer(
            engine,
            tokenizer,
            name,
            base_name=base_name,
            admin_token=admin_token,
            weights_dir=config.weights_dir or config.output_dir,
            max_body_bytes=config.max_body_bytes,
            max_prompt_chars=config.max_prompt_chars,
            trust_request_chat_template=config.trust_request_chat_template,
            broadcast_hosts=config.broadcast_hosts,
            image_workers=config.image_workers,
            max_server_image_pixels=config.max_server_image_pixels,
        )
        summary = ServingSummary(engine.stats, run_dir) if config.log_interval_s > 0 else None
        asyncio.run(_serve(server.app(), config, sock, run_dir, name, summary))
    except Terminated:
        logger.info("stopping on SIGTERM")
    finally:
        if server is not None:
            server.close()  # image work still in hand ends after its image; Python waits for that at exit
        if engine is not None:
            engine.stop()


async def _serve(
    app: Any, config: InferenceConfig, sock: socket.socket, run_dir: Path, name: str, summary: ServingSummary | None
) -> None:
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_config=None,
            access_log=config.log.level == "debug",
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
            lifespan="off",
        )
    )
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not serving.done():
        await asyncio.sleep(0.02)
    if server.started:
        announce(run_dir, sock, name)
    logging_summary = asyncio.create_task(summary.run(config.log_interval_s)) if summary is not None else None
    try:
        await serving
    finally:
        if logging_summary is not None:
            logging_summary.cancel()
