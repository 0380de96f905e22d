"""Run `tandem sft` under torch.profiler and write a Chrome trace of the steps after the warm-up.

    python benchmarks/profile_sft.py WARMUP TRACE.json <arguments of tandem sft>

The profiler starts when step WARMUP ends, so compilation and autotuning stay out of the trace. Used by
sft_throughput.py for its profile rows (read with gpu_kernels.py, as torchtitan's traces are). Without a GPU
it records CPU operators (to test it).
"""

from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from tandem.trainer import monitor, sft


def main() -> None:
    warmup, trace, argv = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    profiler = profile(activities=[ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU])
    end_step = monitor.Monitor.end_step

    def end_step_then_start(self, step: int, *args, **kwargs):
        end_step(self, step, *args, **kwargs)
        if step == warmup:
            profiler.start()

    monitor.Monitor.end_step = end_step_then_start
    sft.main(argv)
    profiler.stop()
    profiler.export_chrome_trace(trace)


if __name__ == "__main__":
    main()
