"""RL throughput on one GPU: the real `tandem rl` (inference, orchestrator and trainer sharing GPU 0) against the
trainer alone and the engine alone on the same work, measured in the same invocation.

    python benchmarks/qwen3_tokenizer.py tok/                                  # once, where PyPI is reachable
    python benchmarks/rl_throughput.py --tokenizer-dir tok/ --out results.json # GPU: Qwen3-0.6B and 1.7B shapes
    python benchmarks/rl_throughput.py --smoke                                 # CPU: a tiny model, every run kind

The setting: random bf16 weights of the model's shape (written once with tandem's build_model and
save_model) and the real Qwen3 tokenizer; 16 prompts x group 16 = 256 rollouts a step of env reverse_text,
256 new tokens each at temperature 1 with `ignore_eos` (fixed-length rollouts), seq_len 4096, no zero-advantage
filtering (every step trains exactly the sampled batch), `--warmup` steps, `--steps` measured steps, and one more
left out (a run's last step also exports the final policy to disk, a one-off cost).
Per model and `--recipe` (trainer switches, RECIPES), the runs are:

- `rl-<model>-async<A>-<recipe>`: `python -m tandem rl` with `orchestrator.async_level` A (1 and 0).
- `sft-<model>`: the trainer alone on the RL batch's rows through the fastest SFT path: `python -m tandem sft @
  examples/advanced/qwen3-1.7b/sft-max-perf.toml --data.fake --random-init` with batch_size the rows of the
  async-1 run's batch and micro_batch_size its micro-batch rows (its fake rows are full 4096-token documents,
  so they hold more attention work than RL's packed short sequences).
- `decode-<model>`: the built-in engine alone (`--worker decode`, in a process of its own), configured by the RL
  run's resolved inference.toml, generating the same batch: 16 prompts x n=16 of the RL batch's mean prompt
  length (random ids), 256 tokens, temperature 1, ignore_eos; one short warm-up batch, then the median wall time
  of `--decode-repeats` batches.
- `replay-<model>-<recipe>`: `python -m tandem trainer` alone (no inference on the GPU) on the async-1 run's kept
  batches, with its resolved trainer.toml and the file hand-off, whose export is taken out of its step times.

Columns. `step s` is the steady step: the median, over the measured steps, of the wall time between consecutive
trainer records (`time` in metrics.jsonl), so it holds the trainer's step and its wait for the batch.
`train s`: the trainer's median `step_time_s`; `tok/s` and `MFU`: its tokens over its step time, and its median
MFU; `rollout tok/s`: the orchestrator's median completion tokens over batch time; `busy tok/s`: completion tokens
over the time with requests in flight (wall time between orchestrator records minus the growth of
`inference_idle_s`); `trn idle` / `inf idle`: the trainer's `idle_s` and inference's idle time over the measured
wall time; `hand-off s`: the trainer's median `publish_s`; `reload s`: the server's median weight-swap time and
`inf GiB` its peak memory, from inference_metrics.jsonl (fields named `*swap*_s` / `*peak*gib*`); `trn GiB`: the
trainer's peak reserved memory. `vs sync = (train + decode) / step` and `vs ideal = step / max(train, decode)`,
where train is the RL step's tokens at the SFT baseline's tokens/s and decode the engine-alone batch time. A
value a run does not report is `-`; a recipe switch this tandem does not have is left out and listed. The
targets follow the tables as pass/fail. The table comes last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # check config keys of the tandem the runs use (PYTHONPATH below)
SFT_RECIPE = ROOT / "examples" / "advanced" / "qwen3-1.7b" / "sft-max-perf.toml"
MODELS = ("qwen3-0.6b", "qwen3-1.7b")
# Trainer switches of a `tandem rl` run, as config keys; a key this tandem's RlConfig lacks is left out (and shown).
RECIPES: dict[str, dict[str, Any]] = {
    "default": {},
    "max-perf": {
        "trainer.compile": True,
        "trainer.loss_chunk_size": 16384,
        "trainer.speed.fused_loss": True,
        "trainer.speed.fused_optimizer": True,
        "trainer.speed.fsdp_single_process": False,
        "trainer.speed.sdpa_backends": ["cudnn", "flash"],
        "trainer.speed.swiglu_kernel": "triton",
        "orchestrator.micro_batch_rows": 4,
    },
}
# LoRA rank 16 on every attention and MLP projection: the base frozen in bf16, adapter-only hand-off.
LORA = {"model.lora.rank": 16, "model.lora.alpha": 32}
RECIPES |= {"lora": LORA, "max-perf-lora": {**RECIPES["max-perf"], **LORA}}
# Settings of every RL run that the benchmark needs: fixed-length rollouts, batches kept for the baselines.
ALWAYS = {"orchestrator.keep_batches": True, "trainer.speed.save_final": False}
LOG_FILES_SHOWN = 40  # lines of each process's log printed when a run fails
TARGETS = {"step_s": 2.5, "vs_ideal": 1.3, "mfu": 0.35, "inference_share": 0.8}


@dataclass
class Setting:
    """What every run of one invocation shares."""

    prompts: int
    group: int
    gen_len: int
    seq_len: int
    warmup: int
    steps: int
    dtype: str
    gpu_memory_utilization: float | None
    transport: str
    decode_repeats: int
    prompt_len: int  # the decode baseline's prompt length when no RL run measured one
    smoke: bool

    @property
    def total_steps(self) -> int:
        """Steps each run trains: the warm-up, the measured steps, and the last one (its final export) left out."""
        return self.warmup + self.steps + 1

    def in_window(self, step: int) -> bool:
        return self.warmup < step <= self.warmup + self.steps


@dataclass
class Run:
    name: str
    kind: str  # "rl" | "sft" | "decode" | "replay"
    model: str
    async_level: int = 1
    recipe: str = "default"


@dataclass
class Result:
    run: Run
    metrics: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    error: str = ""
    seconds: float = 0.0
    command: list[str] = field(default_factory=list)


# --- subprocesses ----------------------------------------------------------------------------------------------


def _env(smoke: bool) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT / "src"), str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}
    return {**env, "CUDA_VISIBLE_DEVICES": ""} if smoke else env


def _tail(path: Path, lines: int = LOG_FILES_SHOWN) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class Failed(RuntimeError):
    """A subprocess failed or ran out of time; the message holds every log tail it left."""


def execute(command: list[str], log: Path, timeout: float, env: dict[str, str], logs: list[Path] = ()) -> None:
    """Run `command` with its output in `log`; on failure or timeout raise Failed with the tails of `log` and `logs`
    (glob patterns of the children's logs). A timeout first interrupts it (tandem rl then stops its children), then
    kills its process group."""
    with log.open("w") as out:
        process = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = process.wait(timeout=max(timeout, 1))
            reason = f"exited with code {code}" if code else ""
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGINT)
            try:
                process.wait(timeout=45)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            reason = f"timed out after {timeout:.0f} s"
    if reason:
        tails = [f"--- {path} ---\n{_tail(path)}" for path in (log, *logs)]
        raise Failed(f"{' '.join(command[:5])} ... {reason}\n" + "\n".join(tails))


def records(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    from tandem.jsonl import read_records

    return read_records(path)


def measured(rows: list[dict[str, Any]], s: Setting) -> list[dict[str, Any]]:
    kept = [r for r in rows if s.in_window(r.get("step", 0))]
    if not kept:
        raise RuntimeError(f"no records of the measured steps {s.warmup + 1}..{s.warmup + s.steps}")
    return kept


def median(values: list[Any]) -> float | None:
    values = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
    return statistics.median(values) if values else None


# --- config keys that may not exist yet ------------------------------------------------------------------------


def has_key(dotted: str) -> bool:
    """Whether `tandem rl`'s config has this key (a list of sections, as `orchestrator.source`, is walked into)."""
    import typing

    from pydantic import BaseModel

    from tandem.config.rl import RlConfig

    model: type[BaseModel] | None = RlConfig
    for part in dotted.split("."):
        if model is None or part not in model.model_fields:
            return False
        annotation = model.model_fields[part].annotation
        candidates = (annotation, *typing.get_args(annotation))
        model = next((a for a in candidates if isinstance(a, type) and issubclass(a, BaseModel)), None)
    return True


def flags(settings: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Command-line flags for the keys this tandem has, and the keys it lacks."""
    out, missing = [], []
    for key, value in settings.items():
        if not has_key(key):
            missing.append(key)
            continue
        *head, last = key.replace("_", "-").split(".")
        if isinstance(value, bool):
            out.append("--" + ".".join([*head, last if value else f"no-{last}"]))
        else:
            out += ["--" + ".".join([*head, last]), json.dumps(value) if isinstance(value, list) else str(value)]
    return out, missing


# --- the runs --------------------------------------------------------------------------------------------------


class Bench:
    def __init__(self, setting: Setting, work: Path, tokenizer_dir: Path | None) -> None:
        self.setting, self.work, self.tokenizer_dir = setting, work, tokenizer_dir
        self.env = _env(setting.smoke)
        self.model_dirs: dict[str, Path] = {}
        self.rl: dict[tuple[str, str], Path] = {}  # (model, recipe) -> the async-1 run's directory
        self.shapes: dict[str, dict[str, Any]] = {}  # model -> the RL batch's shape (rows, tokens, ...)
        self.results: dict[str, Result] = {}

    def model_dir(self, model: str, timeout: float) -> Path:
        """The model's directory (config, random weights, tokenizer), written on first use."""
        if model not in self.model_dirs:
            path = self.work / f"model-{model}"
            if self.setting.smoke:
                from tandem.testing.tiny import write_tiny_model

                write_tiny_model(path)
            else:
                command = [sys.executable, __file__, "--worker", "model", model, str(path), str(self.tokenizer_dir)]
                execute(command, self.work / f"model-{model}.log", timeout, self.env)
            self.model_dirs[model] = path
        return self.model_dirs[model]

    def run(self, run: Run, timeout: float) -> Result:
        result = Result(run)
        began = time.monotonic()
        try:
            model_dir = self.model_dir(run.model, timeout)
            left = timeout - (time.monotonic() - began)
            getattr(self, f"run_{run.kind}")(run, result, model_dir, left)
        except Exception as error:  # a failed run is reported; the others still run
            result.error = f"{type(error).__name__}: {error}"
        result.seconds = time.monotonic() - began
        self.results[run.name] = result
        return result

    # -- tandem rl

    def run_rl(self, run: Run, result: Result, model_dir: Path, timeout: float) -> None:
        s = self.setting
        sources = self.work / f"{run.name}.sources.toml"
        sampling = f"max_tokens = {s.gen_len}, temperature = 1.0"
        if has_key("orchestrator.source.sampling.ignore_eos"):
            sampling += ", ignore_eos = true"
        else:
            result.notes.append("no sampling.ignore_eos")
        sources.write_text(f'[[orchestrator.source]]\nid = "reverse_text"\nsampling = {{ {sampling} }}\n')
        extra, missing = flags({**ALWAYS, **RECIPES[run.recipe]})
        result.notes += [f"missing {key}" for key in missing]
        transport = ["--trainer.weights.transport", s.transport] if s.transport != "auto" else []
        memory = (
            []
            if s.gpu_memory_utilization is None
            else ["--inference.gpu-memory-utilization", str(s.gpu_memory_utilization)]
        )
        command = [
            sys.executable, "-m", "tandem", "rl", "@", str(sources), "--model.name", str(model_dir),
            "--model.dtype", s.dtype, "--seq-len", str(s.seq_len), "--output-dir", str(self.work),
            "--run-name", run.name, "--max-steps", str(s.total_steps),
            "--orchestrator.batch-size", str(s.prompts * s.group), "--orchestrator.group-size", str(s.group),
            "--orchestrator.async-level", str(run.async_level), "--orchestrator.no-filter-zero-advantage",
            "--orchestrator.log-samples", "0", "--inference.log-interval-s", "1", *memory, *transport, *extra,
        ]  # fmt: skip
        result.command = command
        run_dir = self.work / run.name
        try:
            execute(command, self.work / f"{run.name}.log", timeout, self.env, sorted(run_dir.glob("logs/*.log")))
        except Failed:
            raise Failed(self._rl_failure(run, run_dir)) from None
        finally:
            for bulky in ("policies", "checkpoints"):  # a full model per step: drop before the next run
                shutil.rmtree(run_dir / bulky, ignore_errors=True)
        result.metrics.update(rl_metrics(run_dir, s))
        if run.async_level == 1 or (run.model, run.recipe) not in self.rl:
            self.rl[(run.model, run.recipe)] = run_dir
            shape = batch_shape(run_dir, s)
            if shape:
                self.shapes.setdefault(run.model, shape)
            else:
                result.notes.append("no kept batches")

    def _rl_failure(self, run: Run, run_dir: Path) -> str:
        logs = [self.work / f"{run.name}.log", *sorted(run_dir.glob("logs/*.log"))]
        return f"tandem rl failed ({run.name})\n" + "\n".join(f"--- {p} ---\n{_tail(p)}" for p in logs)

    # -- baselines

    def batch_of(self, model: str, result: Result) -> dict[str, Any]:
        """The RL batch's shape, or an estimate from the setting when no RL run of the model left its batches."""
        if model in self.shapes:
            return self.shapes[model]
        s = self.setting
        result.notes.append("batch shape estimated (no RL run)")
        rollouts = s.prompts * s.group
        tokens = rollouts * (s.prompt_len + s.gen_len)
        return {
            "rows": math.ceil(tokens / s.seq_len),
            "micro_rows": 1,
            "tokens": tokens,
            "completion_tokens": rollouts * s.gen_len,
            "prompt_len": s.prompt_len,
        }

    def run_sft(self, run: Run, result: Result, model_dir: Path, timeout: float) -> None:
        s, batch = self.setting, self.batch_of(run.model, result)
        micro = batch["micro_rows"]
        rows = math.ceil(batch["rows"] / micro) * micro
        recipe = [] if s.smoke else ["@", str(SFT_RECIPE)]
        command = [
            sys.executable, "-m", "tandem", "sft", *recipe, "--model.name", str(model_dir), "--model.dtype", s.dtype,
            "--random-init", "--data.fake", "--seq-len", str(s.seq_len), "--batch-size", str(rows),
            "--micro-batch-size", str(micro), "--max-steps", str(s.total_steps), "--speed.no-save-final",
            "--output-dir", str(self.work), "--run-name", run.name,
        ]  # fmt: skip
        result.command = command
        env = {**self.env, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
        execute(command, self.work / f"{run.name}.log", timeout, env, [self.work / run.name / "logs" / "sft.log"])
        result.metrics.update(trainer_metrics(self.work / run.name, s), rows=rows, micro_rows=micro)

    def run_replay(self, run: Run, result: Result, model_dir: Path, timeout: float) -> None:
        source = self.rl.get((run.model, run.recipe))
        if source is None or not sorted((source / "batches").glob("step-*.safetensors")):
            raise RuntimeError(f"no kept batches of an RL run of {run.model} with recipe {run.recipe}")
        run_dir = self.work / run.name
        (run_dir / "batches").mkdir(parents=True)
        batches = sorted((source / "batches").glob("step-*.safetensors"))
        for batch in batches:
            shutil.copy2(batch, run_dir / "batches" / batch.name)
        command = [
            sys.executable, "-m", "tandem", "trainer", "@", str(source / "trainer.toml"), "--output-dir",
            str(self.work), "--run-name", run.name, "--max-steps", str(len(batches)), "--weights.transport", "file",
        ]  # fmt: skip
        result.command = command
        try:
            execute(command, self.work / f"{run.name}.log", timeout, self.env, [run_dir / "logs" / "trainer.log"])
        finally:
            shutil.rmtree(run_dir / "policies", ignore_errors=True)
        result.metrics.update(trainer_metrics(run_dir, self.setting, without_publish=True))

    def run_decode(self, run: Run, result: Result, model_dir: Path, timeout: float) -> None:
        s, batch = self.setting, self.batch_of(run.model, result)
        rl_dir = next((d for (model, _), d in self.rl.items() if model == run.model), None)
        spec = {
            "model_dir": str(model_dir),
            "inference_toml": str(rl_dir / "inference.toml") if rl_dir else None,
            "seq_len": s.seq_len,
            "dtype": s.dtype,
            "gpu_memory_utilization": s.gpu_memory_utilization,
            "prompts": s.prompts,
            "n": s.group,
            "prompt_len": max(1, round(batch["prompt_len"])),
            "gen_len": s.gen_len,
            "repeats": s.decode_repeats,
        }
        out = self.work / f"{run.name}.json"
        command = [sys.executable, __file__, "--worker", "decode", json.dumps(spec), str(out)]
        result.command = command
        execute(command, self.work / f"{run.name}.log", timeout, self.env)
        result.metrics.update(json.loads(out.read_text()))


def batch_shape(run_dir: Path, s: Setting) -> dict[str, Any] | None:
    """Rows, micro-batch rows, tokens and mean prompt length of the last kept batch of an RL run."""
    from safetensors import safe_open

    files = sorted((run_dir / "batches").glob("step-*.safetensors"))
    if not files:
        return None
    with safe_open(str(files[-1]), "pt") as handle:
        header = json.loads(handle.metadata()["tandem"])
        rows = [handle.get_slice(k).get_shape()[0] for k in handle.keys() if k.endswith(".input_ids")]  # noqa: SIM118
    step = header["step"]
    completion = next(
        (r["completion_tokens"] for r in records(run_dir / "orchestrator_metrics.jsonl") if r.get("step") == step),
        header["num_samples"] * s.gen_len,
    )
    return {
        "rows": sum(rows),
        "micro_rows": max(rows),
        "micro_batches": len(rows),
        "tokens": header["num_tokens"],
        "completion_tokens": completion,
        "prompt_len": (header["num_tokens"] - completion) / header["num_samples"],
    }


def trainer_metrics(run_dir: Path, s: Setting, without_publish: bool = False) -> dict[str, Any]:
    """Trainer-side numbers of the measured steps of any trainer's metrics.jsonl; `without_publish`: step times
    less the policy hand-off (the replay's file export, which no RL run on a GPU pays)."""
    rows = measured(records(run_dir / "metrics.jsonl"), s)
    if without_publish:
        rows = [{**r, "step_time_s": r["step_time_s"] - (r.get("publish_s") or 0.0)} for r in rows]
    seconds = sum(r["step_time_s"] for r in rows)
    return {
        "train_s": median([r["step_time_s"] for r in rows]),
        "step_times_s": [round(r["step_time_s"], 4) for r in rows],
        "tokens_per_step": median([r["tokens"] for r in rows]),
        "tokens_per_s": sum(r["tokens"] for r in rows) / seconds,
        "mfu": median([r.get("mfu") for r in rows]),
        "publish_s": median([r.get("publish_s") for r in rows]),
        "trainer_peak_gib": max((r.get("peak_reserved_gib") or 0.0 for r in rows), default=0.0) or None,
    }


def _intervals(rows: list[dict[str, Any]], s: Setting) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(previous, current) record pairs of the measured steps."""
    by_step = {r["step"]: r for r in rows}
    return [(by_step[n - 1], r) for n, r in sorted(by_step.items()) if s.in_window(n) and n - 1 in by_step]


def _matching(rows: list[dict[str, Any]], pattern: str) -> list[float]:
    key = re.compile(pattern)
    return [v for r in rows for k, v in r.items() if key.search(k) and isinstance(v, int | float) and v]


def rl_metrics(run_dir: Path, s: Setting) -> dict[str, Any]:
    trainer = records(run_dir / "metrics.jsonl")
    metrics = trainer_metrics(run_dir, s)
    pairs = _intervals(trainer, s)
    walls = [now["time"] - before["time"] for before, now in pairs]
    metrics["step_s"] = median(walls)
    metrics["step_walls_s"] = [round(w, 4) for w in walls]
    metrics["trainer_idle"] = sum(now.get("idle_s") or 0 for _, now in pairs) / sum(walls) if walls else None
    batches = [r for r in records(run_dir / "orchestrator_metrics.jsonl") if r.get("kind") != "eval"]
    kept = measured(batches, s)
    metrics["rollout_tokens_per_s"] = median([r.get("rollout_tokens_per_s") for r in kept])
    metrics["completion_tokens"] = median([r.get("completion_tokens") for r in kept])
    metrics["fixed_length"] = all(r.get("completion_tokens") == s.prompts * s.group * s.gen_len for r in kept)
    spans = [(now["time"] - before["time"], now["inference_idle_s"] - before["inference_idle_s"], now)
             for before, now in _intervals(batches, s)]  # fmt: skip
    if spans:
        wall, idle = sum(w for w, _, _ in spans), sum(i for _, i, _ in spans)
        metrics["inference_idle"] = idle / wall if wall > 0 else None
        busy = wall - idle
        metrics["busy_tokens_per_s"] = sum(r["completion_tokens"] for _, _, r in spans) / busy if busy > 0 else None
    served = records(run_dir / "inference_metrics.jsonl")
    metrics["reload_s"] = median(_matching(served, r"swap.*_s$"))
    metrics["inference_peak_gib"] = max(_matching(served, r"peak.*gib"), default=None)
    return metrics


# --- the table -------------------------------------------------------------------------------------------------


def _cell(value: Any, kind: str) -> str:
    if value is None or value == "":
        return "-"
    if kind == "pct":
        return f"{100 * value:.0f}%"
    if kind == "int":
        return f"{value:,.0f}"
    if kind == "x":
        return f"{value:.2f}x"
    return f"{value:.3g}" if value < 10 else f"{value:.1f}"


def _grid(header: list[str], lines: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in [header, *lines]) for i in range(len(header))]
    return [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
        for row in [header, *lines]
    ]


def baselines(results: list[Result], model: str) -> tuple[float | None, float | None]:
    """(train s, decode s) of the RL step's work done alone: its tokens at the SFT rate, and the engine's batch."""
    done = {r.run.kind: r for r in results if r.run.model == model and not r.error and r.run.kind in ("sft", "decode")}
    rl = next((r for r in results if r.run.model == model and r.run.kind == "rl" and not r.error), None)
    train = None
    if "sft" in done and rl is not None:
        train = rl.metrics["tokens_per_step"] / done["sft"].metrics["tokens_per_s"]
    decode = done["decode"].metrics["decode_s"] if "decode" in done else None
    return train, decode


def annotate(results: list[Result]) -> None:
    """vs sync, vs ideal and the inference share on each RL run, from its model's baselines."""
    for r in results:
        if r.run.kind != "rl" or r.error:
            continue
        train, decode = baselines(results, r.run.model)
        step = r.metrics.get("step_s")
        r.metrics["train_alone_s"], r.metrics["decode_alone_s"] = train, decode
        if step and train and decode:
            r.metrics["vs_sync"] = (train + decode) / step
            r.metrics["vs_ideal"] = step / max(train, decode)
        alone = next(
            (x for x in results if x.run.kind == "decode" and x.run.model == r.run.model and not x.error), None
        )
        busy = r.metrics.get("busy_tokens_per_s")
        if alone and busy:
            r.metrics["inference_share"] = busy / alone.metrics["tokens_per_s"]


def targets(results: list[Result]) -> list[str]:
    """The targets, pass or fail, for the runs they apply to."""
    lines = []

    def verdict(ok: bool) -> str:
        return "pass" if ok else "FAIL"

    for r in results:
        if r.run.kind != "rl" or r.error:
            continue
        m = r.metrics
        if r.run.model == "qwen3-0.6b" and r.run.async_level == 1:
            lines.append(f"{r.run.name}: steady step {_cell(m['step_s'], 's')} s <= {TARGETS['step_s']} s: "
                         f"{verdict(m['step_s'] <= TARGETS['step_s'])}")  # fmt: skip
            if m.get("vs_ideal"):
                lines.append(f"{r.run.name}: step / max(train, decode) {m['vs_ideal']:.2f} <= {TARGETS['vs_ideal']}: "
                             f"{verdict(m['vs_ideal'] <= TARGETS['vs_ideal'])}")  # fmt: skip
        if r.run.model == "qwen3-1.7b" and m.get("mfu") is not None:
            lines.append(f"{r.run.name}: trainer MFU {100 * m['mfu']:.1f}% >= {100 * TARGETS['mfu']:.0f}%: "
                         f"{verdict(m['mfu'] >= TARGETS['mfu'])}")  # fmt: skip
        if m.get("inference_share"):
            lines.append(f"{r.run.name}: inference {100 * m['inference_share']:.0f}% of alone >= "
                         f"{100 * TARGETS['inference_share']:.0f}%: {verdict(m['inference_share'] >= TARGETS['inference_share'])}")  # fmt: skip
    return lines


RL_COLUMNS = [
    ("step s", "step_s", "s"), ("train s", "train_s", "s"), ("tok/s", "tokens_per_s", "int"), ("MFU", "mfu", "pct"),
    ("rollout tok/s", "rollout_tokens_per_s", "int"), ("busy tok/s", "busy_tokens_per_s", "int"),
    ("trn idle", "trainer_idle", "pct"), ("inf idle", "inference_idle", "pct"), ("hand-off s", "publish_s", "s"),
    ("reload s", "reload_s", "s"), ("trn GiB", "trainer_peak_gib", "s"), ("inf GiB", "inference_peak_gib", "s"),
    ("vs sync", "vs_sync", "x"), ("vs ideal", "vs_ideal", "x"),
]  # fmt: skip
ALONE_COLUMNS = [("step s", "train_s", "s"), ("decode s", "decode_s", "s"), ("tok/s", "tokens_per_s", "int"),
                 ("MFU", "mfu", "pct"), ("GiB", "peak_gib", "s")]  # fmt: skip


def table(results: list[Result]) -> str:
    annotate(results)
    rl_rows, alone_rows, failed = [], [], []
    for r in results:
        if r.error:
            failed.append(f"{r.run.name}: failed: {r.error.strip().splitlines()[0][:160]}")
            continue
        notes = list(r.notes)
        if r.run.kind == "rl":
            if not r.metrics.get("fixed_length"):
                notes.append(f"not fixed-length ({r.metrics.get('completion_tokens')} completion tokens)")
            cells = [_cell(r.metrics.get(key), kind) for _, key, kind in RL_COLUMNS]
            rl_rows.append([r.run.name, *cells, "; ".join(notes)])
        else:
            metrics = {**r.metrics, "peak_gib": r.metrics.get("trainer_peak_gib") or r.metrics.get("peak_gib")}
            cells = [_cell(metrics.get(key), kind) for _, key, kind in ALONE_COLUMNS]
            alone_rows.append([r.run.name, *cells, "; ".join(notes)])
    lines = []
    if rl_rows:
        lines += _grid(["run", *(c for c, _, _ in RL_COLUMNS), "notes"], rl_rows)
    if alone_rows:
        lines += ["", *_grid(["alone", *(c for c, _, _ in ALONE_COLUMNS), "notes"], alone_rows)]
    goals = targets(results)
    if goals:
        lines += ["", "targets:", *(f"  {g}" for g in goals)]
    return "\n".join(line.rstrip() for line in [*lines, *failed])


# --- the plan --------------------------------------------------------------------------------------------------


def plan(models: list[str], recipes: list[str]) -> list[Run]:
    """Per model: the async RL runs first (the baselines need their batch), then the baselines, then async 0."""
    runs = []
    for model in models:
        runs += [Run(f"rl-{model}-async1-{recipe}", "rl", model, 1, recipe) for recipe in recipes]
        runs += [Run(f"sft-{model}", "sft", model), Run(f"decode-{model}", "decode", model)]
        runs += [Run(f"rl-{model}-async0-{recipe}", "rl", model, 0, recipe) for recipe in recipes]
        runs += [Run(f"replay-{model}-{recipe}", "replay", model, 1, recipe) for recipe in recipes]
    return runs


# --- workers (separate processes: each holds the GPU alone, and dies with its memory) --------------------------


def write_model(model: str, path: str, tokenizer_dir: str) -> None:
    """Random bf16 weights of the model's shape, written by tandem's own build_model / save_model on the GPU."""
    import torch

    from inference import MODELS as SHAPES
    from tandem.models import build_model, save_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    weights = build_model(SHAPES[model].hf_config(), dtype=torch.bfloat16, device=device, seed=0)
    save_model(weights, path, dtype=torch.bfloat16, tokenizer_dir=tokenizer_dir)


def decode_alone(spec: dict[str, Any], out: str) -> None:
    """The engine alone on the RL batch: `prompts` random prompts of `prompt_len` ids, n samples each."""
    import threading

    import torch

    from tandem.config import load_config
    from tandem.config.inference import InferenceConfig
    from tandem.inference.engine import Engine
    from tandem.models import load_model
    from tandem.wire.protocol import SamplingParams

    if spec["inference_toml"]:
        config = load_config(InferenceConfig, ["@", spec["inference_toml"]])[0]
    else:
        share = spec["gpu_memory_utilization"]
        on_gpu = {"gpu_memory_utilization": share} if share is not None and torch.cuda.is_available() else {}
        config = InferenceConfig(seq_len=spec["seq_len"], model={"dtype": spec["dtype"]}, **on_gpu)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = load_model(spec["model_dir"], dtype=getattr(torch, config.model.dtype), device=device)
    engine = Engine(model, config).start()
    generator = torch.Generator().manual_seed(0)
    vocab = model.args.vocab_size
    prompts = torch.randint(0, vocab, (spec["prompts"], spec["prompt_len"]), generator=generator).tolist()

    def batch(max_tokens: int) -> float:
        params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
        done, lock, left, errors = threading.Event(), threading.Lock(), [len(prompts)], []

        def on_update(update: Any) -> None:
            if update.finished:
                with lock:
                    errors.extend([update.error] if update.error else [])
                    left[0] -= 1
                    if not left[0]:
                        done.set()

        started = time.perf_counter()
        for prompt in prompts:
            engine.submit(prompt, params, on_update, n=spec["n"])
        if not done.wait(600):
            raise TimeoutError("the engine did not finish the batch within 600 s")
        if errors:
            raise RuntimeError(f"the engine failed requests: {errors[0]}")
        return time.perf_counter() - started

    try:
        batch(min(8, spec["gen_len"]))  # warm-up: CUDA graphs captured, kernels compiled
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times = [batch(spec["gen_len"]) for _ in range(spec["repeats"])]
    finally:
        engine.stop()
    seconds = statistics.median(times)
    result = {
        "decode_s": seconds,
        "decode_times_s": [round(t, 4) for t in times],
        "tokens_per_s": spec["prompts"] * spec["n"] * spec["gen_len"] / seconds,
        "prompt_len": spec["prompt_len"],
        "peak_gib": torch.cuda.max_memory_reserved(device) / 2**30 if device.type == "cuda" else None,
    }
    Path(out).write_text(json.dumps(result))


def worker(argv: list[str]) -> None:
    kind, *rest = argv
    if kind == "model":
        write_model(*rest)
    elif kind == "decode":
        decode_alone(json.loads(rest[0]), rest[1])
    else:
        raise SystemExit(f"unknown worker {kind}")


# --- main ------------------------------------------------------------------------------------------------------


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        worker(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, a tiny model, 2 steps, a tiny batch: every run")
    parser.add_argument("--tokenizer-dir", type=Path, help="Qwen3's tokenizer files (benchmarks/qwen3_tokenizer.py)")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--recipe", nargs="+", choices=sorted(RECIPES), default=["default", "max-perf"])
    parser.add_argument("--transport", default="auto", help="trainer.weights.transport (auto: tandem's default)")
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the measurement")
    parser.add_argument("--steps", type=int, default=5, help="measured steps")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=16, help="rollouts per prompt (GRPO group, n)")
    parser.add_argument("--gen-len", type=int, default=256, help="new tokens per rollout (ignore_eos)")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument(
        "--gpu-memory-utilization", type=float, default=None,
        help="inference's share of the GPU (default: tandem rl splits the GPU itself, deploy.trainer_memory_gib)",
    )  # fmt: skip
    parser.add_argument("--decode-repeats", type=int, default=3, help="batches timed in the engine-alone baseline")
    parser.add_argument("--prompt-len", type=int, default=40, help="decode prompt length when no RL run gives one")
    parser.add_argument("--budget-s", type=float, default=540, help="start no run after this many seconds")
    parser.add_argument("--run-timeout-s", type=float, default=300, help="stop a run that takes longer")
    parser.add_argument("--work-dir", type=Path, help="keep every run's directory here (default: a temporary one)")
    parser.add_argument("--out", type=Path, help="write every result here as JSON")
    parser.add_argument("--runs", nargs="+", help="only the runs whose names match one of these shell patterns")
    args = parser.parse_args()
    if args.smoke:
        setting = Setting(4, 2, 8, 256, 1, 1, "float32", None, args.transport, 1, 16, True)
        models, recipes = ["tiny"], ["default", "lora"]
    else:
        import torch

        if not torch.cuda.is_available():
            parser.error("no CUDA device: run on a GPU, or pass --smoke")
        if args.tokenizer_dir is None or not (args.tokenizer_dir / "tokenizer.json").is_file():
            parser.error("--tokenizer-dir DIR with Qwen3's tokenizer.json: python benchmarks/qwen3_tokenizer.py DIR")
        setting = Setting(
            args.prompts, args.group, args.gen_len, args.seq_len, args.warmup, args.steps, "bfloat16",
            args.gpu_memory_utilization, args.transport, args.decode_repeats, args.prompt_len, False,
        )  # fmt: skip
        models, recipes = args.models, args.recipe
    runs = [r for r in plan(models, recipes) if not args.runs or any(fnmatch(r.name, p) for p in args.runs)]
    if not runs:
        parser.error(f"no run matches {args.runs}; the runs: {', '.join(r.name for r in plan(models, recipes))}")
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rl-throughput-") as tmp:
        work = args.work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        bench = Bench(setting, work.resolve(), args.tokenizer_dir.resolve() if args.tokenizer_dir else None)
        results = []
        for run in runs:
            left = args.budget_s - (time.monotonic() - start)
            if left < 30:
                print(f"skipped {run.name}: budget spent", flush=True)
                continue
            result = bench.run(run, min(left, args.run_timeout_s))
            results.append(result)
            if result.error:
                print(f"{run.name}: FAILED ({result.seconds:.0f} s)\n{result.error}", flush=True)
            else:
                shown = {k: v for k, v in result.metrics.items() if k.endswith(("_s", "times_s", "walls_s"))}
                print(f"{run.name}: {json.dumps(shown)} ({result.seconds:.0f} s)", flush=True)
    if args.out:
        annotate(results)
        args.out.write_text(json.dumps([asdict(r) for r in results], indent=1))
    print("\nsteady step = median wall time between consecutive trainer records of the measured steps")
    print(table(results))


if __name__ == "__main__":
    main()
