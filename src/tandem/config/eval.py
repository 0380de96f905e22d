"""`tandem eval`: environments against an OpenAI-compatible server.

`[env]` holds what every source has in common; each `[[source]]` block
overrides it key by key (tables merge, as the shared top-level values do).
With no `[[source]]` blocks, `[env]` is the one source: `tandem eval gsm8k`
sets `env.id`. The request settings (`env.retries`, `env.request_timeout_s`)
belong to the one client all sources share.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from tandem.config.base import Section
from tandem.config.common import LoadedModelConfig, RunConfig
from tandem.config.env import EnvConfig, SandboxConfig
from tandem.config.loader import deep_merge

RetryOn = Literal["connection", "timeout", "5xx", "429"]


class SamplingConfig(Section):
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature (0: greedy)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""
    max_tokens: int = Field(1024, gt=0)
    """Most tokens generated per model reply; a reply cut here makes the rollout `truncated`."""
    seed: int | None = None
    """Base seed: rollout i of a task sends seed + i, so the k rollouts differ (unset: the server's randomness)."""
    stop: list[str] = Field(default_factory=list)
    """Strings that end a reply."""
    extra: dict[str, Any] = Field(default_factory=dict)
    """More request fields sent as-is, for servers that take them (e.g. {top_k = 20, min_p = 0.05})."""


class RetryConfig(Section):
    max_retries: int = Field(3, ge=0)
    """Retries of one request after its first attempt."""
    retry_on: list[RetryOn] = Field(default_factory=lambda: ["connection", "timeout", "5xx", "429"])
    """Failures worth retrying: connection errors, request timeouts, HTTP 5xx, HTTP 429; others fail at once."""
    backoff_s: float = Field(0.5, ge=0)
    """Wait before the first retry; each later one waits backoff_factor times longer (with up to 50% jitter)."""
    backoff_factor: float = Field(2.0, ge=1)
    """Growth of the wait from one retry to the next."""
    max_backoff_s: float = Field(30.0, ge=0)
    """Longest wait between attempts; also caps a server's Retry-After."""


class ConcurrencyConfig(Section):
    initial: int = Field(4, ge=1)
    """Requests in flight at the start; the limit doubles from here after each window until the first decrease."""
    min: int = Field(1, ge=1)
    """Never fewer requests in flight than this."""
    max: int = Field(64, ge=1)
    """Never more requests in flight than this."""
    increase: int = Field(1, ge=1)
    """Requests added after a window of successes (one per request in flight) once past slow start."""
    decrease: float = Field(0.5, gt=0, lt=1)
    """Factor applied to the limit on a timeout, a connection error, a 5xx/429 or a latency past the tolerance."""
    latency_tolerance: float = Field(2.0, ge=1)
    """Back off when a window's mean latency exceeds this factor of the baseline (a moving average of earlier ones)."""

    @model_validator(mode="after")
    def _ordered(self) -> ConcurrencyConfig:
        if not self.min <= self.initial <= self.max:
            raise ValueError(f"need min <= initial <= max, got {self.min}, {self.initial}, {self.max}")
        return self


class EvalSourceConfig(EnvConfig):
    """One `[[source]]`: an environment, its tasks, and how to sample and grade its rollouts."""

    name: str = ""
    """Name of the source in traces and the summary (default: its env id); unique across sources."""
    rollouts_per_task: int = Field(1, ge=1)
    """Rollouts of each task: the k of pass@k."""
    pass_threshold: float = 1.0
    """A rollout passes (for pass@k) when its reward is at least this."""
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    """Sampling settings sent with every request of this source."""


class EvalEnvConfig(EvalSourceConfig):
    """Settings every source shares (a `[[source]]` overrides them), and the request settings of the client."""

    id: str | None = None
    """Env id or import path: the default of every source, or the one source when there are none (`tandem eval ID`)."""
    request_timeout_s: float = Field(600.0, gt=0)
    """Seconds one HTTP request may take before it fails as a timeout."""
    retries: RetryConfig = Field(default_factory=RetryConfig)
    """Which failed requests are retried, how often, and how long to wait between attempts."""


def _table(value: Any) -> Any:
    return value.model_dump(exclude_unset=True) if isinstance(value, Section) else value


class EvalConfig(RunConfig):
    command: ClassVar[str] = "eval"

    model: LoadedModelConfig = LoadedModelConfig()
    """The model the built-in server serves, or the id to request from `base_url` (no training keys: nothing trains)."""

    base_url: str | None = None
    """OpenAI-compatible server to evaluate against (default: start the built-in one for `model.name`)."""
    api_key: str | None = None
    """API key sent to `base_url`."""
    startup_timeout_s: float = Field(300.0, gt=0)
    """Seconds to wait for the built-in server (started when base_url is unset) to answer /health."""
    served_model_name: str = ""
    """Model id the built-in server serves and records name (default: its directory's name; a Hub id: the id)."""
    env: EvalEnvConfig = Field(default_factory=EvalEnvConfig)
    """Defaults of every source; the one source when no [[source]] block is given."""
    source: list[EvalSourceConfig] = Field(default_factory=list)
    """The environments to evaluate, one [[source]] block each."""
    concurrency: ConcurrencyConfig = Field(default_factory=ConcurrencyConfig)
    """Adaptive number of requests in flight, shared by all sources (AIMD)."""
    sandbox: SandboxConfig = SandboxConfig()
    """The `python` tool's sandbox: `unsafe_no_isolation` where no isolation is available, `max_concurrent` runs."""
    resume: Path | None = None
    """Run directory of an earlier eval to continue: its saved config under the keys given; only missing rollouts run."""

    @model_validator(mode="before")
    @classmethod
    def _sources_inherit_env(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        env = _table(data.get("env")) or {}
        if not isinstance(env, dict):
            return data
        shared = {key: value for key, value in env.items() if key in EvalSourceConfig.model_fields}
        sources = [_table(source) for source in data.get("source") or ()]
        if not sources and shared.get("id"):
            sources = [{}]
        merged = []
        for source in sources:
            if isinstance(source, dict):
                source = deep_merge(shared, source)
                if source.get("id") and not source.get("name"):
                    source["name"] = source["id"]
            merged.append(source)
        return {**data, "source": merged}

    @field_validator("source")
    @classmethod
    def _unique_names(cls, sources: list[EvalSourceConfig]) -> list[EvalSourceConfig]:
        repeated = [name for name, count in Counter(s.name for s in sources).items() if count > 1]
        if repeated:
            raise ValueError(f"source names must be unique; {repeated} name several sources: set `name` on each")
        return sources
