"""`tandem inference`: the OpenAI-compatible inference server."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from tandem.config.common import RunConfig


class InferenceConfig(RunConfig):
    command: ClassVar[str] = "inference"

    engine: Literal["builtin", "vllm"] = "builtin"
    """builtin: tandem's engine (the trainer's model code); vllm: vLLM with tandem's routes (pip install -e ".[vllm]")."""
    exact_replay: bool = True
    """Refuse top-k/top-p/min-p rollouts the engine returns no kept ids for (vllm); false: trainer uses the whole vocab."""
    vllm_args: list[str] = Field(default_factory=list)
    """Extra `vllm serve` arguments for engine vllm, e.g. ["--tensor-parallel-size", "4"]."""
    host: str = "127.0.0.1"
    """Address to bind; anything but loopback requires `admin_token` for admin endpoints."""
    port: int = Field(8000, ge=0, le=65535)
    """TCP port to listen on (0 picks a free one)."""
    admin_token: str | None = None
    """Bearer token required by the admin routes (/update_weights, /pause, /resume; default: $TANDEM_ADMIN_TOKEN). `tandem rl` always sets one: this, or a random one per run."""
    max_body_bytes: int = Field(32 * 2**20, ge=1024)
    """Largest request body accepted (larger ones get 413); the default, 32 MiB, holds a 128k-token prompt."""
    max_prompt_chars: int | None = Field(None, ge=1)
    """Longest prompt text tokenized (a completion's prompt; a chat's messages and tools as rendered); longer ones get 400 before the tokenizer runs (default: 32 x seq_len)."""
    trust_request_chat_template: bool = False
    """Let chat requests bring their own Jinja chat template (chat_template_kwargs.chat_template; size and time limited)."""
    broadcast_hosts: list[str] = Field(default_factory=list)
    """Addresses besides loopback /weights/broadcast/join may connect to (the trainer's weights.host on another node)."""
    log_interval_s: float = Field(10.0, ge=0)
    """Log a one-line serving summary and append it to <run>/inference_metrics.jsonl this often (0: never)."""
    served_model_name: str = ""
    """Model id clients ask for and /v1/models lists (default: the model directory's name)."""
    lora_adapter: Path | None = None
    """A PEFT LoRA adapter directory to serve on the base model (`model.name`); with `model.lora` set too, its rank, alpha and targets must match (docs/lora.md)."""
    lora_fold: bool | None = None
    """Fold LoRA adapters into the served weights (refolded from a kept copy of the base at each hand-off): decode at the base model's speed, through the fused kernels, for one more copy of the adapted weights in memory. false: apply them unfolded in every projection (no copy; slower decode), which lets the base model be served beside an adapter directory under its own name. Unset (auto): fold the adapters `tandem rl` trains, serve an adapter directory unfolded beside the base."""
    lora_name: str = ""
    """Model id the adapter is served under (default: the adapter directory's name; folded, served_model_name if set). Unfolded, the base model is served beside it as served_model_name (default: the model directory's name)."""
    weights_dir: Path | None = None
    """Directory /update_weights may load checkpoints from, subfolders included (default: output_dir)."""
    device: str = "auto"
    """Device to run on: auto (CUDA when available), cpu, cuda or cuda:N."""
    block_size: int = Field(16, ge=1)
    """Tokens per KV-cache block."""
    kv_cache_blocks: int = Field(0, ge=0)
    """KV-cache size in blocks; 0 sizes it from gpu_memory_utilization on CUDA, and to at most 1 GiB on CPU."""
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    """Fraction of the GPU's memory that weights, KV cache and activations may use together."""
    max_running: int = Field(256, ge=1)
    """Most sequences in the running batch (each of a request's n samples counts)."""
    max_prefill_tokens: int = Field(2048, ge=1)
    """Prompt tokens prefilled per engine step; longer prompts are split over steps, between decode steps."""
    cuda_graphs: bool = True
    """Replay decode steps from CUDA graphs, one per batch-size bucket (CUDA only)."""
    cuda_graph_batch_sizes: list[int] = Field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64, 128, 256])
    """Batch-size buckets decode steps are padded to for CUDA graphs; larger steps run eagerly."""
    decode_kernels: Literal["auto", "torch", "triton"] = "auto"
    """Decode step: triton (~10 kernels a layer, K/V read in place, one-kernel sampling), torch (module by module), auto (triton on CUDA)."""
    recurrent_kernels: Literal["auto", "torch", "triton"] = "auto"
    """Hybrid models' recurrent layers (Gated DeltaNet, Mamba-2) on Triton kernels (triton): prefill chunks on the trainer's chunked kernels, decode steps on one kernel a layer that advances each state in its cache slot; or torch ops (torch); auto: triton on CUDA. Other models ignore it."""
    return_routed_experts: bool = False
    """MoE models: return each sample's routed experts per position (for router replay; slows decoding)."""
    overlap_steps: bool = True
    """Launch a decode step before the host reads the previous one's tokens (greedy/whole-vocabulary sampling)."""
    compile: bool = False
    """torch.compile the module-by-module decode step (decode_kernels = torch); adds compile time at start-up."""
    max_logprobs: int = Field(20, ge=0)
    """Largest top_logprobs / logprobs a request may ask for."""
    max_image_pixels: int = Field(40_000_000, ge=1, le=40_000_000)
    """Largest image (width x height, read from its header before anything is decoded) a request may carry; at most 40,000,000, the trainers' limit (tandem.images.MAX_IMAGE_PIXELS), so every image served can be trained on."""
    max_request_image_pixels: int = Field(100_000_000, ge=1)
    """Pixels of all the images of one request together (from their headers, before any is decoded); a request over it gets a 400."""
    max_server_image_pixels: int = Field(200_000_000, ge=1)
    """Pixels (from the headers) that requests' decoded images may hold at once across the server, from decoding until the vision tower has run; a request waits for room. At least max_request_image_pixels."""
    image_workers: int = Field(2, ge=1)
    """Images decoded at once across the server (each in full before it is scaled to what the model uses), on threads of their own."""

    @property
    def folds_lora(self) -> bool:
        """Whether LoRA adapters are folded into the served weights: `lora_fold` if set, else (auto) the adapters
        of `tandem rl` (`model.lora` alone) are, and an adapter directory (`lora_adapter`) is served unfolded,
        beside the base model."""
        return self.lora_fold if self.lora_fold is not None else self.lora_adapter is None

    @model_validator(mode="after")
    def _a_request_fits_the_server_image_budget(self) -> InferenceConfig:
        if self.max_server_image_pixels < self.max_request_image_pixels:
            raise ValueError(
                f"max_server_image_pixels ({self.max_server_image_pixels:,}) must be at least "
                f"max_request_image_pixels ({self.max_request_image_pixels:,}): a request at the limit would wait "
                "forever"
            )
        return self

    @model_validator(mode="after")
    def _options_vllm_serves(self) -> InferenceConfig:
        if self.engine == "vllm" and self.lora_fold:
            raise ValueError(
                "lora_fold = true is the built-in engine's: vLLM serves LoRA adapters with its own kernels, unfolded"
            )
        if self.engine == "vllm" and self.return_routed_experts:
            raise ValueError(
                "return_routed_experts is the built-in engine's: tandem's vLLM routes do not carry vLLM's routed "
                'experts yet; use inference.engine = "builtin"'
            )
        if self.engine == "vllm" and self.model.lora.experts:
            raise ValueError(
                "model.lora.experts = true (adapters on routed experts) is served by the built-in engine only; "
                'use inference.engine = "builtin" or model.lora.experts = false'
            )
        return self
