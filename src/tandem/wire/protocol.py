"""What goes over the wire: the token-in `/generate` contract, the admin bodies and the OpenAI subset served.

Pydantic only (no torch), so the orchestrator and other clients import these without an engine. Requests
forbid unknown fields and are validated strictly (no "0.5" for a float, no 1 for a bool), so a typo or a wrong
type is a 400 that names the field rather than a silently ignored setting. docs/inference.md documents them.
"""

from __future__ import annotations

import base64
import uuid
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, Strict, field_validator, model_validator

FinishReason = Literal["stop", "length", "abort"]
ChatFinishReason = Literal["stop", "length", "abort", "tool_calls"]
"""A chat choice's: `tool_calls` when the model called a tool (the engine's reason was `stop`)."""
MAX_STOP_STRINGS = 16
MIN_TEMPERATURE = 0.01
"""The smallest temperature above 0 (vLLM's floor): far below it `logits / T` overflows fp32 (1e-45 gives inf
and NaN), and near it sampling is already the argmax, so 0 says it better."""
MAX_TEMPERATURE = 100.0
"""Beyond it every distribution is uniform to fp32 precision anyway."""
MAX_INT32 = 2**31 - 1
MAX_SAMPLES = 4096
"""Samples (prompts x n) one request may ask for: each gets its record before the first step runs."""
MAX_PENALTY = 2.0
"""|frequency_penalty| and |presence_penalty| at most this (OpenAI's range)."""
MAX_LOGIT_BIAS = 100.0
"""|logit_bias| values at most this (OpenAI's range)."""
MAX_LOGIT_BIAS_TOKENS = 1024
"""logit_bias entries at most this: each engine step adds every entry for every sample of the request, on the
engine thread, so a vocabulary-sized bias would slow every other request's steps."""


def _temperature(value: float) -> float:
    if 0 < value < MIN_TEMPERATURE:
        raise ValueError(f"must be 0 (greedy) or at least {MIN_TEMPERATURE}")
    return value


# Each sampling bound is written once, here, and shared by /generate and the OpenAI bodies.
Temperature = Annotated[float, Field(ge=0, le=MAX_TEMPERATURE), AfterValidator(_temperature)]
TopP = Annotated[float, Field(gt=0, le=1)]
TopK = Annotated[int, Field(ge=-1, le=MAX_INT32)]
MinP = Annotated[float, Field(ge=0, le=1)]
MaxTokens = Annotated[int, Field(ge=1, le=MAX_INT32)]
SampleCount = Annotated[int, Field(ge=1, le=MAX_SAMPLES)]
TokenId = Annotated[int, Field(ge=0, le=MAX_INT32)]
TopN = Annotated[int, Field(ge=0, le=MAX_INT32)]
"""How many top logprobs; the engine also checks it against the server's max_logprobs."""
Penalty = Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)]
LogitBias = Annotated[
    dict[Annotated[TokenId, Strict(False)], Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]],
    Field(max_length=MAX_LOGIT_BIAS_TOKENS),
]
"""Token id -> bias. Map keys are strings in JSON and msgpack alike, so the ids are read from strings ("5"),
the same way for both bodies."""
Seed = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]
"""Any 64-bit pattern, signed or unsigned."""


class WireModel(BaseModel):
    """Responses (and the base of requests): unknown fields are errors."""

    model_config = ConfigDict(extra="forbid")


