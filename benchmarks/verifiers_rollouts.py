"""Rollouts/s of one single-turn task as a native tandem taskset and as a verifiers environment (baseline: native),
and of verifiers' two ways to run episodes: in this process or in an `EnvServer` pool (baseline: in-process).

    python benchmarks/verifiers_rollouts.py [--groups 16] [--group-size 8] [--concurrency 64] [--smoke]
    python benchmarks/verifiers_rollouts.py --shape qwen3-0.6b --max-tokens 256 --env-server-workers 4   # a GPU

One built-in server (`tandem inference` in its own process, its defaults; a random Qwen3 on this machine's
device: `tiny`, or `qwen3-0.6b`, Qwen3-0.6B's layers with the tiny tokenizer's vocabulary, in bf16 on a GPU)
serves every row, the same prompts ("Write word i."), the same
sampling (temperature 1, `--max-tokens` tokens, ignoring EOS so every rollout generates the same number of
tokens) and the same reward (the fraction of e's), `--concurrency` rollouts in flight.

First table: both sources through the orchestrator's own `Rollouts.roll`, `concurrency / group_size` groups in
flight. The native source is one `/generate` request per group; the verifiers source runs each rollout as a
verifiers episode: verifiers' chat program (the `null` harness) started as a process, its model call through
verifiers' interception server and train client (`renderers`) to the orchestrator's token gateway. The ratio is
the per-rollout overhead of that path.

Second table (with `--env-server-workers W`): the same verifiers episodes through verifiers' eval client (the
server's chat route, no gateway), run by `Env.run_slot` in this process (tandem's choice) and by an `EnvServer`
pool of W worker processes (`serve_env`, as prime-rl runs them), reached through `EnvClient.run`; with the CPU
time each rollout cost this process and the harness programs it started.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
TASKSETS = REPO / "tests" / "support" / "verifiers_tasksets"


QWEN3_0_6B = {"hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
              "head_dim": 128, "intermediate_size": 3072}  # fmt: skip
"""Qwen3-0.6B's layers (its config.json); the vocabulary stays the tiny tokenizer's."""


@contextlib.contextmanager
def serve(model_dir: Path, out: Path, seq_len: int) -> Iterator[str]:
    """`tandem inference` on the model, in a process of its own as in a real run (bf16 on a GPU), while the block
    runs: its URL."""
    from tandem.config.common import LoadedModelConfig
    from tandem.eval.local_server import local_server

    dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    model = LoadedModelConfig(name=str(model_dir), dtype=dtype)
    with local_server(model, run_dir=out, seq_len=seq_len, log_level="warning", startup_timeout_s=600,
                      served_model_name="tiny") as url:  # fmt: skip
        yield url


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


async def measure_modes(
    url: str, env_data: dict, prompts: int, concurrency: int, pools: list[int], sampling: dict
) -> dict:
    """rollouts/s of `prompts` verifiers episodes through the eval client: in-process, then an EnvServer pool of
    each size in `pools`."""
    import multiprocessing

    import verifiers.v1 as vf
    from verifiers.v1.configs.client import EvalClientConfig
    from verifiers.v1.serve.client import EnvClient
    from verifiers.v1.serve.pool import serve_env

    env = vf.load_environment(vf.resolve_env_config(env_data))
    tasks = list(env.taskset.select(vf.SelectConfig(limit=prompts)))
    client = EvalClientConfig(base_url=f"{url}/v1", api_key_var="TANDEM_EVAL_API_KEY")
    context = vf.ModelContext(model="tiny", client=client, sampling=vf.SamplingConfig(**sampling))
    gate = asyncio.Semaphore(concurrency)
    results = {}

    async def timed(run_one) -> dict:
        async def one(task):
            async with gate:
                return await run_one(task)

        await one(tasks[0])  # warm
        started, cpu = time.perf_counter(), os.times()
        episodes = await asyncio.gather(*(one(task) for task in tasks))
        wall, spent = time.perf_counter() - started, os.times()
        ok = sum(1 for e in episodes if _episode_ok(e))
        here = spent.user + spent.system - cpu.user - cpu.system
        children = spent.children_user + spent.children_system - cpu.children_user - cpu.children_system
        return {"rollouts": ok, "wall_s": wall, "rollouts_per_s": ok / wall,
                "cpu_ms": 1000 * here / len(tasks), "child_cpu_ms": 1000 * children / len(tasks)}  # fmt: skip

    async with env.serving():
        results["in-process run_slot (baseline)"] = await timed(lambda t: env.run_slot(env.slots(t, 1)[0], context))
    spawn = multiprocessing.get_context("spawn")
    for workers in pools:
        addresses = spawn.Queue()
        server = spawn.Process(
            target=serve_env,
            kwargs={"max_workers": workers, "address": "tcp://127.0.0.1:0", "address_queue": addresses,
                    "config_data": env_data, "elastic": False},
        )  # fmt: skip  # not a daemon: the pool starts worker processes of its own
        server.start()
        try:
            remote = EnvClient(addresses.get(timeout=120))
            name = f"EnvServer pool, {workers} workers"
            results[name] = await timed(
                lambda t, remote=remote: remote.run(
                    client, "tiny", vf.SamplingConfig(**sampling), task_data=t.data.model_dump()
                )
            )
        finally:
            server.terminate()
            server.join(30)
    return results


def _episode_ok(episode) -> bool:
    """An episode whose traces all finished without error (an in-process `Episode` or an EnvServer's record)."""
    ok = episode.ok if hasattr(episode, "ok") else episode.get("ok")
    return bool(ok)


def _table(title: str, results: dict, baseline: str) -> None:
    """The rows against `baseline`; `cpu ms` is this process's CPU time a rollout, `child ms` that of the
    processes it started and reaped (the harness programs; an EnvServer pool's workers are not reaped here)."""
    print(title)
    base = results[baseline]["rollouts_per_s"]
    print(f"{'run':<36}{'rollouts':>9}{'wall s':>9}{'rollouts/s':>12}{'x base':>8}{'cpu ms':>8}{'child ms':>9}")
    for name, r in results.items():
        ratio = r["rollouts_per_s"] / base
        cpu = f"{r['cpu_ms']:>8.0f}" if "cpu_ms" in r else f"{'-':>8}"
        child = f"{r['child_cpu_ms']:>9.0f}" if r.get("child_cpu_ms", 0) >= 1 else f"{'-':>9}"
        print(f"{name:<36}{r['rollouts']:>9}{r['wall_s']:>9.1f}{r['rollouts_per_s']:>12.1f}{ratio:>8.2f}{cpu}{child}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=64, help="rollouts in flight")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--shape", choices=("tiny", "qwen3-0.6b"), default="tiny", help="the served model's layers")
    parser.add_argument("--env-server-workers", type=int, nargs="*", default=[],
                        help="W ...: also compare an EnvServer pool of W workers (each size in turn)")  # fmt: skip
    parser.add_argument("--smoke", action="store_true", help="2 groups of 2, 8 tokens: check it runs")
    args = parser.parse_args()
    if args.smoke:
        args.groups, args.group_size, args.concurrency, args.max_tokens = 2, 2, 4, 8
    sys.path.insert(0, str(TASKSETS))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(TASKSETS), os.environ.get("PYTHONPATH", "")])
    from transformers import AutoTokenizer

    from tandem.envs.verifiers import uv_environment
    from tandem.testing import write_tiny_model
    from tandem.testing.tiny import QWEN3_MARKERS

    os.environ.update(uv_environment())
    os.environ.setdefault("TANDEM_EVAL_API_KEY", "EMPTY")
    sampling = {"temperature": 1.0, "max_tokens": args.max_tokens, "ignore_eos": True}
    agent = {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}
    prompts = args.groups * args.group_size
    env = {"agent": agent, "taskset": {"num_tasks": max(64, prompts)}}
    runs = {
        "native taskset (baseline)": {"id": "tandem.testing.toy_envs:LetterE", "sampling": sampling},
        "verifiers env": {
            "id": "vf_letters",
            "sampling": sampling,
            "verifiers": {"env": env, "renderer": {"name": "qwen3"}},
        },
    }
    shape = QWEN3_0_6B if args.shape == "qwen3-0.6b" else {}
    seq_len = 512
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        model = write_tiny_model(out / "model", "qwen3", extra_special=QWEN3_MARKERS, **shape)
        tokenizer = AutoTokenizer.from_pretrained(model)
        with serve(model, out, seq_len) as url:
            in_flight = max(1, args.concurrency // args.group_size)
            results = {}
            for name, source in runs.items():
                results[name] = asyncio.run(measure(url, tokenizer, source, args.groups, args.group_size, in_flight))
            modes = {}
            if args.env_server_workers:
                env_data = {**env, "taskset": {**env["taskset"], "id": "vf_letters"}}
                modes = asyncio.run(measure_modes(url, env_data, prompts, args.concurrency, args.env_server_workers,
                                                  {**sampling, "seed": 0}))  # fmt: skip
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    print(f"{args.shape} model, {args.groups} groups of {args.group_size}, {args.concurrency} rollouts in flight, "
          f"{args.max_tokens} tokens each, on {device}")  # fmt: skip
    _table("sources, through Rollouts.roll", results, "native taskset (baseline)")
    if modes:
        _table("verifiers episodes, through the eval client", modes, "in-process run_slot (baseline)")


if __name__ == "__main__":
    main()
