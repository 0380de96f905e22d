"""Token-exact multi-turn rollouts: `run_episode` driven by token-in generation.

Turn k+1's prompt is turn k's prompt ids, plus the ids the engine generated for turn k, plus the environment's
answer rendered by the chat template as a suffix and tokenised alone. Earlier turns are never re-tokenised, so
the trainer scores exactly the tokens the sampler produced; the environment's tokens are context, not targets
(`TokenRollout.trained` is False on them).

Rendering a suffix: chat templates render whole conversations, and some (Qwen3's) render an assistant turn
differently once a later message follows it, so a conversation's text is not a prefix of the next one's. The
suffix is therefore taken from two renders that hold no assistant turn at all: `[probe] + answer` with the
generation prompt, minus `[probe]`, `probe` being a fixed user message. What the template writes after the
end-of-turn token the model generated (ChatML's newline after `<|im_end|>`) comes first. A template for which
either difference is not a clean suffix gets a `TemplateSuffixError` naming it: tandem never re-tokenises
silently.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tandem.envs import Message, Task, Taskset
from tandem.envs.multiturn import ContextFull, EpisodeOutcome, run_episode
from tandem.envs.tool_parsers import parser_for

GenerateTokens = Callable[[list[int], int], Awaitable[Any]]
"""`generate(prompt_ids, max_tokens)`: one completion (token_ids, logprobs, versions, finish_reason, kept_ids), as
`orchestrator.pool.Completion`; token ids in, unlike the message-level `envs.Generate`."""

_PROBE: Message = {"role": "user", "content": "probe"}
_PROBE_REPLY = "probe reply"


class TemplateSuffixError(ValueError):
    """The chat template cannot render an environment's answer as a suffix of the conversation so far."""


class ChatSuffixes:
    """The chat template's text for messages that follow a generated assistant turn, and for a first prompt.

    `tools` (OpenAI schemas) are rendered into every prompt; `tool_parser` names the call syntax the environment
    reads, which must be the one the template teaches the model (`TemplateSuffixError` otherwise)."""

    def __init__(self, tokenizer: Any, tools: Sequence[dict] | None = None, tool_parser: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.tools = list(tools) if tools else None
        self.name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        closed = self._render([_PROBE, {"role": "assistant", "content": _PROBE_REPLY}], False)
        if _PROBE_REPLY not in closed:
            raise TemplateSuffixError(f"the chat template of {self.name} does not render an assistant's content")
        self._turn_end = closed[closed.rindex(_PROBE_REPLY) + len(_PROBE_REPLY) :]
        """What the template writes after an assistant reply's text: its end-of-turn token, then any separator."""
        if self.tools:
            self._check_tools(tool_parser)

    def _check_tools(self, tool_parser: str | None) -> None:
        """The template must show the model its tools, in the call syntax the environment parses."""
        names = ", ".join(t["function"]["name"] for t in self.tools or [])
        without = self.tokenizer.apply_chat_template([_PROBE], tokenize=False, add_generation_prompt=True)
        if self._render([_PROBE], True) == without:
            raise TemplateSuffixError(
                f"the chat template of {self.name} does not render tools ({names}): the model would never see "
                "them; use a template that takes `tools` (Qwen3's, Hermes')"
            )
        template = getattr(self.tokenizer, "chat_template", None)
        try:
            written = parser_for(template).name if isinstance(template, str) else None
        except ValueError as error:
            raise TemplateSuffixError(f"the chat template of {self.name}: {error}") from None
        if tool_parser is not None and written is not None and written != tool_parser:
            raise TemplateSuffixError(
                f"the chat template of {self.name} teaches {written!r} tool calls, but the environment parses "
                f"{tool_parser!r} ones: set its tool_parser to {written!r}"
            )

    def _render(self, messages: list[Message], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=self.tools, tokenize=False, add_generation_prompt=generation_prompt
        )

    def prompt_ids(self, messages: list[Message]) -> list[int]:
        """The first turn's prompt, rendered whole with the generation prompt."""
        return self.encode(self._render(messages, True))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def after_reply(self, reply_ids: Sequence[int], answer: list[Message]) -> list[int]:
        """Ids that follow a generated reply: the rest of its turn's closing, then `answer` (the environment's
        messages) and the next generation prompt."""
        stop_text = self.tokenizer.decode(list(reply_ids[-1:]), skip_special_tokens=False)
        closing = self._turn_end
        if stop_text and closing.startswith(stop_text):  # the model wrote the end-of-turn token itself
            closing = closing[len(stop_text) :]
        return self.encode(closing + self.answer_text(answer))

    def answer_text(self, answer: list[Message]) -> str:
        base = self._render([_PROBE], False)
        full = self._render([_PROBE, *answer], True)
        if not full.startswith(base):
            roles = ", ".join(m.get("role", "?") for m in answer)
            raise TemplateSuffixError(
                f"the chat template of {self.name} renders [{roles}] after a conversation by rewriting what came "
                "before it, so the answer cannot be appended as tokens; tandem will not re-tokenise earlier turns "
                "(use a template whose turns render independently)"
            )
        return full[len(base) :]


@dataclass
class TokenRollout:
    """One episode at token level: the prompt and every later token, with per-token training fields."""

    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    trained: list[bool] = field(default_factory=list)
    """True on tokens the engine generated (loss targets); False on the environment's rendered messages."""
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    kept_ids: list[list[int] | None] = field(default_factory=list)
    truncated_replies: bool = False
    """Whether the engine stopped any reply at max_tokens or the context end."""
    any_kept_ids: bool = False
    """Whether any reply came with kept ids (its sampling truncated); else `kept_ids` holds only `[]`."""
    turns: int = 0
    outcome: EpisodeOutcome = "ok"
    messages: list[Message] = field(default_factory=list)
    reward: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)

    def add(self, ids: Sequence[int], *, generated: Any | None = None) -> None:
        """Append context ids, or (`generated`) a completion from the engine with its logprobs and kept ids."""
        if generated is None:
            version = self.versions[-1] if self.versions else 0
            self.completion_ids += ids
            self.trained += [False] * len(ids)
            self.logprobs += [0.0] * len(ids)
            self.versions += [version] * len(ids)
            self.kept_ids += [[] for _ in ids]
            return
        self.completion_ids += generated.token_ids
        self.trained += [True] * len(generated.token_ids)
        self.logprobs += generated.logprobs
        self.versions += generated.versions
        if generated.kept_ids is not None:
            self.any_kept_ids = True
            self.kept_ids += generated.kept_ids
        else:
            self.kept_ids += [[] for _ in generated.token_ids]

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


