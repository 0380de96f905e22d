"""Run a function on N gloo processes, failing the test if any rank fails.

The processes fork from a forkserver that has imported torch and the trainer once, so a group starts in a
fraction of a second instead of paying ~4 s of imports per process (the test process itself is never forked:
its OpenMP threads would not survive it).
"""

from __future__ import annotations

import multiprocessing.forkserver
import os
import socket

import torch.multiprocessing as mp

multiprocessing.forkserver.set_forkserver_preload(["torch", "tandem.trainer.sft", "tandem.trainer.rl"])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, args) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        if dist.is_initialized():  # the trainers end their group themselves
            dist.destroy_process_group()


def run_ranks(world: int, fn, *args) -> None:
    """`fn(rank, world, *args)` on `world` processes in one gloo group; a rank's exception fails the caller."""
    mp.start_processes(_entry, args=(world, free_port(), fn, args), nprocs=world, start_method="forkserver")
