"""Rewards a tiny model learns in a few RL steps: the CI proofs that `tandem rl` optimises rewards (single- and
multi-turn) and the loss study (`benchmarks/ipo_study.py`) train on them, as `tandem.testing.toy_envs:LetterE`."""

from __future__ import annotations

from typing import Any

from tandem.envs.base import Message, Task, metric, reward
from tandem.envs.builtin.reverse_text import ReverseText
from tandem.envs.multiturn import MultiTurnTaskset


class LetterE(ReverseText):
    """The reverse-text prompts, rewarded by the fraction of the reply's characters that are 'e'."""

    @reward
    def similarity(self, completion: str) -> float:
        text = completion.strip()
        return sum(char == "e" for char in text) / max(1, len(text))

    @metric
    def exact(self, completion: str, answer: str) -> float:
        return float(completion.strip() == answer)


class LetterETurns(LetterE, MultiTurnTaskset):
    """LetterE over two turns: after the first reply the environment asks again, and the reward is the fraction of
    'e' over both replies, so the second turn (whose prompt holds the first reply and the environment's answer)
    has to be trained too."""

    max_turns = 2

    def step(self, task: Task, messages: list[Message], state: dict[str, Any]) -> str | None:
        state["replies"] = state.get("replies", 0) + 1
        return "Again." if state["replies"] == 1 else None

    @reward
    def similarity(self, messages: list[Message]) -> float:
        text = "".join(m["content"].strip() for m in messages if m["role"] == "assistant")
        return sum(char == "e" for char in text) / max(1, len(text))
