"""Tokenizing a request's prompt text, refusing one that cannot fit the context from its beginning alone.

Tokenizing a multi-megabyte prompt takes seconds of a core, only for the engine to refuse it as longer than the
context. A text much longer than `CHARS_PER_TOKEN * max_model_len` characters is first tokenized up to a
whitespace near that length: the tokenizers served here (byte-level BPE, SentencePiece) start a new piece at a
whitespace, so that beginning has no more tokens than the same text has in the whole prompt; if it already fills
the context, the prompt is refused without tokenizing the rest. A text that packs more characters into a token
than that is tokenized whole, as any other (the body-size limit bounds it).
"""

from __future__ import annotations

from typing import Any

from tandem.inference.limits import RequestRefused

CHARS_PER_TOKEN = 8
"""About twice the characters of an English token: the beginning tried is long enough for nearly any text."""
WHITESPACE = (" ", "\n", "\t")


class ContextTokenizer:
    """The tokenizer, for prompts: calling it refuses text that cannot fit `max_model_len` tokens (RequestRefused);
    everything else is the tokenizer's."""

    def __init__(self, tokenizer: Any, max_model_len: int) -> None:
        self._tokenizer, self.max_model_len = tokenizer, max_model_len

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def __call__(self, text: Any, **kwargs: Any) -> Any:
        if isinstance(text, str):
            self._refuse_beyond_context(text, kwargs)
        return self._tokenizer(text, **kwargs)

    def _refuse_beyond_context(self, text: str, kwargs: dict[str, Any]) -> None:
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