async def token_episode(
    taskset: Taskset, task: Task, suffixes: ChatSuffixes, generate: GenerateTokens, max_tokens: int, max_len: int
) -> TokenRollout:
    """Play `task` through `run_episode`, each reply generated from the exact ids of the conversation so far.

    `max_tokens` bounds each reply and `max_len` the whole rollout (the trainer's seq_len): a reply or an
    answer that would not fit ends the episode as `truncated` (`ContextFull`).
    """
    prompt = task.messages()
    rollout = TokenRollout(prompt_ids=suffixes.prompt_ids(prompt))
    answered = len(prompt)  # messages already in the ids
    last_reply: list[int] = []

    async def reply(messages: list[Message]) -> str:
        nonlocal answered, last_reply
        if rollout.turns:
            ids = suffixes.after_reply(last_reply, messages[answered:])
            if len(rollout) + len(ids) >= max_len:
                raise ContextFull
            rollout.add(ids)
        room = max_len - len(rollout)
        if room <= 0:
            raise ContextFull
        completion = await generate([*rollout.prompt_ids, *rollout.completion_ids], min(max_tokens, room))
        rollout.add(completion.token_ids, generated=completion)
        rollout.truncated_replies |= completion.finish_reason == "length"
        rollout.turns += 1
        answered, last_reply = len(messages) + 1, list(completion.token_ids)
        return suffixes.tokenizer.decode(completion.token_ids, skip_special_tokens=True)

    episode = await run_episode(taskset, task, reply)
    rollout.outcome = episode.outcome
    if rollout.outcome == "ok" and rollout.truncated_replies:
        rollout.outcome = "truncated"
    rollout.messages = episode.completion
    rollout.reward, rollout.metrics = episode.score.reward, episode.score.metrics
    return rollout
