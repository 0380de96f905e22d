"""Running `tandem` as a user does, in a child process, and reading back what a run leaves.

Every child runs through `tandem.testing.progress`: it may take as long as it keeps making progress (its output,
or anything under its `--output-dir`, changes), so a loaded machine slows a test down instead of failing it, and a
hung child still fails it, killed with everything it started.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from support.jsonl import read_jsonl, read_metrics
from support.model_parity import disk_tensors
from tandem.testing.progress import run_while_progressing


def run_to_end(
    command: Sequence[str], *, watch: Iterable[str | Path] = (), check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run `command` to its end while it makes progress (its output, or anything under `watch`, changes); with
    `check`, a non-zero exit fails the test with the end of its stderr."""
    result = run_while_progressing(command, watch=watch)
    if check:
        assert result.returncode == 0, f"{result.args} exited with {result.returncode}:\n{result.stderr[-4000:]}"
    return result


def tandem_command(*args: str) -> list[str]:
    """The command line of `tandem <args>`, run by this interpreter."""
    return [sys.executable, "-m", "tandem", *args]


def output_dirs(args: Sequence[str]) -> list[Path]:
    """The `--output-dir` a command was given, if any: where its run writes as it goes."""
    return [Path(args[args.index("--output-dir") + 1])] if "--output-dir" in args else []


def run_tandem(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run `tandem <args>` to its end, watching its `--output-dir` for progress (see `run_to_end`)."""
    return run_to_end(tandem_command(*args), watch=output_dirs(args), check=check)


def tandem_sft(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run `tandem sft <args>` to its end."""
    return run_tandem("sft", *args, check=check)


def sft_flags(model_dir: Path, data: Path, out: Path, run_name: str) -> list[str]:
    """`tandem sft` flags for a tiny fp32 run on a chat JSONL file, seeded: runs with the same flags agree."""
    return [
        "--model", str(model_dir), "--model.dtype", "float32", "--data.path", str(data), "--seq-len", "256",
        "--batch-size", "4", "--optim.lr", "3e-3", "--output-dir", str(out), "--run-name", run_name, "--seed", "3",
    ]  # fmt: skip


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The weights a finished run exported (`hf/final`)."""
    from safetensors.torch import load_file

    return load_file(run_dir / "hf" / "final" / "model.safetensors")


def rl_command(model_dir: Path, out: Path, *flags: str) -> list[str]:
    """`tandem rl` on a tiny fp32 model, run "rl" under `out`: 16 rollouts a step in groups of 4, then `flags`
    (a later flag overrides an earlier one)."""
    return tandem_command(
        "rl", "--model", str(model_dir), "--model.dtype", "float32", "--seq-len", "256", "--output-dir", str(out),
        "--run-name", "rl", "--orchestrator.batch-size", "16", "--orchestrator.group-size", "4",
        "--trainer.optim.lr", "1e-3", *flags,
    )  # fmt: skip


def tandem_rl(model_dir: Path, out: Path, *flags: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run `rl_command(model_dir, out, *flags)` to its end."""
    return run_to_end(rl_command(model_dir, out, *flags), watch=[out], check=check)


def reward_trend(run_dir: Path, steps: int) -> tuple[float, float, list[float], list[dict]]:
    """A finished `tandem rl` run of `steps` steps: the mean batch reward of its first and of its last 3 steps
    (printed), every step's reward and the trainer's records."""
    rewards = [r["reward"] for r in read_jsonl(run_dir / "orchestrator_metrics.jsonl") if r.get("kind") != "eval"]
    trainer = read_metrics(run_dir)
    assert len(rewards) == len(trainer) == steps
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    print(f"reward: first 3 steps {first:.3f}, last 3 steps {last:.3f}")
    return first, last, rewards, trainer


def write_rl_sources(folder: Path, env_id: str = "reverse_text") -> str:
    """A sources file for `tandem rl @ FILE`: `env_id` to train on (16 tokens a reply) and an online eval of 3
    arithmetic tasks every 2 steps; returns its path."""
    path = folder / "sources.toml"
    path.write_text(
        f'[[orchestrator.source]]\nid = "{env_id}"\nsampling = {{ max_tokens = 16 }}\n'
        "[orchestrator.eval]\ninterval = 2\n"
        '[[orchestrator.eval.source]]\nid = "arithmetic"\nargs = { num_tasks = 3 }\nsampling = { max_tokens = 8 }\n'
    )
    return str(path)


def two_on_policy_rl_steps(
    model_dir: Path, out: Path, *flags: str, taskset: str = "reverse_text"
) -> tuple[dict[str, torch.Tensor], ...]:
    """`tandem rl` for two steps at async_level 0 on `taskset` (16-token replies, every group trained, no eval),
    checking what any such run shows: two trainer steps, step 2 sampled by the policy of step 1, and a mismatch KL
    below 1e-3 (each batch is sampled by the weights the trainer holds, so it is numerical only). Returns the
    weights of `model_dir` and of the final policy, by Hugging Face name."""
    sources = out / "sources.toml"
    sources.write_text(f'[[orchestrator.source]]\nid = "{taskset}"\nsampling = {{ max_tokens = 16 }}\n')
    tandem_rl(
        model_dir, out, "@", str(sources), "--max-steps", "2", "--orchestrator.async-level", "0",
        "--orchestrator.no-filter-zero-advantage", "--orchestrator.eval.interval", "0", *flags,
    )  # fmt: skip
    run_dir = out / "rl"
    trainer = read_metrics(run_dir)
    rollouts = read_jsonl(run_dir / "orchestrator_metrics.jsonl")
    assert [r["step"] for r in trainer] == [r["step"] for r in rollouts] == [1, 2]
    assert [r["policy_version"] for r in rollouts] == [0, 1]  # step 2 was sampled by the policy of step 1
    assert all(r["mismatch_kl"] is not None and abs(r["mismatch_kl"]) < 1e-3 for r in trainer), trainer
    return disk_tensors(model_dir), disk_tensors(run_dir / "policies" / "step-000002")
