"""Paged KV cache and the per-step batch description that prefill and decode share.

Each layer owns K and V tensors `[num_blocks, block_size, num_kv_heads, head_dim]` (V may have another head dim;
a key-only cache, `value_dim=0`, has no V: MLA caches one latent per token, see `layers.mla`). A sequence owns a row of a
block table (block ids, in order); token `p` of the sequence lives at `block_table[p // block_size]`, offset
`p % block_size`. A slot cache (one fixed region per sequence) is the special case `block_size = max_len` with
block table `[[slot]]`. The engine owns allocation; this module only reads and writes where it is told.

A step is described by `CacheBatch`: the new tokens of every sequence packed into one row (prefill: a chunk of
prompt per sequence; decode: one token per sequence), and how many tokens each sequence already has in cache.
All index tensors are built here, vectorised, once per step; attention layers only gather and scatter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..config import ModelArgs


@dataclass(frozen=True)
class CacheBatch:
    """Indices for one cached step over N sequences with T new tokens in total (see module docstring)."""

    positions: torch.Tensor  # [T] absolute position of each new token
    write_index: torch.Tensor  # [T] flat cache row (block * block_size + offset) each new token's K/V goes to
    unpack_index: torch.Tensor  # [N, max_new] packed token index per padded query slot (pads repeat a valid one)
    pack_index: torch.Tensor  # [T] position of each packed token in the flattened [N * max_new] padded layout
    read_index: torch.Tensor  # [N, max_kv] flat cache row of each sequence's key positions 0..max_kv-1
    mask: torch.Tensor  # [N, 1, max_new, max_kv] True where a query may attend a key
    last_index: torch.Tensor  # [N] packed index of each sequence's last new token (whose logits are returned)


class KVCache:
    """K/V storage for all layers. Zero-initialised so masked-out stale rows are finite (0 * NaN would be NaN).

    `value_dim` defaults to `head_dim`; 0 makes a key-only cache (`v` is empty; use `write_keys`/`read_keys`).
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        value_dim: int | None = None,
        cached_layers: Sequence[int] | None = None,
    ) -> None:
        value_dim = head_dim if value_dim is None else value_dim
        shape = (num_blocks, block_size, num_kv_heads)
        self.layers = tuple(range(num_layers) if cached_layers is None else cached_layers)
        """The layers that cache K/V; the others (a hybrid's recurrent layers) hold an empty placeholder."""

        def storage(dim: int, layer: int) -> torch.Tensor:
            if layer in self.layers:
                return torch.zeros(*shape, dim, dtype=dtype, device=device)
            return torch.empty(0, dtype=dtype, device=device)

        self.k = [storage(head_dim, i) for i in range(num_layers)]
        self.v = [storage(value_dim, i) for i in range(num_layers)] if value_dim else []
        self.num_blocks, self.block_size = num_blocks, block_size
        self._device = torch.device(device)

    @classmethod
    def for_model(
        cls,
        args: ModelArgs,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> KVCache:
        """The cache a model of `args` reads and writes (`ModelArgs.kv_cache_shape`: GQA heads, or MLA's latent), for
        its attention layers only (`ModelArgs.kv_layers`: a hybrid's recurrent layers keep a `StateCache` instead)."""
        heads, key_dim, value_dim = args.kv_cache_shape
        return cls(
            args.num_layers, num_blocks, block_size, heads, key_dim, dtype, device,
            value_dim=value_dim, cached_layers=args.kv_layers,
        )  # fmt: skip

    @property
    def device(self) -> torch.device:
        return self._device

    def copy_blocks(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """Copy whole blocks `source[i]` -> `target[i]` in every caching layer (a fork's partly filled last block)."""
        for layer in self.layers:
            for store in (self.k, self.v) if self.v else (self.k,):
                store[layer].index_copy_(0, target, store[layer][source])

    def write(self, layer: int, batch: CacheBatch, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the new tokens' k, v `[T, Hkv, D]` at their cache rows."""
        self.write_keys(layer, batch, k)
        self.v[layer].view(-1, *v.shape[1:]).index_copy_(0, batch.write_index, v)

    def write_keys(self, layer: int, batch: CacheBatch, k: torch.Tensor) -> None:
        """Store the new tokens' keys `[T, Hkv, D]` (all a key-only cache holds) at their cache rows."""
        self.k[layer].view(-1, *k.shape[1:]).index_copy_(0, batch.write_index, k)

    def read(self, layer: int, batch: CacheBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sequence's keys and values `[N, max_kv, Hkv, D]`, gathered through its block table."""
        v = self.v[layer]
        return self.read_keys(layer, batch), v.view(-1, *v.shape[2:])[batch.read_index]

    def read_keys(self, layer: int, batch: CacheBatch) -> torch.Tensor:
        """Each sequence's keys `[N, max_kv, Hkv, D]`, gathered through its block table."""
        k = self.k[layer]
        return k.view(-1, *k.shape[2:])[batch.read_index]

    def batch(
        self,
        new_lens: Sequence[int] | torch.Tensor,
        cached_lens: Sequence[int] | torch.Tensor,
        block_tables: Sequence[Sequence[int]] | torch.Tensor,
    ) -> CacheBatch:
        """Describe a step: sequence i adds `new_lens[i]` tokens after `cached_lens[i]` already cached tokens.

        `block_tables[i]` lists the blocks of sequence i (pad unused entries with -1). Pass host lists: lengths
        are validated and maxima taken on the CPU, then the index tensors are built on the cache's device.
        """
        host_new = torch.as_tensor(new_lens, dtype=torch.long).cpu()
        host_total = host_new + torch.as_tensor(cached_lens, dtype=torch.long).cpu()
        host_tables = torch.as_tensor(block_tables, dtype=torch.long).cpu()
        self._check(host_new, host_total, host_tables)
        num_seqs, max_new, max_kv = host_new.shape[0], int(host_new.max()), int(host_total.max())
        device = self.device
        new, tables = host_new.to(device), host_tables.clamp_min(0).to(device)
        cached = host_total.to(device) - new
        starts = new.cumsum(0) - new
        seq = torch.repeat_interleave(torch.arange(num_seqs, device=device), new, output_size=int(host_new.sum()))
        offset = torch.arange(seq.shape[0], device=device) - starts[seq]
        positions = cached[seq] + offset
        slots = torch.arange(max_new, device=device)
        kv_pos = torch.arange(max_kv, device=device)
        query_pos = cached[:, None] + slots[None, :]
        size = self.block_size
        return CacheBatch(
            positions=positions,
            write_index=tables[seq, positions // size] * size + positions % size,
            unpack_index=(starts[:, None] + slots[None, :].minimum(new[:, None] - 1)),
            pack_index=seq * max_new + offset,
            read_index=tables[:, kv_pos // size] * size + kv_pos % size,
            mask=(kv_pos[None, None, :] <= query_pos[:, :, None])[:, None],
            last_index=starts + new - 1,
        )

    def _check(self, new: torch.Tensor, total: torch.Tensor, tables: torch.Tensor) -> None:
        if new.ndim != 1 or total.shape != new.shape or tables.ndim != 2 or tables.shape[0] != new.shape[0]:
            raise ValueError("new_lens and cached_lens must be [N] and block_tables [N, max_blocks]")
        if bool((new < 1).any()):
            raise ValueError("every sequence in a step needs at least one new token")
        capacity = tables.shape[1] * self.block_size
        if bool((total > capacity).any()):
            raise ValueError(f"a sequence needs more than its {capacity} cache positions ({tables.shape[1]} blocks)")
        needed = (total + self.block_size - 1) // self.block_size
        if bool((tables[torch.arange(tables.shape[1]) < needed[:, None]] < 0).any()):
            raise ValueError("a block table has -1 where the sequence needs a block")
        if bool((tables >= self.num_blocks).any()):
            raise ValueError(f"block id out of range: the cache has {self.num_blocks} blocks")
