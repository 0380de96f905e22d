"""vLLM as tandem's scale-out engine: a vLLM OpenAI-compatible server that also speaks tandem's contract.

`tandem inference --engine vllm` (launch.py) starts vLLM's own server in-process with two of vLLM's extension
points filled in: an ASGI middleware (routes.py) that answers `/generate`, `/update_weights`, `/pause`,
`/resume` and `/health` exactly as the built-in server does, and a worker extension (worker.py) that loads a
policy checkpoint directory into the running model in place. Every other route is vLLM's. vLLM is imported
only by these modules, and only when the engine is vllm; without it installed, `tandem inference --engine vllm`
says how to install it. docs/inference.md, "Running with vLLM".
"""
