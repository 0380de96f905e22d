"""Python's garbage collector run between steps on a schedule, as torchtitan runs it.

An automatic collection of the oldest generation walks every object the process holds (compiled graphs and
their guards are many) and can land anywhere, also where the host must launch kernels to keep the GPU busy.
Training turns automatic collection off and collects the young generations every `interval` steps instead,
between steps; reference counting still frees everything not in a cycle at once.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Callable, Iterator

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def scheduled_gc(interval: int) -> Iterator[Callable[[int], None]]:
    """Inside: automatic collection off (`interval` 0: left as it is); call the yielded function with the number of
    steps done so far, once a step. Automatic collection is back on when the block ends, however it ends."""
    if not interval:
        yield lambda step: None
        return
    was_enabled = gc.isenabled()
    gc.disable()
    gc.collect(1)

    def after_step(done: int) -> None:
        if done and done % interval == 0:
            gc.collect(1)

    try:
        yield after_step
    finally:
        if was_enabled:
            gc.enable()
