"""Decode steps (a new token per sequence) over fixed-capacity inputs, built entirely on the device.

`KVCache.batch` validates lengths on the host and sizes the step to its longest sequence, which suits
prefill. Decode steps instead take one int64 tensor `[N, 2 + W]` per step (token, cached length, then W
block-table entries, padded with the scratch block) and derive every `CacheBatch` index from it with tensor
ops, over a key capacity of `W * block_size` positions. Shapes depend only on (N, W), so the very same
function runs eagerly or is captured once per (N, W) bucket as a CUDA graph (`cuda_graphs.py`).

`decode_many` runs K such steps back to back with the sampler on the device, each step's tokens feeding the
next, so the host schedules, copies and synchronises once per K tokens instead of once per token: a decode
step of a small model at small batch takes less GPU time than the host needs to prepare it. It serves the
rows the sampler draws from the whole vocabulary (greedy or temperature only, no top logprobs); the engine
falls back to single steps for the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tandem.inference.sampling import draw_whole_vocab, signed64, temper
from tandem.inference.scheduler import SCRATCH_BLOCK
from tandem.models import CacheBatch, CausalLM, KVCache


def decode_batch(lengths: torch.Tensor, tables: torch.Tensor, block_size: int) -> CacheBatch:
    """The `CacheBatch` of one new token per row at position `lengths[i]`, keys over `tables` `[N, W]`."""
    rows = torch.arange(tables.shape[0], device=tables.device)
    offsets = torch.arange(block_size, device=tables.device)
    read_index = (tables[:, :, None] * block_size + offsets).flatten(1)
    key_positions = torch.arange(read_index.shape[1], device=tables.device)
    block = tables.gather(1, (lengths // block_size)[:, None])[:, 0]
    return CacheBatch(
        positions=lengths,
        write_index=block * block_size + lengths % block_size,
        unpack_index=rows[:, None],
        pack_index=rows,
        read_index=read_index,
        mask=(key_positions[None, :] <= lengths[:, None])[:, None, None, :],
        last_index=rows,
    )


def decode_step(model: CausalLM, cache: KVCache, inputs: torch.Tensor) -> torch.Tensor:
    """Logits `[N, V]` for `inputs` `[N, 2 + W]` = (token, cached length, block table...) per row."""
    return model.decode(inputs[:, 0], cache, decode_batch(inputs[:, 1], inputs[:, 2:], cache.block_size))


StepFunction = Callable[[CausalLM, KVCache, torch.Tensor], torch.Tensor]
"""`decode_step`, or a compiled version of it."""


def decode_many(
    step_fn: StepFunction,
    model: CausalLM,
    cache: KVCache,
    inputs: torch.Tensor,
    keys: torch.Tensor,
    temperature: torch.Tensor,
    num_steps: int,
    sampled: bool,
) -> torch.Tensor:
    """Run `num_steps` steps of `step_fn` (`decode_step`, maybe compiled) from `inputs`, sampling on the device.

    `keys` `[N, 3]` int64 holds each row's sampling key (seed, sample index, tokens generated so far) and
    `temperature` `[N]` fp32 its temperature. Returns `[2, num_steps, N]` fp64: the sampled tokens, then
    their logprobs (token ids are exact in fp64, so one copy brings both to the host). Every row's block
    table must have room for `num_steps` more tokens.
    """
    seeds, samples, steps = keys.unbind(1)
    drawn, logprobs = [], []
    for step in range(num_steps):
        logits = step_fn(model, cache, inputs)
        tokens, logprob, _ = draw_whole_vocab(
            temper(logits, temperature), temperature, seeds, samples, steps + step, sampled=sampled
        )
        drawn.append(tokens)
        logprobs.append(logprob)
        inputs = torch.cat([tokens[:, None], inputs[:, 1:2] + 1, inputs[:, 2:]], dim=1)
    return torch.stack([torch.stack(drawn).double(), torch.stack(logprobs).double()])


@dataclass(frozen=True)
class SamplingKeys:
    """Per-row sampler inputs of a multi-step decode (see `sampling.py`): temperature and the noise key."""

    temperatures: Sequence[float]
    seeds: Sequence[int]
    samples: Sequence[int]
    steps: Sequence[int]

    def tensors(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Host tensors `keys` `[rows, 3]` int64 and `temperature` `[rows]` fp32; padding rows are greedy."""
        keys = [[signed64(a), b, c] for a, b, c in zip(self.seeds, self.samples, self.steps, strict=True)]
        pad = rows - len(keys)
        return (
            torch.tensor(keys + [[0, 0, 0]] * pad, dtype=torch.int64),
            torch.tensor([*self.temperatures, *[0.0] * pad], dtype=torch.float32),
        )


def decode_inputs(
    tokens: Sequence[int], lengths: Sequence[int], tables: Sequence[Sequence[int]], rows: int, width: int
) -> torch.Tensor:
    """The host tensor `[rows, 2 + width]` for `decode_step`; rows past the real ones are padding (scratch)."""
    data = [
        [token, length, *table, *[SCRATCH_BLOCK] * (width - len(table))]
        for token, length, table in zip(tokens, lengths, tables, strict=True)
    ]
    data += [[0, 0, *[SCRATCH_BLOCK] * width]] * (rows - len(data))
    return torch.tensor(data, dtype=torch.int64)


class EagerDecoder:
    """Decode steps run op by op, sized to the step (any device)."""

    def __init__(self, model: CausalLM, cache: KVCache, step: StepFunction = decode_step) -> None:
        self.model, self.cache, self.step = model, cache, step

    def __call__(self, tokens: Sequence[int], lengths: Sequence[int], tables: Sequence[Sequence[int]]) -> torch.Tensor:
        width = max(len(table) for table in tables)
        inputs = decode_inputs(tokens, lengths, tables, len(tokens), width).to(self.cache.device)
        return self.step(self.model, self.cache, inputs)

    def many(
        self,
        tokens: Sequence[int],
        lengths: Sequence[int],
        tables: Sequence[Sequence[int]],
        keys: SamplingKeys,
        num_steps: int,
        sampled: bool,
    ) -> torch.Tensor:
        """`decode_many` from these rows: `[2, num_steps, N]` (tokens, logprobs) on the cache's device."""
        width = max(len(table) for table in tables)
        device = self.cache.device
        inputs = decode_inputs(tokens, lengths, tables, len(tokens), width).to(device)
        key_tensor, temperature = (t.to(device) for t in keys.tensors(len(tokens)))
        return decode_many(self.step, self.model, self.cache, inputs, key_tensor, temperature, num_steps, sampled)
