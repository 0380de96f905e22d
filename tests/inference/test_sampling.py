"""The sampler: kept ids exactly as top-k/top-p/min-p define them, logprobs of the final distribution,
seeded draws independent of the batch, empirical frequencies matching the distribution."""

from __future__ import annotations

import json
import math

import pytest
import torch
from pydantic import ValidationError

from tandem.inference.sampling import Sampler, SamplingBatch
from tandem.wire.protocol import SamplingParams

VOCAB = 64


def _sample(logits: torch.Tensor, params: list[SamplingParams], samples=None, steps=None):
    rows = len(params)
    batch = SamplingBatch.build(
        params,
        [p.seed if p.seed is not None else 0 for p in params],
        samples or [0] * rows,
        steps or [0] * rows,
        logits.device,
    )
    return Sampler()(logits, batch)


def _expected_kept(logits: torch.Tensor, p: SamplingParams) -> set[int]:
    """The kept ids computed the plain way, in float64, one rule at a time."""
    z = logits.double() / p.temperature
    order = z.argsort(descending=True).tolist()
    probs = z.softmax(-1)
    keep = order[: p.top_k] if p.top_k > 0 else order
    if p.top_p < 1:
        total = sum(probs[i] for i in keep)
        prefix, mass = [], 0.0
        for i in keep:
            if mass >= p.top_p * total:
                break
            prefix.append(i)
            mass += probs[i]
        keep = prefix
    if p.min_p > 0:
        keep = [i for i in keep if probs[i] >= p.min_p * probs[order[0]]]
    return set(keep)


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    """Well-separated logits (no two tokens within 1e-3 of each other), so cut-offs are unambiguous."""
    g = torch.Generator().manual_seed(seed)
    base = torch.linspace(0, 6, VOCAB)
    return torch.stack([base[torch.randperm(VOCAB, generator=g)] for _ in range(rows)])


CASES = [
    SamplingParams(temperature=1.0, top_k=5, seed=1),
    SamplingParams(temperature=0.7, top_p=0.8, seed=2),
    SamplingParams(temperature=1.3, min_p=0.2, seed=3),
    SamplingParams(temperature=1.0, top_k=20, top_p=0.5, seed=4),
    SamplingParams(temperature=2.0, top_k=30, top_p=0.9, min_p=0.05, seed=5),
]


def test_kept_ids_are_exactly_what_the_rules_keep():
    logits = _logits(len(CASES))
    out = _sample(logits, CASES)
    for row, params in enumerate(CASES):
        expected = _expected_kept(logits[row], params)
        assert set(out.kept_ids[row]) == expected, params
        assert out.tokens[row] in expected
        z = logits[row].double() / params.temperature
        kept = torch.tensor(sorted(expected))
        logprob = z[out.tokens[row]] - z[kept].logsumexp(-1)
        assert out.logprobs[row] == pytest.approx(float(logprob), abs=1e-5)


def test_greedy_is_argmax_with_untempered_logprob_and_no_mask():
    logits = _logits(2)
    out = _sample(logits, [SamplingParams(temperature=0, top_k=3, top_logprobs=4), SamplingParams(temperature=0)])
    for row in range(2):
        assert out.tokens[row] == int(logits[row].argmax())
        assert out.logprobs[row] == pytest.approx(float(logits[row].log_softmax(-1).max()), abs=1e-6)
        assert out.kept_ids[row] is None
    top = out.top[0]
    assert [i for i, _ in top] == logits[0].topk(4).indices.tolist()
    assert top[0][1] == pytest.approx(out.logprobs[0])


def test_top_logprobs_come_from_the_truncated_distribution():
    logits = _logits(1)
    params = SamplingParams(temperature=1.0, top_k=3, top_logprobs=5, seed=0)
    out = _sample(logits, [params])
    assert len(out.top[0]) == 3  # tokens outside the kept ids have probability 0 and are left out
    assert math.fsum(math.exp(lp) for _, lp in out.top[0]) == pytest.approx(1.0, abs=1e-5)


def test_seeded_draws_do_not_depend_on_the_rest_of_the_batch():
    logits = _logits(6, seed=1)
    mine = [SamplingParams(temperature=1.0, seed=42), SamplingParams(temperature=0.9, top_p=0.7, seed=42)]
    alone = _sample(logits[:2], mine, steps=[3, 3])
    others = [SamplingParams(temperature=1.0, seed=s) for s in range(4)]
    crowd = _sample(torch.cat([logits[2:], logits[:2]]), others + mine, steps=[0, 1, 2, 3, 3, 3])
    assert crowd.tokens[4:] == alone.tokens and crowd.logprobs[4:] == alone.logprobs
    draws = {tuple(_sample(logits[:1], [SamplingParams(temperature=1.0, seed=s)]).tokens) for s in range(30)}
    assert len(draws) > 5, "different seeds should give different tokens"


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_p=0.9, top_k=12)],
    ids=["whole-vocab", "truncated"],
)
def test_draws_follow_the_distribution(params):
    draws = 20_000
    logits = _logits(1, seed=2).expand(draws, VOCAB).contiguous()
    out = _sample(logits, [params.model_copy(update={"seed": 7})] * draws, samples=list(range(draws)))
    z = logits[0].double() / params.temperature
    if params.truncates:
        kept = torch.tensor(sorted(_expected_kept(logits[0], params)))
        probs = torch.zeros(VOCAB, dtype=torch.float64)
        probs[kept] = z[kept].softmax(-1)
    else:
        probs = z.softmax(-1)
    freq = torch.bincount(torch.tensor(out.tokens), minlength=VOCAB).double() / draws
    assert (freq - probs).abs().max() < 0.015
    assert freq[probs == 0].sum() == 0


def test_sampling_params_are_validated_strictly():
    for bad in ({"temperature": "0.5"}, {"top_p": 0}, {"top_k": -2}, {"min_p": 1.5}, {"max_tokens": 0}, {"topk": 3}):
        with pytest.raises(ValidationError):
            SamplingParams.model_validate_json(json.dumps(bad))
    assert SamplingParams(stop="\n").stop == ["\n"]
    assert SamplingParams(temperature=0, top_k=5).truncates is False
    assert SamplingParams(temperature=1, top_k=-1).truncates is False
