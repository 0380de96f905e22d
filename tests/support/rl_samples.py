"""RL training samples as the orchestrator builds them, for the RL trainer's tests: GRPO groups of varied lengths."""

from __future__ import annotations

import random

from tandem.orchestrator.advantages import group_advantages, loss_weights
from tandem.orchestrator.batching import TrainSample

SEQ_LEN = 64
"""The row length the samples are packed into."""


def make_samples(aggregation: str, seed: int = 0) -> list[TrainSample]:
    """3 prompts x 4 rollouts of varied lengths, rewards in [0, 1], GRPO advantages, loss weights."""
    rng = random.Random(seed)
    samples, prompt_of = [], []
    for prompt in range(3):
        prompt_ids = [rng.randrange(3, 500) for _ in range(rng.randint(4, 10))]
        group = []
        for _ in range(4):
            n = rng.randint(3, 20)
            group.append(([rng.randrange(3, 500) for _ in range(n)], rng.random()))
        advantages = group_advantages([r for _, r in group], [len(c) for c, _ in group])
        for (completion, _), advantage in zip(group, advantages, strict=True):
            samples.append(
                TrainSample(
                    prompt_ids=prompt_ids,
                    completion_ids=completion,
                    logprobs=[-rng.uniform(4, 8) for _ in completion],
                    advantage=advantage,
                    weight=0.0,
                    temperature=1.0,
                    versions=[0] * len(completion),
                )
            )
            prompt_of.append(prompt)
    weights = loss_weights([len(s.completion_ids) for s in samples], prompt_of, aggregation)
    for sample, weight in zip(samples, weights, strict=True):
        sample.weight = weight
    return samples
