"""A reward a 4-layer model learns in a few RL steps, for the CI proof that `tandem rl` optimises rewards."""

from __future__ import annotations

from tandem.envs.base import metric, reward
from tandem.envs.builtin.reverse_text import ReverseText


class LetterE(ReverseText):
    """The reverse-text prompts, rewarded by the fraction of the reply's characters that are 'e'."""

    @reward
    def similarity(self, completion: str) -> float:
        text = completion.strip()
        return sum(char == "e" for char in text) / max(1, len(text))

    @metric
    def exact(self, completion: str, answer: str) -> float:
        return float(completion.strip() == answer)
