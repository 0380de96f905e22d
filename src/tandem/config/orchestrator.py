"""`tandem orchestrator`: rollouts, rewards, advantages and batches."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from tandem.config.base import Section
from tandem.config.common import RunConfig
from tandem.config.env import EnvConfig, SandboxConfig
from tandem.config.eval import ConcurrencyConfig, EvalSourceConfig

MAX_REPLAY_KEPT = 2048
"""The most kept ids the trainer replays for one token (prime-rl's cap): it builds a `[tokens, K]` kept matrix
per micro-batch, so a larger top_k is refused and a token whose top-p/min-p sampling kept more ids is taken off
the loss (counted as `replay_overflow_tokens`)."""


class RolloutSamplingConfig(Section):
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature of training rollouts (the trainer recomputes logprobs at the same one)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling; below 1 the server returns each token's kept ids and the trainer replays them."""
    top_k: int = Field(0, ge=0)
    """Keep the k most likely tokens (0: off; at most 2048 when the trainer replays the kept ids)."""
    min_p: float = Field(0.0, ge=0, lt=1)
    """Drop tokens below min_p times the top token's probability (0: off)."""
    max_tokens: int = Field(256, gt=0)
    """Most tokens per completion; a completion cut here is `truncated`."""
    ignore_eos: bool = False
    """Sample max_tokens tokens whatever the model emits (fixed-length rollouts for benchmarks)."""


class TrainSourceConfig(EnvConfig):
    """One `[[orchestrator.source]]`: an environment whose tasks are trained on."""

    weight: float = Field(1.0, gt=0)
    """Relative share of this source's tasks in each batch."""
    sampling: RolloutSamplingConfig = RolloutSamplingConfig()
    """How rollouts of this source are sampled."""


class AdvantageConfig(Section):
    baseline: Literal["mean", "length_weighted"] = "mean"
    """GRPO baseline per group: the mean reward, or Σ len·reward / Σ len."""
    normalize_std: bool = False
    """Divide advantages by the group's reward standard deviation."""
    aggregation: Literal["token_mean", "prompt_mean"] = "token_mean"
    """Loss aggregation: every token weighs the same, or every prompt weighs the same."""


class InferencePoolConfig(Section):
    base_urls: list[str] = Field(default_factory=lambda: ["http://127.0.0.1:8000"])
    """Inference servers, used round-robin by load."""
    admin_token: str | None = None
    """Bearer token for the servers' admin routes (default: $TANDEM_ADMIN_TOKEN; `tandem rl` gives its own)."""
    request_timeout_s: float = Field(600.0, gt=0)
    """Per-request timeout."""
    max_concurrent: int = Field(64, gt=0)
    """Rollout groups in flight at once, over all servers."""
    startup_timeout_s: float = Field(300.0, gt=0)
    """How long to wait for the servers' /health at start."""


class OnlineEvalConfig(Section):
    interval: int = Field(0, ge=0)
    """Evaluate the served policy every this many steps (0: no online evals)."""
    at_start: bool = False
    """Also evaluate the starting policy, before the first rollout (step 0 in the records; not again on --resume)."""
    source: list[EvalSourceConfig] = Field(default_factory=list)
    """`[[orchestrator.eval.source]]` blocks, as `[[source]]` in `tandem eval` (bound infinite tasksets with select.limit)."""
    concurrency: ConcurrencyConfig = ConcurrencyConfig()
    """Adaptive requests in flight for the eval rollouts (they share the servers with training rollouts)."""

    @model_validator(mode="after")
    def _sources_when_on(self) -> OnlineEvalConfig:
        if (self.interval or self.at_start) and not self.source:
            raise ValueError("eval.interval or eval.at_start is set but there is no [[orchestrator.eval.source]] block")
        for source in self.source:
            source.name = source.name or source.id
        return self


class OrchestratorConfig(RunConfig):
    command: ClassVar[str] = "orchestrator"

    max_steps: int = Field(100, gt=0)
    """Trainer steps to produce batches for."""
    batch_size: int = Field(64, gt=0)
    """Rollouts per trainer step (a multiple of group_size)."""
    group_size: int = Field(8, gt=1)
    """Rollouts per task (one GRPO group), sampled as n completions of one prompt."""
    async_level: int = Field(1, ge=0)
    """How many policy versions inference may run ahead of the trainer: batch N is sampled with policy >= N-1-async_level."""
    max_off_policy_steps: int = Field(8, ge=0)
    """Drop a sample whose oldest producing policy is more than this many steps older than the step it would train."""
    filter_zero_advantage: bool = True
    """Drop groups whose rewards are all equal (no learning signal) and sample more instead."""
    seed: int = 0
    """Seed of the task order."""
    trainer_ranks: int = Field(1, gt=0)
    """Trainer processes the batches are packed for."""
    micro_batch_rows: int = Field(1, gt=0)
    """Rows of seq_len per trainer micro-batch."""
    advantage: AdvantageConfig = AdvantageConfig()
    """Advantages and loss aggregation."""
    inference: InferencePoolConfig = InferencePoolConfig()
    """The inference servers."""
    source: list[TrainSourceConfig] = Field(default_factory=list)
    """Training sources: `[[orchestrator.source]]` blocks (id, args, select, weight, sampling)."""
    eval: OnlineEvalConfig = OnlineEvalConfig()
    """Online evals of the served policy, through the eval stack."""
    batch_timeout_s: float = Field(1800.0, gt=0)
    """Fail if a batch cannot be filled within this time (e.g. every group is filtered out)."""
    policy_timeout_s: float = Field(1800.0, gt=0)
    """Fail if the trainer publishes no policy the next batch may use within this time."""
    weight_transport: Literal["file", "broadcast", "shared"] = "file"
    """How the trainer hands over policies (its `weights.transport`; tandem rl sets both): file: load each `<run>/policies/step-N` into every server; broadcast, shared: have the servers join the trainer's hand-off (announced in `<run>/weights_rendezvous.json`) and follow the version they serve."""
    keep_batches: bool = False
    """Keep every batch file (benchmarks replay them). Otherwise, once every server serves policy N, the batch files of steps up to N (trained already) are deleted, as policy directories older than N always are."""
    resume_step: int = Field(0, ge=0)
    """Continue after this step's batch (the trainer checkpoint being resumed; `tandem rl --resume` sets it)."""
    sandbox: SandboxConfig = SandboxConfig()
    """The `python` tool's sandbox: `unsafe_no_isolation` where no isolation is available, `max_concurrent` runs."""
    log_samples: int = Field(8, ge=0)
    """Trained rollouts a step written as text to `<run>/rollouts.jsonl` (prompt, completion, reward, advantage); 0: off."""

    @model_validator(mode="after")
    def _batch_of_whole_groups(self) -> OrchestratorConfig:
        if self.batch_size % self.group_size:
            raise ValueError(f"batch_size {self.batch_size} must be a multiple of group_size {self.group_size}")
        return self
