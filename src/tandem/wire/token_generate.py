"""vLLM's token-in route, `POST /inference/v1/generate`, as `renderers` and verifiers' train client speak it.

prime-rl's rollouts render prompts with the `renderers` package and call this route on the engine, so serving it
lets those clients (and verifiers environments through them) drive either tandem engine unchanged. Both servers
translate it to and from tandem's own `/generate` here, so the route inherits that route's validation, context
check, kept ids and per-token policy versions:

- the request is strict like every tandem request: a sampling knob tandem does not implement (or a value of one it
  cannot honour, like `repetition_penalty != 1`) is a 400 that names it, never a silently different sampler;
- `logprobs.content[i]` carries each sampled token as `"token_id:<id>"` with its logprob (`renderers` accepts no
  other shape), the top-N alternatives alike when `logprobs = N > 0`;
- `sampling_mask` lists each token's kept ids when sampling truncates (top-k, top-p, min-p), as vLLM's
  `--return-sampling-mask` does; `policy_versions` (tandem's) each token's weights;
- `routed_experts` (MoE models, when the server runs with `inference.return_routed_experts`) carries each
  position's routed experts from `routed_experts_prompt_start`, as vLLM's `enable_return_routed_experts` does;
- `content_parts` brings a vision-language model's images as data URLs, one placeholder token each in
  `token_ids`; `prompt_token_ids` and `mm_placeholders` then give the expanded prompt.

`cache_salt` and `priority` are accepted: the built-in engine shares no prefix cache between requests and
schedules first come first served, so there they change nothing; the vLLM backend hands both to vLLM.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from tandem.wire.kept_ids import decode_kept_ids
from tandem.wire.protocol import (
    GenerateRequest,
    GenerateResponse,
    LogitBias,
    MaxTokens,
    MinP,
    Penalty,
    RequestModel,
    RoutedExperts,
    SampleCount,
    SampleOutput,
    SamplingParams,
    Seed,
    Temperature,
    TokenId,
    TopK,
    TopN,
    TopP,
    WireModel,
)

TOKEN_ROUTE = "/inference/v1/generate"


class TokenSamplingParams(RequestModel):
    """The subset of vLLM's `SamplingParams` tandem's samplers implement, under vLLM's names; null is the
    default. docs/inference.md#sampling says what each does."""

    n: SampleCount = 1
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(ge=1, le=1)] | None = None
    """Only 1 (off): tandem implements OpenAI's additive penalties, not vLLM's multiplicative one."""
    logit_bias: LogitBias | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0, le=0)] = 0
    """Only 0: tandem has no minimum length."""
    seed: Seed | None = None
    logprobs: TopN | None = None
    """Return the sampled token's logprob and the top-N alternatives (renderers asks for 1)."""
    prompt_logprobs: TopN | None = None
    skip_special_tokens: bool = True
    """Accepted and moot: this route returns token ids, no text."""
    spaces_between_special_tokens: bool = True
    """Accepted and moot, as `skip_special_tokens`."""
    include_stop_str_in_output: bool = False
    """Accepted and moot, as `skip_special_tokens`: the completion's ids always include the stop token."""
    routed_experts_prompt_start: Annotated[int, Field(ge=0)] | None = None
    """Return routed experts from this position of prompt + completion on (default 0), when the server records
    them (`inference.return_routed_experts`)."""

    def sampling(self) -> SamplingParams:
        """tandem's parameters for the same sampler; unset knobs keep tandem's (and vLLM's) defaults."""
        given = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "logit_bias": self.logit_bias,
            "max_tokens": self.max_tokens,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "seed": self.seed,
            "top_logprobs": self.logprobs,
            "prompt_logprobs": self.prompt_logprobs,
        }
        return SamplingParams(ignore_eos=self.ignore_eos, **{k: v for k, v in given.items() if v is not None})


class ContentPart(RequestModel):
    """One image of a vision-language prompt, in prompt order."""

    type: Literal["image_url"]
    url: str
    """A data URL (`data:image/png;base64,...`): the server reads no files and fetches nothing."""


