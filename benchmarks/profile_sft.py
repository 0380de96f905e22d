"""Run `tandem sft` under torch.profiler; print its top GPU kernels as JSON, the last line of stdout.

    python benchmarks/profile_sft.py WARMUP <arguments of tandem sft>

The profiler starts when step WARMUP ends, so compilation and autotuning stay out of the shares. Used by
sft_throughput.py for its profile rows. Without a GPU it reports CPU operators instead (to test it).
"""

from __future__ import annotations

import json
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from tandem.trainer import monitor, sft

TOP = 15


def main() -> None:
    warmup, argv = int(sys.argv[1]), sys.argv[2:]
    gpu = torch.cuda.is_available()
    profiler = profile(activities=[ProfilerActivity.CUDA if gpu else ProfilerActivity.CPU])
    end_step = monitor.Monitor.end_step

    def end_step_then_start(self, step: int, *args, **kwargs):
        end_step(self, step, *args, **kwargs)
        if step == warmup:
            profiler.start()

    monitor.Monitor.end_step = end_step_then_start
    sft.main(argv)
    profiler.stop()

    def own_time(event) -> float:
        return event.self_device_time_total if gpu else event.self_cpu_time_total

    events = [e for e in profiler.key_averages() if own_time(e) > 0]
    total = sum(own_time(e) for e in events) or 1.0
    top = sorted(events, key=lambda e: -own_time(e))[:TOP]
    print(json.dumps([(e.key, 100 * own_time(e) / total) for e in top]))


if __name__ == "__main__":
    main()
