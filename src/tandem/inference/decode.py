"""One decode step (a new token per sequence) over fixed-capacity inputs, built entirely on the device.

`KVCache.batch` validates lengths on the host and sizes the step to its longest sequence, which suits
prefill. Decode steps instead take one int64 tensor `[N, 2 + W]` per step (token, cached length, then W
block-table entries, padded with the scratch block) and derive every `CacheBatch` index from it with tensor
ops, over a key capacity of `W * block_size` positions. Shapes depend only on (N, W), so the very same
function runs eagerly or is captured once per (N, W) bucket as a CUDA graph (`cuda_graphs.py`).

Hybrid models (linear-attention layers) add one column after the cached length, the sequence's recurrent-state
slot (`[N, 3 + W]`; padded rows use the scratch slot), and the step takes the `StateCache` too. Vision-language
models add one there instead, the sequence's RoPE offset: after an image, M-RoPE positions run ahead of (or behind)
the token index by a fixed amount per sequence, and only the rotation uses it (the cache rows and the mask follow
the index).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from tandem.inference.scheduler import SCRATCH_BLOCK, SCRATCH_SLOT
from tandem.models import CacheBatch, CausalLM, KVCache, StateBatch, StateCache


def decode_batch(
    lengths: torch.Tensor, tables: torch.Tensor, block_size: int, rope_offsets: torch.Tensor | None = None
) -> CacheBatch:
    """The `CacheBatch` of one new token per row at position `lengths[i]`, keys over `tables` `[N, W]`; rotated at
    `lengths + rope_offsets` when given."""
    rows = torch.arange(tables.shape[0], device=tables.device)
    offsets = torch.arange(block_size, device=tables.device)
    read_index = (tables[:, :, None] * block_size + offsets).flatten(1)
    key_positions = torch.arange(read_index.shape[1], device=tables.device)
    block = tables.gather(1, (lengths // block_size)[:, None])[:, 0]
    return CacheBatch(
        positions=lengths if rope_offsets is None else lengths + rope_offsets,
        write_index=block * block_size + lengths % block_size,
        unpack_index=rows[:, None],
        pack_index=rows,
        read_index=read_index,
        mask=(key_positions[None, :] <= lengths[:, None])[:, None, None, :],
        last_index=rows,
    )


def decode_step(model: CausalLM, cache: KVCache, inputs: torch.Tensor, state: StateCache | None = None) -> torch.Tensor:
    """Logits `[N, V]` for `inputs` `[N, 2 + W]` = (token, cached length, block table...) per row; with a hybrid
    model's `state`, `[N, 3 + W]` = (token, cached length, state slot, block table...); for a vision-language
    model, `[N, 3 + W]` = (token, cached length, RoPE offset, block table...)."""
    lengths = inputs[:, 1]
    if model.visual is not None:
        batch = decode_batch(lengths, inputs[:, 3:], cache.block_size, rope_offsets=inputs[:, 2])
        return model.decode(inputs[:, 0], cache, batch)
    if state is None:
        return model.decode(inputs[:, 0], cache, decode_batch(lengths, inputs[:, 2:], cache.block_size))
    batch = decode_batch(lengths, inputs[:, 3:], cache.block_size)
    return model.decode(inputs[:, 0], cache, batch, state, StateBatch(slots=inputs[:, 2], fresh=lengths == 0))


def decode_inputs(
    tokens: Sequence[int],
    lengths: Sequence[int],
    tables: Sequence[Sequence[int]],
    rows: int,
    width: int,
    slots: Sequence[int] | None = None,
    rope_offsets: Sequence[int] | None = None,
) -> torch.Tensor:
    """The host tensor `[rows, 2 + width]` for `decode_step`, with a column more for state `slots` (hybrids) or
    `rope_offsets` (vision-language models); rows past the real ones are padding (scratch block, scratch slot,
    offset 0)."""
    column = slots if slots is not None else rope_offsets
    pad_column = [] if column is None else [SCRATCH_SLOT if slots is not None else 0]
    data = [
        [token, length, *([] if column is None else [column[row]]), *table, *[SCRATCH_BLOCK] * (width - len(table))]
        for row, (token, length, table) in enumerate(zip(tokens, lengths, tables, strict=True))
    ]
    data += [[0, 0, *pad_column, *[SCRATCH_BLOCK] * width]] * (rows - len(data))
    return torch.tensor(data, dtype=torch.int64)


def header_width(model: CausalLM, state: StateCache | None) -> int:
    """Columns of `decode_step`'s inputs before the block table: token, cached length, and a hybrid's state slot
    or a vision-language model's RoPE offset."""
    return 3 if state is not None or model.visual is not None else 2