class TokenGenerateRequest(RequestModel):
    model: str | None = None
    """If set, must be a served model name."""
    token_ids: list[TokenId] = Field(min_length=1)
    sampling_params: TokenSamplingParams = TokenSamplingParams()
    request_id: str | None = None
    """Echoed in the response (else it carries a fresh one)."""
    content_parts: list[ContentPart] | None = None
    return_token_ids: bool = False
    """Accepted: the response always carries the prompt's ids."""
    features: Any = None
    """vLLM's preprocessed multimodal tensors: refused (tandem preprocesses images itself from `content_parts`)."""
    cache_salt: str | None = None
    priority: int = 0
    stream: Literal[False] = False

    @model_validator(mode="after")
    def _no_features(self) -> TokenGenerateRequest:
        if self.features is not None:
            raise ValueError(
                "features: preprocessed multimodal inputs are not accepted; send the images as content_parts "
                "(data URLs) and the server preprocesses them"
            )
        return self

    def generate_request(self) -> GenerateRequest:
        """The same request in tandem's `/generate` shape."""
        images = [[part.url for part in self.content_parts]] if self.content_parts else None
        return GenerateRequest(
            prompt_token_ids=self.token_ids,
            images=images,
            n=self.sampling_params.n,
            sampling=self.sampling_params.sampling(),
            model=self.model,
        )


class TokenLogprob(WireModel):
    token: str
    """`"token_id:<id>"`."""
    logprob: float
    bytes: list[int] | None = None


class SampledTokenLogprob(TokenLogprob):
    top_logprobs: list[TokenLogprob] = Field(default_factory=list)


class ChoiceLogprobs(WireModel):
    content: list[SampledTokenLogprob]


class TokenChoice(WireModel):
    index: int
    token_ids: list[int]
    logprobs: ChoiceLogprobs | None
    finish_reason: str
    stop_reason: str | int | None = None
    sampling_mask: list[list[int]] | None = None
    """Per token, the ids its sampler kept (all of the vocabulary where nothing was cut); null when sampling
    never truncates."""
    policy_versions: list[int]
    """Per token, the policy version of the weights that sampled it (tandem's)."""
    routed_experts: RoutedExperts | None = None
    """With `inference.return_routed_experts` (MoE models): the routing of prompt + completion positions from
    `routed_experts_prompt_start`, the last token's excepted (it never ran through the model)."""


class Placeholder(WireModel):
    offset: int
    length: int


class TokenGenerateResponse(WireModel):
    request_id: str
    model: str
    choices: list[TokenChoice]
    prompt_token_ids: list[int]
    """The prompt as it ran: `token_ids`, each image's placeholder expanded."""
    mm_placeholders: dict[str, list[Placeholder]] | None = None
    """With images: each image's expanded placeholder tokens in `prompt_token_ids`."""
    prompt_logprobs: list[float | None] | None = None
    policy_version: int


def token_id(token: int) -> str:
    return f"token_id:{token}"


def _choice_logprobs(sample: SampleOutput, top_n: int | None) -> ChoiceLogprobs | None:
    if top_n is None:
        return None
    tops = sample.top_logprobs or [[] for _ in sample.token_ids]
    content = [
        SampledTokenLogprob(
            token=token_id(token),
            logprob=logprob,
            top_logprobs=[TokenLogprob(token=token_id(t), logprob=lp) for t, lp in top[:top_n]],
        )
        for token, logprob, top in zip(sample.token_ids, sample.logprobs, tops, strict=True)
    ]
    return ChoiceLogprobs(content=content)


def _sampling_mask(sample: SampleOutput, vocab_size: int | None) -> list[list[int]] | None:
    if sample.masks is None or vocab_size is None:
        return None
    return [decode_kept_ids(kept) if kept is not None else list(range(vocab_size)) for kept in sample.masks]


def _routed_experts(sample: SampleOutput, start: int) -> RoutedExperts | None:
    return None if sample.routed_experts is None else sample.routed_experts.from_position(start)


def token_response(
    body: TokenGenerateRequest, response: GenerateResponse, *, vocab_size: int | None
) -> TokenGenerateResponse:
    """`/generate`'s answer to `body.generate_request()` in this route's shape; without `vocab_size`, no
    `sampling_mask` (for a client that keeps the kept ids another way)."""
    (output,) = response.outputs
    top_n = body.sampling_params.logprobs
    choices = [
        TokenChoice(
            index=index,
            token_ids=sample.token_ids,
            logprobs=_choice_logprobs(sample, top_n),
            finish_reason=sample.finish_reason,
            stop_reason=sample.stop_reason,
            sampling_mask=_sampling_mask(sample, vocab_size),
            policy_versions=sample.versions,
            routed_experts=_routed_experts(sample, body.sampling_params.routed_experts_prompt_start or 0),
        )
        for index, sample in enumerate(output.samples)
    ]
    spans = output.image_spans
    return TokenGenerateResponse(
        request_id=body.request_id or response.id,
        model=response.model,
        choices=choices,
        prompt_token_ids=output.prompt_token_ids or body.token_ids,
        mm_placeholders={"image": [Placeholder(offset=s, length=e - s) for s, e in spans]} if spans else None,
        prompt_logprobs=output.prompt_logprobs,
        policy_version=response.policy_version,
    )
