"""Incremental detokenization and stop strings, a few tokens at a time.

Decoding the whole completion after every token is quadratic; decoding each token alone breaks multi-byte
characters and leading spaces. The prefix/read-offset scheme (as in vLLM and TGI) decodes a short window
twice per token and keeps text only once it no longer ends in a partial character.
"""

from __future__ import annotations

from typing import Any

PROMPT_CONTEXT_TOKENS = 5
"""Prompt tokens decoded as context before the completion, so its first word keeps its leading space."""


class IncrementalDetokenizer:
    """The text of a completion as tokens arrive; stops at the first stop string, which is cut off."""

    def __init__(self, tokenizer: Any, prompt: list[int], stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.ids = prompt[-PROMPT_CONTEXT_TOKENS:]
        self.prefix_offset, self.read_offset = 0, len(self.ids)
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.stopped_by: str | None = None

    def push(self, token_id: int) -> bool:
        """Add a token; True when the text now contains a stop string (the text is cut before it)."""
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        full = decode(self.ids[self.prefix_offset :], skip_special_tokens=True)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False
        search_from = max(0, len(self.text) - self.holdback)
        self.text += full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        hits = [(at, s) for s in self.stop if (at := self.text.find(s, search_from)) >= 0]
        if not hits:
            return False
        at, self.stopped_by = min(hits)
        self.text = self.text[:at]
        return True

    def stable_length(self, finished: bool) -> int:
        """Characters safe to send: all when finished, else all but what could still begin a stop string."""
        return len(self.text) if finished else max(0, len(self.text) - self.holdback)