def copy_to_device(host: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`out.copy_(host)` without waiting for the GPU: a copy from pageable memory makes the host wait until
    every queued kernel has run, which would undo overlapped steps; from pinned memory it does not."""
    if out.is_cuda:
        return out.copy_(host.pin_memory(), non_blocking=True)
    return out.copy_(host)


def write_inputs(
    out: torch.Tensor,
    tokens: Sequence[int],
    lengths: Sequence[int],
    tables: Sequence[Sequence[int]],
    device_tokens: torch.Tensor | None,
    slots: Sequence[int] | None = None,
    rope_offsets: Sequence[int] | None = None,
) -> torch.Tensor:
    """Fill the device tensor `out` `[rows, 2 + W]` (`[rows, 3 + W]` with `slots` or `rope_offsets`) with
    `decode_inputs`; `device_tokens` (`[N]` on the device), when given, replace `tokens`: the ids the previous step
    sampled that the host has not read yet."""
    width = out.shape[1] - (2 if slots is None and rope_offsets is None else 3)
    copy_to_device(decode_inputs(tokens, lengths, tables, out.shape[0], width, slots, rope_offsets), out)
    if device_tokens is not None:
        out[: len(tokens), 0].copy_(device_tokens)
    return out


StepFunction = Callable[..., torch.Tensor]
"""`decode_step`, or a compiled version of it: `(model, cache, inputs)`, plus the `StateCache` for hybrids."""


class EagerDecoder:
    """Decode steps run op by op, sized to the step (any device); `device_tokens` as in `write_inputs`. With a
    hybrid model's `state`, every call passes the sequences' state `slots`. A compiled `step` takes `min_rows=2`:
    a batch of one is padded with a scratch row, since size 1 is always specialised, and that second compilation
    writes the KV cache wrong on torch 2.11's CPU inductor (logits 0.3 off; right on 2.13)."""

    def __init__(
        self,
        model: CausalLM,
        cache: KVCache,
        step: StepFunction = decode_step,
        state: StateCache | None = None,
        min_rows: int = 1,
    ) -> None:
        self.model, self.cache, self.step, self.state, self.min_rows = model, cache, step, state, min_rows

    def __call__(
        self,
        tokens: Sequence[int],
        lengths: Sequence[int],
        tables: Sequence[Sequence[int]],
        device_tokens: torch.Tensor | None = None,
        slots: Sequence[int] | None = None,
        rope_offsets: Sequence[int] | None = None,
    ) -> torch.Tensor:
        check_slots(self.state, slots)
        check_rope_offsets(self.model, rope_offsets)
        width = max(len(table) for table in tables)
        header = header_width(self.model, self.state)
        rows = max(len(tokens), self.min_rows)
        inputs = torch.empty(rows, header + width, dtype=torch.int64, device=self.cache.device)
        write_inputs(inputs, tokens, lengths, tables, device_tokens, slots, rope_offsets)
        return self.step(self.model, self.cache, inputs, *state_arg(self.state))[: len(tokens)]


def check_slots(state: StateCache | None, slots: Sequence[int] | None) -> None:
    if (state is None) != (slots is None):
        raise ValueError("state slots go with a hybrid model's state cache, and only with it")


def check_rope_offsets(model: CausalLM, rope_offsets: Sequence[int] | None) -> None:
    if (model.visual is None) != (rope_offsets is None):
        raise ValueError("RoPE offsets go with a vision-language model, and only with it")


def state_arg(state: StateCache | None) -> tuple[StateCache, ...]:
    """The step function's extra argument: the state cache of a hybrid model, none otherwise."""
    return () if state is None else (state,)
