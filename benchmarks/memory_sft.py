"""Where one `tandem sft` step's peak GPU memory goes: the live allocations at the peak, by the code that made them.

    python benchmarks/memory_sft.py STEP <arguments of tandem sft>

Records the CUDA allocator's history (with Python stacks) through step STEP only, finds the moment the step
held the most memory, and prints what was live then: what was allocated before the step (weights, optimizer
state) as one line, then every allocation of the step still alive, summed by where it was made (the innermost
frame in tandem's source, and the innermost frame overall, e.g. an inductor-generated kernel's caller).
Used to compare the step's peak with torchtitan's (benchmarks/sft_throughput.py reports both).
"""

from __future__ import annotations

import sys
from collections import Counter

import torch

from tandem.trainer import monitor, sft

GIB = 2**30


def _where(frames: list[dict]) -> str:
    def short(frame: dict) -> str:
        return f"{frame['filename'].rsplit('/', 2)[-1]}:{frame['line']} {frame['name']}"

    ours = next((f for f in frames if "/tandem/" in f["filename"]), None)
    inner = short(frames[0]) if frames else "?"
    return inner if ours is None or ours is frames[0] else f"{short(ours)} <- {inner}"


def peak_breakdown(trace: list[dict], before: int) -> tuple[int, Counter]:
    """(peak bytes, live bytes by where they were allocated) of a device trace that started with `before`
    bytes allocated."""
    live: dict[int, dict] = {}
    current = peak = before
    at_peak: dict[int, dict] = {}
    for event in trace:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            current += event["size"]
            if current > peak:
                peak, at_peak = current, dict(live)
        elif event["action"] == "free_completed" and event["addr"] in live:
            current -= live.pop(event["addr"])["size"]
    by_site: Counter = Counter()
    for event in at_peak.values():
        by_site[_where(event.get("frames", []))] += event["size"]
    return peak, by_site


def main() -> None:
    step, argv = int(sys.argv[1]), sys.argv[2:]
    if not torch.cuda.is_available():
        raise SystemExit("memory_sft.py needs a GPU")
    if step < 2:
        raise SystemExit("STEP must be 2 or more: recording starts when step STEP - 1 ends")
    state = {}
    end_step = monitor.Monitor.end_step

    def end_step_and_record(self, done: int, *args, **kwargs):
        end_step(self, done, *args, **kwargs)
        if done == step - 1:
            torch.cuda.synchronize()
            state["before"] = torch.cuda.memory_allocated()
            torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
        elif done == step:
            state["snapshot"] = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)

    monitor.Monitor.end_step = end_step_and_record
    sft.main(argv)
    trace = state["snapshot"]["device_traces"][torch.cuda.current_device()]
    peak, by_site = peak_breakdown(trace, state["before"])
    print(f"step {step}: peak allocated {peak / GIB:.2f} GiB; live at the peak:")
    print(f"  {state['before'] / GIB:7.2f} GiB  allocated before the step (weights, optimizer state, ...)")
    for site, size in by_site.most_common(25):
        print(f"  {size / GIB:7.2f} GiB  {site[:150]}")


if __name__ == "__main__":
    main()
