"""Which rows each rank trains at a step: a deterministic global order, balanced by tokens across ranks."""

from __future__ import annotations

import torch

from tandem.packing import balance
from tandem.trainer.data import PackedRow


def step_indices(step: int, batch_size: int, num_rows: int, seed: int) -> list[int]:
    """Dataset rows of optimizer step `step`: consecutive slices of one shuffled order per epoch.

    The rows of a step depend only on (seed, step), which is what makes resuming exact: the
    data position is the step number.
    """
    indices = []
    for position in range(step * batch_size, (step + 1) * batch_size):
        epoch, offset = divmod(position, num_rows)
        indices.append(int(_epoch_order(seed, epoch, num_rows)[offset]))
    return indices


_ORDER_CACHE: dict[tuple[int, int, int], torch.Tensor] = {}


def _epoch_order(seed: int, epoch: int, num_rows: int) -> torch.Tensor:
    key = (seed, epoch, num_rows)
    if key not in _ORDER_CACHE:
        _ORDER_CACHE.clear()  # one epoch at a time is all a run needs
        generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        _ORDER_CACHE[key] = torch.randperm(num_rows, generator=generator)
    return _ORDER_CACHE[key]


class DatasetSteps:
    """The rows of each step from a packed dataset."""

    def __init__(self, rows: list[PackedRow], batch_size: int, seed: int):
        self.rows, self.batch_size, self.seed = rows, batch_size, seed

    def __call__(self, step: int) -> list[PackedRow]:
        return [self.rows[i] for i in step_indices(step, self.batch_size, len(self.rows), self.seed)]


class FakeSteps:
    """Random full rows of seq_len tokens (one document each), a function of (seed, step): for benchmarks."""

    def __init__(self, vocab_size: int, seq_len: int, batch_size: int, seed: int):
        self.vocab_size, self.seq_len, self.batch_size, self.seed = vocab_size, seq_len, batch_size, seed

    def __call__(self, step: int) -> list[PackedRow]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        tokens = torch.randint(0, self.vocab_size, (self.batch_size, self.seq_len + 1), generator=generator)
        positions = torch.arange(self.seq_len)
        loss_mask = torch.ones(self.seq_len, dtype=torch.bool)
        return [PackedRow(row[:-1], positions, row[1:], loss_mask, self.seq_len) for row in tokens]


def balance_rows(rows: list[PackedRow], world_size: int) -> list[list[PackedRow]]:
    """Rows split over ranks: equal counts, token totals as even as greedy allows."""
    groups = balance([row.num_real for row in rows], world_size)
    return [[rows[i] for i in group] for group in groups]


def stack(rows: list[PackedRow], device: torch.device) -> dict[str, torch.Tensor]:
    """A micro-batch `[B, seq_len]` of the rows' tensors, on `device`.

    On a GPU the rows go through pinned memory: a copy from pageable memory waits for the GPU to drain
    its queue first (a host-device sync), one from pinned memory is queued behind the work already there.
    """
    pin = device.type == "cuda"
    return {
        name: _pinned(torch.stack([getattr(row, name) for row in rows]), pin).to(device, non_blocking=True)
        for name in ("input_ids", "position_ids", "target_ids", "loss_mask")
    }


def _pinned(tensor: torch.Tensor, pin: bool) -> torch.Tensor:
    return tensor.pin_memory() if pin else tensor


def single_documents(rows: list[PackedRow]) -> bool:
    """True when every row is one document from position 0 to the end (fake data, full unpacked rows).

    The model then needs no position ids: it takes plain causal attention (the fused SDPA kernels) instead
    of a per-document mask or flex block mask, and computes the same function.
    """
    return all(int(row.position_ids[-1]) == len(row.position_ids) - 1 for row in rows)
