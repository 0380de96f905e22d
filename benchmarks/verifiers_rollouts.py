"""Rollouts/s of one single-turn task as a native tandem taskset and as a verifiers environment (baseline: native).

    python benchmarks/verifiers_rollouts.py [--groups 16] [--group-size 8] [--concurrency 64] [--smoke]

One built-in server (a tiny random Qwen3 on this machine's device) serves both; both run through the
orchestrator's own `Rollouts.roll` with `concurrency / group_size` groups in flight (so `concurrency` rollouts),
the same prompts ("Write word i."), the same sampling (temperature 1, `--max-tokens` tokens, ignoring EOS so
every rollout generates the same number of tokens) and the same reward (the fraction of e's). The native source
is one `/generate` request per group; the verifiers source runs each rollout as a verifiers episode: verifiers'
chat program (the `null` harness) started as a process, its model call through verifiers' interception server
and train client (`renderers`) to the orchestrator's token gateway. The ratio is the per-rollout overhead of
that path.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
TASKSETS = REPO / "tests" / "support" / "verifiers_tasksets"
QWEN3_MARKERS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")


def serve(model_dir: Path, out: Path, seq_len: int):
    """The built-in server on a loopback port, in this process (its engine on a thread)."""
    import socket
    import threading

    import uvicorn
    from transformers import AutoTokenizer

    from tandem.config.inference import InferenceConfig
    from tandem.inference.engine import Engine
    from tandem.inference.main import eos_token_ids
    from tandem.inference.server import InferenceServer
    from tandem.models import load_model

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = InferenceConfig(model={"name": str(model_dir), "dtype": "float32"}, seq_len=seq_len, device=device)
    model = load_model(model_dir, dtype=torch.float32, device=device)
    engine = Engine(model, config, tokenizer=tokenizer, eos_token_ids=eos_token_ids(model_dir, tokenizer)).start()
    app = InferenceServer(engine, tokenizer, "tiny", admin_token=None, weights_dir=out).app()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, lifespan="off", access_log=False))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", tokenizer, engine, server


async def measure(url: str, tokenizer, source: dict, groups: int, group_size: int, in_flight: int) -> dict:
    from tandem.config.orchestrator import InferencePoolConfig, TrainSourceConfig
    from tandem.orchestrator.pool import InferencePool
    from tandem.orchestrator.rollouts import Group, Rollouts
    from tandem.orchestrator.tasks import Draw, load_sources

    sources = load_sources([TrainSourceConfig(**source)])
    pool = InferencePool(InferencePoolConfig(base_urls=[url]))
    rollouts = Rollouts(tokenizer, pool, sources, seq_len=512, group_size=group_size, seed=0, max_long_streak=1000)
    await rollouts.start()
    try:
        gate = asyncio.Semaphore(in_flight)

        async def one(index: int):
            async with gate:
                draw = Draw(index, sources[0], sources[0].next_task(), {})
                return await rollouts.roll(draw)

        await one(-1)  # warm: the harness program's environment, the renderer, the first compiles
        started = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(groups)))
        wall = time.perf_counter() - started
    finally:
        await rollouts.close()
        await pool.close()
    kept = [r for r in results if isinstance(r, Group)]
    n = sum(len(g.completions) for g in kept)
    rewards = [r for g in kept for r in g.rewards]
    return {"rollouts": n, "wall_s": wall, "rollouts_per_s": n / wall, "reward": sum(rewards) / max(1, len(rewards))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=64, help="rollouts in flight")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--smoke", action="store_true", help="2 groups of 2, 8 tokens: check it runs")
    args = parser.parse_args()
    if args.smoke:
        args.groups, args.group_size, args.concurrency, args.max_tokens = 2, 2, 4, 8
    sys.path.insert(0, str(TASKSETS))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(TASKSETS), os.environ.get("PYTHONPATH", "")])
    from tandem.testing import write_tiny_model

    sampling = {"temperature": 1.0, "max_tokens": args.max_tokens, "ignore_eos": True}
    agent = {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}
    runs = {
        "native taskset (baseline)": {"id": "tandem.testing.toy_envs:LetterE", "sampling": sampling},
        "verifiers env": {
            "id": "vf_letters",
            "sampling": sampling,
            "verifiers": {"env": {"agent": agent, "taskset": {"num_tasks": 64}}, "renderer": {"name": "qwen3"}},
        },
    }
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        model = write_tiny_model(out / "model", "qwen3", extra_special=QWEN3_MARKERS)
        url, tokenizer, engine, server = serve(model, out, 512)
        in_flight = max(1, args.concurrency // args.group_size)
        results = {}
        for name, source in runs.items():
            results[name] = asyncio.run(measure(url, tokenizer, source, args.groups, args.group_size, in_flight))
        server.should_exit = True
        engine.stop()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    print(f"{args.groups} groups of {args.group_size}, {args.concurrency} rollouts in flight, "
          f"{args.max_tokens} tokens each, on {device}")  # fmt: skip
    base = results["native taskset (baseline)"]["rollouts_per_s"]
    print(f"{'source':<28}{'rollouts':>9}{'wall s':>9}{'rollouts/s':>12}{'x native':>10}")
    for name, r in results.items():
        print(
            f"{name:<28}{r['rollouts']:>9}{r['wall_s']:>9.1f}{r['rollouts_per_s']:>12.1f}{r['rollouts_per_s'] / base:>10.2f}"
        )


if __name__ == "__main__":
    main()
