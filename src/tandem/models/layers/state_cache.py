"""Per-sequence recurrent state for the recurrent layers of hybrid models (Qwen3-Next's Gated DeltaNet, Nemotron-H's
Mamba-2: there `recurrent` is the SSM state `[num_slots, heads, head_dim, state_size]`, see `StateCache.for_model`).

A linear layer does not read its past tokens back: it carries, per sequence, a fixed-size state, the last
`conv_kernel - 1` inputs of its short causal conv (`conv` `[num_slots, conv_dim, conv_kernel - 1]`) and the
delta-rule memory (`recurrent` `[num_slots, num_v_heads, k_head_dim, v_head_dim]`, fp32 by default). A sequence owns
one slot (the engine assigns it, as it assigns KV blocks); a step reads each sequence's slot, advances it by the
step's new tokens and writes it back in place. The full-attention layers of the same model keep using `KVCache`.

A step is `StateBatch`: which slot each sequence of the step's `CacheBatch` uses (same order) and which sequences
start fresh (no cached tokens: their state is read as zeros, whatever the slot held before).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..config import ModelArgs


def read_slots(store: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """`store`'s rows `slots` (a copy), zeros for the `fresh` sequences whatever their slot held."""
    keep = (~fresh).view(-1, *[1] * (store.dim() - 1))
    return store[slots] * keep


def write_slots(store: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """`values` into `store`'s rows `slots`, in the store's dtype."""
    store.index_copy_(0, slots, values.to(store.dtype))


@dataclass(frozen=True)
class StateBatch:
    slots: torch.Tensor  # [N] long: the state slot of each sequence of the step
    fresh: torch.Tensor  # [N] bool: the sequence has no cached tokens yet (its state starts at zero)


class StateCache:
    """Conv and recurrent state per linear-attention or Mamba-2 layer (keyed by decoder layer index) and slot."""

    def __init__(
        self,
        layers: Sequence[int],
        num_slots: int,
        conv_dim: int,
        conv_kernel: int,
        num_v_heads: int,
        k_head_dim: int,
        v_head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        state_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.conv = {i: torch.zeros(num_slots, conv_dim, conv_kernel - 1, dtype=dtype, device=device) for i in layers}
        shape = (num_slots, num_v_heads, k_head_dim, v_head_dim)
        self.recurrent = {i: torch.zeros(shape, dtype=state_dtype, device=device) for i in layers}
        self.num_slots = num_slots
        self.device = torch.device(device)

    @classmethod
    def for_model(
        cls,
        args: ModelArgs,
        num_slots: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        state_dtype: torch.dtype = torch.float32,
    ) -> StateCache:
        """The state a model of `args` reads and writes: one entry per `linear_attention` layer (Gated DeltaNet), or
        per `mamba` layer (Mamba-2: conv `[num_slots, conv_dim, conv_kernel - 1]`, SSM state `[num_slots, heads,
        head_dim, state_size]`)."""
        if args.mamba is not None:
            m = args.mamba
            mamba_layers = [i for i in range(args.num_layers) if args.layer_type(i) == "mamba"]
            return cls(
                mamba_layers, num_slots, m.conv_dim, m.conv_kernel, m.num_heads, m.head_dim, m.state_size,
                dtype, device, state_dtype,
            )  # fmt: skip
        if args.linear is None:
            raise ValueError(f"{args.architecture} has no linear-attention layers")
        la = args.linear
        layers = [i for i in range(args.num_layers) if args.layer_type(i) == "linear_attention"]
        return cls(
            layers, num_slots, la.conv_dim, la.conv_kernel, la.num_v_heads, la.k_head_dim, la.v_head_dim,
            dtype, device, state_dtype,
        )  # fmt: skip

    def batch(self, slots: Sequence[int] | torch.Tensor, cached_lens: Sequence[int] | torch.Tensor) -> StateBatch:
        """Describe a step: sequence i (the i-th of the step's `CacheBatch`) keeps its state in `slots[i]` and has
        `cached_lens[i]` tokens behind it (0: start from a zero state)."""
        host_slots = torch.as_tensor(slots, dtype=torch.long).cpu()
        host_cached = torch.as_tensor(cached_lens, dtype=torch.long).cpu()
        if host_slots.ndim != 1 or host_cached.shape != host_slots.shape:
            raise ValueError("slots and cached_lens must both be [N]")
        if bool(((host_slots < 0) | (host_slots >= self.num_slots)).any()):
            raise ValueError(f"slot out of range: the state cache has {self.num_slots} slots")
        if len(set(host_slots.tolist())) != len(host_slots):
            raise ValueError("two sequences of one step share a state slot")
        return StateBatch(slots=host_slots.to(self.device), fresh=(host_cached == 0).to(self.device))

    def copy(self, src: Sequence[int] | torch.Tensor, dst: Sequence[int] | torch.Tensor) -> None:
        """Copy slots `src[i]` -> `dst[i]` in every layer: fork samples off a prefilled prompt."""
        src_t = torch.as_tensor(src, dtype=torch.long, device=self.device)
        dst_t = torch.as_tensor(dst, dtype=torch.long, device=self.device)
        for store in (self.conv, self.recurrent):
            for tensor in store.values():
                tensor.index_copy_(0, dst_t, tensor[src_t])

    def read_conv(self, layer: int, step: StateBatch) -> torch.Tensor:
        """The step's conv states `[N, conv_dim, K - 1]` (zeros where fresh): its sequences' last inputs."""
        return read_slots(self.conv[layer], step.slots, step.fresh)

    def write_conv(self, layer: int, step: StateBatch, conv: torch.Tensor) -> None:
        write_slots(self.conv[layer], step.slots, conv)

    def read_recurrent(self, layer: int, step: StateBatch) -> torch.Tensor:
        """The step's recurrent states `[N, H, dk, dv]` (zeros where fresh), for a step of several tokens; a decode
        step's function (`STEP_BACKENDS`) reads and writes `recurrent[layer]` in place instead."""
        return read_slots(self.recurrent[layer], step.slots, step.fresh)

    def write_recurrent(self, layer: int, step: StateBatch, recurrent: torch.Tensor) -> None:
        write_slots(self.recurrent[layer], step.slots, recurrent)
