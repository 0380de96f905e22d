"""What the engine reports about a request: per-sample records, the updates it sends as they grow, and a
caller's collection of them."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.wire.protocol import FinishReason, PromptOutput, RoutedExperts, SampleOutput, SamplingParams

TopLogprobs = list[tuple[int, float]]


@dataclass
class SampleRecord:
    """Everything one sample has produced so far; `SampleUpdate`s extend it."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    encoded_kept_ids: list[str | None] = field(default_factory=list)
    """Per token, when the request truncates: its kept ids, encoded (`tandem.wire.kept_ids`)."""
    versions: list[int] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    routed_experts: RoutedExperts | None = None
    """Once the sample finished, with `inference.return_routed_experts`: its positions' routing."""

    def since(
        self, tokens: int, chars: int, text_end: int, sample: int, routed_experts: RoutedExperts | None = None
    ) -> SampleUpdate:
        """What was added after the first `tokens` tokens and `chars` characters (text up to `text_end`)."""
        return SampleUpdate(
            sample=sample,
            token_ids=self.token_ids[tokens:],
            logprobs=self.logprobs[tokens:],
            encoded_kept_ids=self.encoded_kept_ids[tokens:],
            versions=self.versions[tokens:],
            top_logprobs=self.top_logprobs[tokens:],
            text=self.text[chars:text_end],
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            routed_experts=routed_experts,
        )

    def extend(self, update: SampleUpdate) -> None:
        self.token_ids += update.token_ids
        self.logprobs += update.logprobs
        self.encoded_kept_ids += update.encoded_kept_ids
        self.versions += update.versions
        self.top_logprobs += update.top_logprobs
        self.text += update.text
        self.finish_reason, self.stop_reason = update.finish_reason, update.stop_reason
        self.routed_experts = update.routed_experts or self.routed_experts

    def to_output(self, *, with_kept_ids: bool, with_top: bool) -> SampleOutput:
        return SampleOutput(
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            masks=self.encoded_kept_ids if with_kept_ids else None,
            versions=self.versions,
            finish_reason=self.finish_reason or "abort",
            stop_reason=self.stop_reason,
            top_logprobs=self.top_logprobs if with_top else None,
            routed_experts=self.routed_experts,
        )


@dataclass
class PromptLogprobs:
    """A request's prompt scored under the model (temperature 1, nothing truncated), filled as it is prefilled.

    `logprobs[i]` is prompt token i's logprob given tokens 0..i-1 (None for token 0: nothing predicts it);
    `top[i]` its top-N alternatives there, when asked for (None at 0). Shared by the request's n samples.
    """

    length: int
    """Prompt tokens."""
    top_n: int
    logprobs: list[float | None] = field(default_factory=lambda: [None])
    top: list[TopLogprobs | None] = field(default_factory=lambda: [None])

    @property
    def filled(self) -> int:
        """Prompt positions scored so far (position 0 counts: it has nothing to score)."""
        return len(self.logprobs)

    @property
    def complete(self) -> bool:
        return self.filled == self.length


@dataclass(frozen=True)
class SampleUpdate:
    """What one sample added since the last update (for non-streaming requests: all of it, once, at the end)."""

    sample: int
    token_ids: list[int]
    logprobs: list[float]
    encoded_kept_ids: list[str | None]
    versions: list[int]
    top_logprobs: list[TopLogprobs]
    text: str
    finish_reason: FinishReason | None
    stop_reason: str | int | None
    routed_experts: RoutedExperts | None = None
    """On the update that finishes the sample, with `inference.return_routed_experts`: its routing."""


@dataclass(frozen=True)
class RequestUpdate:
    """Sent from the engine thread once per step for each streaming request that progressed, and at the end."""

    request_id: str
    samples: list[SampleUpdate]
    finished: bool
    prompt_tokens: int
    error: str | None = None
    """Set when the engine failed this request (finish_reason is then "abort")."""
    first_token_s: float | None = None
    """On the last update: seconds from submission to the first sampled token (None if there was none)."""
    prompt_logprobs: PromptLogprobs | None = None
    """Once, on the first update after the whole prompt was scored, when the request asked for it."""


class Collector:
    """A request's updates accumulated into its n samples (what a non-streaming caller waits for)."""

    def __init__(self, n: int) -> None:
        self.samples = [SampleRecord() for _ in range(n)]
        self.prompt_logprobs: PromptLogprobs | None = None
        self.finished = False
        self.error: str | None = None

    def add(self, update: RequestUpdate) -> list[SampleUpdate]:
        self.prompt_logprobs = update.prompt_logprobs or self.prompt_logprobs
        for sample in update.samples:
            self.samples[sample.sample].extend(sample)
        self.finished = update.finished
        self.error = update.error or self.error
        return update.samples

    def to_output(self, prompt_tokens: int, params: SamplingParams) -> PromptOutput:
        """The finished request as `/generate` returns one prompt's samples."""
        scores = self.prompt_logprobs
        return PromptOutput(
            prompt_token_count=prompt_tokens,
            samples=[
                s.to_output(with_kept_ids=params.truncates, with_top=params.top_logprobs > 0) for s in self.samples
            ],
            prompt_logprobs=scores.logprobs if scores else None,
            prompt_top_logprobs=scores.top if scores and params.prompt_logprobs else None,
        )
