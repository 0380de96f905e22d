"""Evaluation: environments against any OpenAI-compatible server, with a resumable trace stream.

Requests go through `tandem.client` (retries, load feedback), which the
orchestrator shares. `concurrency` (AIMD limiter over that feedback) knows
nothing about evals. `runner` rolls out and scores through `tandem.envs`,
`traces` is the append-only stream, `summary` turns traces into results,
`main` is `tandem eval`. The orchestrator's online evals run `runner` and
`summary` as they are. See docs/eval.md.
"""
