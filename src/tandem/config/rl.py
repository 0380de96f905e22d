"""`tandem rl`: inference, orchestrator and trainer started together on one machine."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from tandem.config.base import Section
from tandem.config.common import RunConfig
from tandem.config.inference import InferenceConfig
from tandem.config.orchestrator import MAX_REPLAY_KEPT, OrchestratorConfig
from tandem.config.trainer import TrainerConfig
from tandem.config.training import ResumeConfig


class RlDeployConfig(Section):
    trainer_nproc: int = Field(1, gt=0)
    """Trainer processes (torchrun above 1): one per GPU in trainer_gpus (the default when they are set), or gloo processes on CPU."""
    trainer_gpus: list[int] = Field(default_factory=list)
    """GPU indices for the trainer. Empty: no GPU when inference_gpus are set, else every GPU (shared with inference)."""
    inference_gpus: list[int] = Field(default_factory=list)
    """GPU indices for inference, split evenly over the servers in order (one each for the built-in engine). Empty: no GPU when trainer_gpus are set, else every GPU (shared with the trainer)."""
    inference_servers: int = Field(1, gt=0)
    """Inference servers to start; the orchestrator spreads rollouts over all of them."""
    trainer_memory_gib: Literal["auto"] | float = "auto"
    """When trainer and inference share a GPU (no trainer_gpus, no inference_gpus): GiB of it kept for the trainer; inference gets the rest (its gpu_memory_utilization and KV cache, unless set). auto: estimated from the model, micro-batch and seq_len."""

    @field_validator("trainer_memory_gib")
    @classmethod
    def _positive(cls, value: str | float) -> str | float:
        if value != "auto" and value <= 0:
            raise ValueError('must be "auto" or a positive number of GiB')
        return value

    @model_validator(mode="after")
    def _devices_fit(self) -> RlDeployConfig:
        if self.trainer_gpus:
            if "trainer_nproc" not in self.model_fields_set:
                self.trainer_nproc = len(self.trainer_gpus)
            elif self.trainer_nproc != len(self.trainer_gpus):
                raise ValueError(
                    f"trainer_nproc {self.trainer_nproc} does not match the {len(self.trainer_gpus)} trainer_gpus"
                )
        if self.inference_gpus and len(self.inference_gpus) % self.inference_servers:
            raise ValueError(
                f"the {len(self.inference_gpus)} inference_gpus do not split evenly over {self.inference_servers} "
                "inference_servers"
            )
        return self


class RlConfig(RunConfig):
    command: ClassVar[str] = "rl"
    shared_fields: ClassVar[tuple[str, ...]] = (*RunConfig.shared_fields, "max_steps")

    max_steps: int = Field(100, gt=0)
    """Trainer steps (and batches)."""
    trainer: TrainerConfig = TrainerConfig()
    """The trainer process."""
    orchestrator: OrchestratorConfig = OrchestratorConfig()
    """The orchestrator process."""
    inference: InferenceConfig = InferenceConfig(port=0)
    """The inference server (port 0: a free port)."""
    deploy: RlDeployConfig = RlDeployConfig()
    """Processes and devices."""
    resume: ResumeConfig = ResumeConfig()
    """Continue a killed run from the trainer's last checkpoint (`--resume`)."""
    overwrite: bool = Field(False, exclude=True)
    """Start over in a run directory that holds an earlier run, deleting it first (never saved with the config)."""

    @model_validator(mode="after")
    def _one_admin_token(self) -> RlConfig:
        """The orchestrator calls the run's own servers: one token serves both ends."""
        tokens = {self.inference.admin_token, self.orchestrator.inference.admin_token} - {None}
        if len(tokens) > 1:
            raise ValueError(
                "inference.admin_token and orchestrator.inference.admin_token differ: `tandem rl` gives its servers "
                "and its orchestrator one token (set one of them)"
            )
        return self

    @model_validator(mode="after")
    def _vllm_takes_files(self) -> RlConfig:
        transport = self.trainer.weights.transport
        if self.inference.engine == "vllm" and transport in ("broadcast", "shared"):
            raise ValueError(
                f'trainer.weights.transport = "{transport}" needs the built-in engine: the vLLM server only loads '
                'policies from their directories (use transport = "file" or "auto")'
            )
        return self

    @model_validator(mode="after")
    def _replayable_sampling(self) -> RlConfig:
        """vLLM returns no kept ids: refuse truncated sampling up front, not at the first rollout."""
        if self.inference.engine != "vllm" or not self.inference.exact_replay:
            return self
        truncating = [
            source.id
            for source in self.orchestrator.source
            if source.sampling.top_k or source.sampling.top_p < 1 or source.sampling.min_p
        ]
        if truncating:
            raise ValueError(
                f'sources {truncating} sample with top_k/top_p/min_p, but inference.engine = "vllm" returns no '
                "kept ids, so the trainer cannot replay the truncation exactly: drop it, or set "
                "inference.exact_replay = false (the trainer then renormalises over the whole vocabulary)"
            )
        return self

    @model_validator(mode="after")
    def _replay_fits(self) -> RlConfig:
        """Kept ids are replayed unless vLLM runs without exact replay: a top_k above the cap could not be."""
        if self.inference.engine == "vllm" and not self.inference.exact_replay:
            return self
        for index, source in enumerate(self.orchestrator.source):
            if source.sampling.top_k > MAX_REPLAY_KEPT:
                raise ValueError(
                    f"orchestrator.source[{index}].sampling.top_k = {source.sampling.top_k} is above "
                    f"{MAX_REPLAY_KEPT}, the most kept ids the trainer replays per token: lower it, or use top_p / "
                    "min_p (a token that keeps more ids is taken off the loss)"
                )
        return self