class RequestModel(WireModel):
    """Requests: also strict about types, and no NaN or infinity anywhere (`1e400` parses as infinity)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class SamplingParams(RequestModel):
    """How one prompt is sampled. docs/inference.md#sampling says exactly what each knob does."""

    temperature: Temperature = 1.0
    """0 is greedy (argmax; top_k/top_p/min_p are ignored); else at least MIN_TEMPERATURE."""
    top_p: TopP = 1.0
    """Keep the smallest prefix of the sorted (top-k) distribution whose probability reaches top_p."""
    top_k: TopK = 0
    """Keep the k most likely tokens; 0 or -1 turns it off."""
    min_p: MinP = 0.0
    """Keep tokens at least min_p times as likely as the most likely one."""
    frequency_penalty: Penalty = 0.0
    """Subtracted from a token's logit once per time this sample has generated it (OpenAI's, vLLM's)."""
    presence_penalty: Penalty = 0.0
    """Subtracted from a token's logit if this sample has generated it at all."""
    logit_bias: LogitBias = Field(default_factory=dict)
    """Token id -> a bias in [-100, 100] added to its logit before anything else."""
    max_tokens: MaxTokens | None = None
    """Most tokens to generate; unset: until the context (seq_len) is full."""
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    """Strings that end the completion (text endpoints and /generate alike); the text is cut before them."""
    stop_token_ids: list[TokenId] = Field(default_factory=list)
    """Token ids that end the completion (in addition to the model's EOS tokens); they are kept in it."""
    ignore_eos: bool = False
    """Keep generating past EOS tokens (benchmarks)."""
    seed: Seed | None = None
    """Per-request seed: the same seed, prompt and parameters give the same tokens, in any batch."""
    top_logprobs: TopN = 0
    """Also return the top-N tokens and logprobs at each step (N at most the server's max_logprobs)."""
    prompt_logprobs: TopN | None = None
    """Also score the prompt: each prompt token's logprob under the model itself (temperature 1, no truncation,
    penalties or bias; null for the first token), with its top-N alternatives when N > 0. Null: not scored."""

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop_string(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, value: list[str]) -> list[str]:
        if any(not s for s in value):
            raise ValueError("stop strings must not be empty")
        return value

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def truncates(self) -> bool:
        """Whether sampling may drop tokens (and so reports the kept ids of every token)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1 or self.min_p > 0)

    @property
    def penalised(self) -> bool:
        """Whether the logits depend on what the sample generated so far."""
        return self.frequency_penalty != 0 or self.presence_penalty != 0


# --- /generate: token ids in, token ids, logprobs and kept ids out (the training-rollout path) ---


class GenerateRequest(RequestModel):
    prompt_token_ids: list[int] | list[list[int]] = Field(min_length=1)
    """One prompt, or several (each sampled n times)."""
    images: list[list[str]] | None = None
    """A vision-language model's images, one list of data URLs per prompt; each image has one placeholder token
    (the model's `image_token_id`) in its prompt, which the response's `prompt_token_ids` has expanded."""
    n: SampleCount = 1
    """Samples per prompt; they share the prompt's prefill."""
    sampling: SamplingParams = SamplingParams()
    model: str | None = None
    """If set, must be the served model name."""

    @property
    def prompts(self) -> list[list[int]]:
        ids = self.prompt_token_ids
        return [ids] if isinstance(ids[0], int) else ids  # type: ignore[list-item]

    @model_validator(mode="after")
    def _prompts_and_samples(self) -> GenerateRequest:
        if any(not prompt for prompt in self.prompts):
            raise ValueError("prompt_token_ids: a prompt has no tokens")
        if self.images is not None and len(self.images) != len(self.prompts):
            raise ValueError(f"images: one list per prompt ({len(self.prompts)}), got {len(self.images)}")
        check_sample_count(len(self.prompts), self.n)
        return self


def context_room(prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> int:
    """The tokens a prompt of `prompt_tokens` may generate (`max_tokens`, or unset: until the context is full);
    ValueError, with the numbers to change, when it cannot fit `max_model_len`. Every engine's one context check."""
    if prompt_tokens >= max_model_len:
        raise ValueError(
            f"the prompt has {prompt_tokens} tokens; the maximum context length is {max_model_len} (seq_len), "
            "which leaves no room for a completion"
        )
    room = max_model_len - prompt_tokens
    if max_tokens is not None and max_tokens > room:
        raise ValueError(
            f"max_tokens={max_tokens} does not fit: the prompt has {prompt_tokens} tokens and the maximum context "
            f"length is {max_model_len} (seq_len), so at most {room} tokens can be generated"
        )
    return max_tokens or room


def check_sample_count(prompts: int, n: int) -> None:
    """Refuse a request for more than MAX_SAMPLES samples in all (before anything is made for them)."""
    if prompts * n > MAX_SAMPLES:
        raise ValueError(f"{prompts} prompts x n={n} is more than the {MAX_SAMPLES} samples a request may ask for")


class RoutedExperts(WireModel):
    """Per position of prompt + completion from `start`, the experts each MoE layer's router chose: `shape`
    `[positions, moe_layers, k]` ids of `dtype`, row-major, base64 in `data` (vLLM's routed-experts shape)."""

    data: str
    dtype: Literal["uint8", "uint16"]
    shape: tuple[int, int, int]
    start: int = 0

    @classmethod
    def of_bytes(
        cls, raw: bytes, dtype: Literal["uint8", "uint16"], shape: tuple[int, int, int], start: int = 0
    ) -> RoutedExperts:
        return cls(data=base64.b64encode(raw).decode("ascii"), dtype=dtype, shape=shape, start=start)

    def from_position(self, start: int) -> RoutedExperts:
        """The positions from `start` on (`start` clamped to those held)."""
        start = min(max(start, self.start), self.start + self.shape[0])
        positions, layers, top_k = self.shape
        row = layers * top_k * (1 if self.dtype == "uint8" else 2)
        raw = base64.b64decode(self.data)[(start - self.start) * row :]
        shape = (positions - (start - self.start), layers, top_k)
        return RoutedExperts.of_bytes(raw, self.dtype, shape, start)


class SampleOutput(WireModel):
    token_ids: list[int]
    """The completion, including the stop token that ended it (EOS or one of stop_token_ids)."""
    logprobs: list[float]
    """Per token: log-probability under the distribution it was sampled from (docs/inference.md#sampling)."""
    masks: list[str | None] | None
    """Per token: its encoded kept ids (`tandem.wire.kept_ids`; the wire keeps the name `masks`), None where
    nothing was cut; None if never truncating."""
    versions: list[int]
    """Per token: the policy version of the weights that produced it."""
    finish_reason: FinishReason
    stop_reason: str | int | None = None
    """The stop string or stop token id that ended the completion, if one did."""
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """Per token: the top-N `(id, logprob)` pairs, most likely first, when top_logprobs > 0."""
    routed_experts: RoutedExperts | None = None
    """With the server's `return_routed_experts` (MoE models): the routing of positions `[0, prompt + completion
    - 1)`."""


class PromptOutput(WireModel):
    prompt_token_count: int
    samples: list[SampleOutput]
    prompt_token_ids: list[int] | None = None
    """With images: the prompt as it ran, each image's placeholder expanded to one token per merged patch."""
    image_spans: list[tuple[int, int]] | None = None
    """With images: each image's placeholder tokens, `[start, end)` in `prompt_token_ids`."""
    prompt_logprobs: list[float | None] | None = None
    """With sampling.prompt_logprobs: per prompt token, its logprob given the tokens before it (the first null)."""
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    """With sampling.prompt_logprobs = N > 0: per prompt token, the top-N `(id, logprob)` there (the first null)."""


class GenerateResponse(WireModel):
    id: str = Field(default_factory=lambda: f"gen-{uuid.uuid4().hex}")
    """A fresh id for each response, made here so that both engines' responses get one the same way."""
    model: str
    policy_version: int
    """The engine's policy version when the response was made."""
    outputs: list[PromptOutput]
    """One per prompt, in request order."""


# --- admin ---


class UpdateWeightsRequest(RequestModel):
    path: str
    """A Hugging Face checkpoint directory inside the server's weights_dir."""
    version: int = Field(ge=0)
    """The policy version tokens sampled with these weights record."""
    rollback: bool = False
    """Allow a version older than the served one. Refused otherwise, so a late or repeated update never rolls the
    policy back; a resumed orchestrator sets it on its first load, as its run may be older than the servers."""


class UpdateWeightsResponse(WireModel):
    policy_version: int
    load_s: float
    """Seconds spent reading the checkpoint (generation continued meanwhile)."""
    pause_s: float
    """Seconds generation was paused for the swap."""


class EngineStatus(WireModel):
    """`/health`, `/pause`, `/resume`."""

    status: Literal["ok", "error"]
    paused: bool
    policy_version: int
    error: str | None = None


# --- OpenAI subset (plus the vLLM extensions top_k, min_p, stop_token_ids, ignore_eos, return_token_ids) ---


class StreamOptions(RequestModel):
    include_usage: bool = False


class _OpenAIRequest(RequestModel):
    model: str | None = None
    max_tokens: MaxTokens | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    min_p: MinP = 0.0
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    logit_bias: LogitBias | None = None
    """Token id (a string, in JSON) -> bias in [-100, 100]."""
    n: SampleCount = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] = Field(default_factory=list)
    ignore_eos: bool = False
    seed: Seed | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    user: str | None = None
    """Accepted and ignored (an end-user id for the provider's abuse monitoring)."""

    def sampling(self, max_tokens: int | None, top_logprobs: int) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            frequency_penalty=self.frequency_penalty or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            logit_bias=self.logit_bias or {},
            max_tokens=max_tokens,
            stop=self.stop or [],
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            seed=self.seed,
            top_logprobs=top_logprobs,
        )


