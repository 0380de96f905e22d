"""Rollout sampling settings as the request carries them: one mapping from the config, none left behind."""

from __future__ import annotations

from tandem.config.orchestrator import RolloutSamplingConfig
from tandem.orchestrator.rollouts import sampling_params


def test_every_rollout_sampling_setting_reaches_the_request():
    """Each field of `[orchestrator.source.sampling]`, set off its default, arrives in the wire's SamplingParams
    under its own name; the request's token budget and seed are this request's own."""
    config = RolloutSamplingConfig(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, max_tokens=64, ignore_eos=True)
    defaults = RolloutSamplingConfig()
    assert all(getattr(config, name) != getattr(defaults, name) for name in RolloutSamplingConfig.model_fields)
    params = sampling_params(config, max_tokens=17, seed=5)
    sent = params.model_dump(exclude_none=True)
    assert {name: sent[name] for name in RolloutSamplingConfig.model_fields} == {
        **config.model_dump(),
        "max_tokens": 17,
    }
    assert params.seed == 5
