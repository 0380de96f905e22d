"""`tandem trainer`: the RL trainer process (a torchrun group)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from tandem.config.base import Section
from tandem.config.common import OptimConfig
from tandem.config.training import CheckpointConfig, TrainingRunConfig


class LossConfig(Section):
    type: Literal["ipo", "icepop", "ppo", "cispo"] = "ipo"
    """Policy loss: ipo masks tokens by |p - q|, icepop by r = p/q, ppo clips r, cispo clips r's weight."""
    ipo_eps: float = Field(0.3, gt=0, le=1)
    """ipo: keep a token iff |p_train - p_infer| <= ipo_eps (both sides, whatever the advantage's sign)."""
    icepop_low: float = Field(0.2, gt=0)
    """icepop: mask tokens with r below this."""
    icepop_high: float = Field(5.0, gt=1)
    """icepop: mask tokens with r above this."""
    ppo_clip: float = Field(0.2, gt=0, lt=1)
    """ppo: clip r to [1 - ppo_clip, 1 + ppo_clip]."""
    cispo_eps_high: float = Field(0.28, gt=0)
    """cispo: clip the detached weight r at 1 + cispo_eps_high."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of a k3 KL penalty against the inference policy (0: none)."""


class WeightsConfig(Section):
    transport: Literal["auto", "file", "broadcast", "shared"] = "auto"
    """How policies reach inference: file (a Hugging Face directory per step under <run>/policies), broadcast (trainer rank 0 sends them to every server over torch.distributed, tensor by tensor), or shared (one buffer on trainer rank 0 that servers on its node map: CUDA IPC on its GPU, shared memory on CPU; the trainer does not wait for the servers). auto: tandem rl picks shared for the built-in engine on the trainer's devices, broadcast across separate GPUs, file for vLLM; a trainer started alone takes file. The last policy is always written as a directory. The orchestrator must use the same (`orchestrator.weight_transport`; tandem rl sets it)."""
    host: str = "127.0.0.1"
    """broadcast, shared: the address at which inference servers reach trainer rank 0's store (its node's, for several nodes)."""
    port: int = Field(0, ge=0, le=65535)
    """broadcast, shared: port of the rendezvous store on trainer rank 0 (0: a free one, announced in <run>/weights_rendezvous.json)."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """broadcast: the torch.distributed backend (auto: NCCL when the trainer runs on GPUs, else gloo)."""
    timeout_s: float = Field(600.0, gt=0)
    """broadcast, shared: fail when a member does not answer within this time (servers joining, a tensor, an acknowledgement)."""


DEFAULT_RL_CKPT_INTERVAL = 50
"""Steps between the RL trainer's checkpoints by default: a resume repeats at most this many steps, and the README's
example (400 steps of ~1.6 s on CPU) writes 7 checkpoints of ~11 MB, a fraction of a second in all."""


class TrainerConfig(TrainingRunConfig):
    command: ClassVar[str] = "trainer"

    optim: OptimConfig = OptimConfig(lr=1e-6)
    """Optimizer."""
    ckpt: CheckpointConfig = CheckpointConfig(interval=DEFAULT_RL_CKPT_INTERVAL)
    """Checkpointing: every 50 steps unless set (`interval`), so that a stopped RL run can be resumed (`--resume`)."""
    loss: LossConfig = LossConfig()
    """Policy loss."""
    batch_timeout_s: float = Field(1800.0, gt=0)
    """Fail if the orchestrator's batch for the next step does not arrive within this time."""
    weights: WeightsConfig = WeightsConfig()
    """How each new policy is handed to inference."""

    @model_validator(mode="after")
    def _lora_without_dropout(self) -> TrainerConfig:
        if self.model.lora.enabled and self.model.lora.dropout > 0:
            raise ValueError(
                f"model.lora.dropout = {self.model.lora.dropout:g}: RL scores each rollout under the policy that "
                "sampled it, and the engine runs the adapters without dropout; set model.lora.dropout = 0"
            )
        return self
