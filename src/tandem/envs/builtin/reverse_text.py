"""reverse_text: reverse a short random phrase; reward is the similarity to the exact reversal."""

from __future__ import annotations

import random
from difflib import SequenceMatcher

from tandem.envs.base import Task, metric, reward
from tandem.envs.synthetic import SyntheticTaskset

WORDS = (
    "apple river stone cloud green quiet seven orange tiger window paper silver "
    "garden candle rocket forest yellow winter summer planet bridge castle pencil "
    "mirror butter honey lemon violet copper marble anchor basket falcon"
).split()


class ReverseText(SyntheticTaskset):
    """Reverse `min_words`..`max_words` random words character by character."""

    def __init__(self, seed: int = 0, num_tasks: int | None = None, min_words: int = 2, max_words: int = 5) -> None:
        super().__init__(seed, num_tasks)
        if not 1 <= min_words <= max_words:
            raise ValueError(f"need 1 <= min_words <= max_words, got {min_words} and {max_words}")
        self.min_words, self.max_words = min_words, max_words

    def make_task(self, idx: int, rng: random.Random) -> Task:
        text = " ".join(rng.choices(WORDS, k=rng.randint(self.min_words, self.max_words)))
        return Task(
            idx=idx,
            id=f"reverse_text-{self.seed}-{idx}",
            name="reverse_text",
            prompt=f"Reverse the following text character by character. Reply with the reversed text only.\n\n{text}",
            answer=text[::-1],
            info={"text": text},
        )

    @reward
    def similarity(self, completion: str, answer: str) -> float:
        """Longest-matching-blocks ratio in [0, 1], so partial reversals earn partial credit."""
        return SequenceMatcher(None, completion.strip(), answer).ratio()

    @metric
    def exact(self, completion: str, answer: str) -> float:
        return float(completion.strip() == answer)
