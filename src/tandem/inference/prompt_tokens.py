"""Tokenizing a request's prompt text, refusing text that cannot fit the context before the tokenizer runs.

Tokenizing takes time and memory that grow with the text, and far worse than linearly for text without
whitespace (one 10 MB "word": 17 s and 2.6 GB), only for the engine to refuse the prompt as longer than the
context. So a text (a completion's prompt; a chat's conversation and tools as the chat template renders them) of
more than `max_chars` characters is refused outright: by default `MAX_CHARS_PER_TOKEN` per token of the context,
which no natural text reaches (English averages about 4, code and CJK fewer). A shorter text much longer than
`CHARS_PER_TOKEN * max_model_len` characters is first tokenized up to a whitespace near that length: the
tokenizers served here (byte-level BPE, SentencePiece) start a new piece at a whitespace, so that beginning has no
more tokens than the same text has in the whole prompt; if it already fills the context, the prompt is refused
without tokenizing the rest.
"""

from __future__ import annotations

from typing import Any

from tandem.inference.limits import RequestRefused

MAX_CHARS_PER_TOKEN = 32
"""The default `max_prompt_chars` per token of context: 8 times an English token; a text past it is refused
untokenized."""
CHARS_PER_TOKEN = 8
"""About twice the characters of an English token: the beginning tried is long enough for nearly any text."""
WHITESPACE = (" ", "\n", "\t")


class ContextTokenizer:
    """The tokenizer, for prompts: calling it refuses text that cannot fit `max_model_len` tokens (RequestRefused),
    text over `max_chars` (default `MAX_CHARS_PER_TOKEN * max_model_len`) before it is tokenized at all;
    everything else is the tokenizer's."""

    def __init__(self, tokenizer: Any, max_model_len: int, max_chars: int | None = None) -> None:
        self._tokenizer, self.max_model_len = tokenizer, max_model_len
        self.max_chars = MAX_CHARS_PER_TOKEN * max_model_len if max_chars is None else max_chars

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def __call__(self, text: Any, **kwargs: Any) -> Any:
        if isinstance(text, str):
            self._refuse_beyond_context(text, kwargs)
        return self._tokenizer(text, **kwargs)

    def _refuse_beyond_context(self, text: str, kwargs: dict[str, Any]) -> None:
        if len(text) > self.max_chars:
            raise RequestRefused(
                f"prompt: {len(text)} characters (a chat's: its messages and tools as the chat template renders "
                f"them), more than this server tokenizes: max_prompt_chars = {self.max_chars} (default "
                f"{MAX_CHARS_PER_TOKEN} per token of the {self.max_model_len}-token context, seq_len)"
            )
        cut = CHARS_PER_TOKEN * self.max_model_len
        if len(text) <= 2 * cut:
            return
        end = max(text.rfind(space, 0, cut) for space in WHITESPACE)
        if end <= 0:
            return
        tokens = len(self._tokenizer(text[:end], **kwargs).input_ids)
        if tokens >= self.max_model_len:
            raise RequestRefused(
                f"prompt: its first {end} of {len(text)} characters already make {tokens} tokens; the context is "
                f"{self.max_model_len} (seq_len), which leaves no room for a completion"
            )
