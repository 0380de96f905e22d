"""Eval wall time under the adaptive concurrency controller against fixed concurrencies (baseline: fixed 32).

    python benchmarks/eval_concurrency.py [--rollouts 200] [--max-tokens 32] [--smoke]

One built-in server (`tandem inference`, a tiny random model on CPU) serves every run; each run is the same
seeded `tandem eval` of the built-in `arithmetic` env through the real CLI, so the rewards must be identical
and only the wall time may differ. A controller that backs off on a small server queue sits near concurrency
1-4 and takes several times the fixed-32 run's time; one that backs off only on errors, timeouts and latency
growth should be close to it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tandem.jsonl import read_records
from tandem.testing import write_tiny_model
from tandem.testing.progress import tree_state, wait_for

RUNS = {
    "adaptive (default)": [],
    "fixed 32": ["--concurrency.initial", "32", "--concurrency.min", "32", "--concurrency.max", "32"],
    "fixed 4": ["--concurrency.initial", "4", "--concurrency.min", "4", "--concurrency.max", "4"],
}


def start_server(out: Path) -> tuple[subprocess.Popen, str]:
    model = out / "model"
    write_tiny_model(model, "qwen3")
    command = [
        sys.executable, "-m", "tandem", "inference", "--model", str(model), "--model.dtype", "float32",
        "--device", "cpu", "--port", "0", "--seq-len", "512", "--output-dir", str(out), "--run-name", "server",
    ]  # fmt: skip
    process = subprocess.Popen(command, stderr=subprocess.DEVNULL)
    server_json = out / "server" / "server.json"
    wait_for(lambda: server_json.is_file() or process.poll() is not None, lambda: tree_state([out / "server"]))
    if not server_json.is_file():
        raise SystemExit(f"the server exited with {process.returncode}; see {out / 'server' / 'logs'}")
    return process, json.loads(server_json.read_text())["url"] + "/v1"


def run_eval(out: Path, url: str, name: str, flags: list[str], rollouts: int, max_tokens: int) -> dict:
    run_name = name.split()[0] + "-" + name.split()[1].strip("()")
    command = [
        sys.executable, "-m", "tandem", "eval", "arithmetic", "--base-url", url,
        "--env.args", f"{{num_tasks = {rollouts}}}", "--env.sampling.max-tokens", str(max_tokens),
        "--env.sampling.temperature", "1.0", "--env.sampling.seed", "0",
        "--output-dir", str(out), "--run-name", run_name, "--log.level", "warning", *flags,
    ]  # fmt: skip
    started = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall_s = time.perf_counter() - started
    traces = read_records(out / run_name / "traces.jsonl")
    return {
        "name": name,
        "wall_s": wall_s,
        "rollouts": len(traces),
        "rewards": {t["key"]: t["reward"] for t in traces},
        "tokens": sum(t["tokens"]["completion"] for t in traces),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rollouts", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--smoke", action="store_true", help="20 rollouts of 8 tokens: does every run start?")
    args = parser.parse_args()
    rollouts, max_tokens = (20, 8) if args.smoke else (args.rollouts, args.max_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        server, url = start_server(out)
        try:
            results = [run_eval(out, url, name, flags, rollouts, max_tokens) for name, flags in RUNS.items()]
        finally:
            server.terminate()
            server.wait()
    baseline = next(r for r in results if r["name"] == "fixed 32")
    print(f"\n{rollouts} rollouts of arithmetic, up to {max_tokens} tokens each, one tiny-model CPU server\n")
    print(f"{'run':20} {'wall s':>8} {'tokens':>8} {'same rewards':>13} {'vs fixed 32':>12}")
    for result in results:
        same = result["rewards"] == baseline["rewards"]
        ratio = result["wall_s"] / baseline["wall_s"]
        print(f"{result['name']:20} {result['wall_s']:8.1f} {result['tokens']:8,} {same!s:>13} {ratio:11.2f}x")


if __name__ == "__main__":
    main()
