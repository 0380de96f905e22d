"""Evaluation: environments against any OpenAI-compatible server, with a resumable trace stream.

`client` (retrying HTTP client) and `concurrency` (AIMD limiter) know nothing
about evals; the orchestrator reuses them for training rollouts. `runner`
rolls out and scores through `tandem.envs`, `traces` is the append-only
stream, `summary` turns traces into results, `main` is `tandem eval`.
See docs/eval.md.
"""