class CompletionRequest(_OpenAIRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: Annotated[int, Field(ge=0, le=MAX_INT32)] | None = 16
    """0 (with echo) generates nothing: the prompt is only scored."""
    logprobs: TopN | None = None
    """Return the sampled token's logprob and the top-N alternatives at each step."""
    echo: bool = False
    """Each choice's text (and logprobs) starts with the prompt; with logprobs, every prompt token but the
    first is scored too (prompt logprobs)."""

    @model_validator(mode="after")
    def _generates_unless_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 generates nothing, which only makes sense with echo")
        return self

    @model_validator(mode="after")
    def _sample_count(self) -> CompletionRequest:
        prompt = self.prompt
        several = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
        check_sample_count(len(prompt) if several else 1, self.n)
        return self


class ContentPart(RequestModel):
    type: Literal["text"]
    text: str


class ImageUrl(RequestModel):
    url: str
    """A data URL (`data:image/png;base64,...`): the server reads no files and fetches nothing."""
    detail: str | None = None


class ImagePart(RequestModel):
    """An image for a vision-language model (OpenAI's `image_url` part)."""

    type: Literal["image_url"]
    image_url: ImageUrl


class ChatMessage(BaseModel):
    """A chat message; extra keys (tool calls, names, reasoning) go to the chat template unchanged."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: str
    content: str | list[ContentPart | ImagePart] | None = None

    @property
    def image_urls(self) -> list[str]:
        return [part.image_url.url for part in self.content or () if isinstance(part, ImagePart)]

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template reads it: text parts joined, or with images the parts themselves
        (Qwen-VL templates write an image placeholder for each image part)."""
        data = self.model_dump(exclude_none=True)
        if isinstance(self.content, list) and not self.image_urls:
            data["content"] = "".join(part.text for part in self.content if isinstance(part, ContentPart))
        return data


class ResponseFormat(RequestModel):
    """OpenAI's `response_format`: only plain text is served; a JSON mode is refused rather than ignored, since
    a client asking for one would otherwise parse free text as JSON."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None

    @field_validator("type")
    @classmethod
    def _text_only(cls, value: str) -> str:
        if value != "text":
            raise ValueError(f'`{value}` output is not supported by this server; only {{"type": "text"}} is')
        return value


class ChatCompletionRequest(_OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: TopN = 0
    response_format: ResponseFormat | None = None
    store: bool | None = None
    """Accepted and ignored: nothing is stored."""
    tools: list[dict[str, Any]] | None = None
    """OpenAI function tools, rendered by the chat template; each schema is checked (`tool_calls.checked_tools`)."""
    tool_choice: str | dict[str, Any] | None = None
    """"auto" (the default), "none" (tools are not rendered) or {"type": "function", "function": {"name": ...}}."""
    parallel_tool_calls: bool | None = None
    """Accepted and ignored: a reply's calls are however many the model writes."""
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra variables for the chat template (e.g. {"enable_thinking": false} for Qwen3)."""


class Usage(WireModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(WireModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    """None only for the first prompt token of an echo (nothing predicts it)."""
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class CompletionChoice(WireModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None


class CompletionResponse(WireModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(WireModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(WireModel):
    content: list[TokenLogprob]


class FunctionCall(WireModel):
    name: str
    arguments: str
    """The arguments as a JSON string, as OpenAI sends them."""


class ToolCallEntry(WireModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolCallDelta(ToolCallEntry):
    index: int


class AssistantMessage(WireModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallEntry] | None = None


class ChatChoice(WireModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: ChatFinishReason
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(WireModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None


class ChatDelta(WireModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(WireModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: ChatFinishReason | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(WireModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(WireModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tandem"
    max_model_len: int


class ModelList(WireModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
