"""Run a function on N gloo processes, failing the test if any rank fails.

The processes fork from a forkserver that has imported torch and the trainer once, so a group starts in a
fraction of a second instead of paying ~4 s of imports per process (the test process itself is never forked:
its OpenMP threads would not survive it).
"""

from __future__ import annotations

import multiprocessing.forkserver
import os
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from support.servers import free_port

multiprocessing.forkserver.set_forkserver_preload(["torch", "tandem.trainer.sft", "tandem.trainer.rl"])


def _entry(rank: int, world: int, port: int, fn: Callable[..., None], args: tuple) -> None:
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


def run_ranks(world: int, fn: Callable[..., None], *args: Any) -> None:
    """`fn(rank, world, *args)` on `world` processes in one gloo group; a rank's exception fails the caller.
    `fn` must be importable by name (a module-level function), since the ranks unpickle it."""
    mp.start_processes(_entry, args=(world, free_port(), fn, args), nprocs=world, start_method="forkserver")


def train_sft(rank: int, world: int, config: dict[str, Any]) -> None:
    """A rank of `tandem sft`: the SFT trainer's `train()` on `config` (an `SftConfig` as a dict), for `run_ranks`."""
    from tandem.config.sft import SftConfig
    from tandem.trainer.sft import train

    train(SftConfig.model_validate(config))
