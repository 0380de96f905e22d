"""Decode steps replayed from CUDA graphs: one graph per (batch-size bucket, block-table width bucket).

A decode step of a small model is hundreds of small kernels; launching them one by one from Python costs
more than running them. A graph replays the whole step in one launch. Graphs need static shapes and
addresses, so each bucket owns an input buffer (`decode.decode_step`'s `[N, 2 + W]` tensor, padded rows
pointing at the scratch block) and a logits buffer; weights are updated in place (`weights.py`), so graphs
stay valid across weight swaps. Graphs are captured on first use of a bucket and share one memory pool;
the logits of one replay are consumed before the next. Steps larger than the largest bucket, and buckets
whose capture fails (a host sync in the step, or a compile error), run eagerly and uncompiled.

Hybrid models capture the same way: the state slot of each row is one more column of the input buffer (padded
rows use the scratch slot), and the state cache, like the KV cache, is updated in place at fixed addresses.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.inference.decode import (
    EagerDecoder,
    StepFunction,
    check_rope_offsets,
    check_slots,
    decode_step,
    header_width,
    state_arg,
    write_inputs,
)
from tandem.models import CausalLM, KVCache, StateCache

logger = logging.getLogger(__name__)

MIN_KEY_CAPACITY = 256
"""Smallest key capacity (tokens) of a width bucket; widths double from there up to the context."""


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor
    logits: torch.Tensor


def width_buckets(block_size: int, max_blocks: int) -> list[int]:
    """Block-table widths: powers of two from MIN_KEY_CAPACITY tokens, and `max_blocks` last."""
    widths, width = [], max(1, -(-MIN_KEY_CAPACITY // block_size))
    while width < max_blocks:
        widths.append(width)
        width *= 2
    return [*widths, max_blocks]


class GraphedDecoder:
    """Same interface as `EagerDecoder`; pads each step to its bucket and replays that bucket's graph."""

    def __init__(
        self,
        model: CausalLM,
        cache: KVCache,
        batch_sizes: Sequence[int],
        max_blocks: int,
        step: StepFunction = decode_step,
        state: StateCache | None = None,
    ) -> None:
        self.model, self.cache, self.step, self.state = model, cache, step, state
        self.batch_sizes = sorted(set(batch_sizes))
        self.widths = width_buckets(cache.block_size, max_blocks)
        self.eager = EagerDecoder(model, cache, state=state)  # plain: also the fallback when capturing `step` fails
        self._graphs: dict[tuple[int, int], _Graph | None] = {}
        self._pool = torch.cuda.graph_pool_handle()

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
        rows = next((b for b in self.batch_sizes if b >= len(tokens)), None)
        width = next(w for w in self.widths if w >= max(len(table) for table in tables))
        graph = None if rows is None else self._graph(rows, width)
        if graph is None:
            return self.eager(tokens, lengths, tables, device_tokens, slots, rope_offsets)
        write_inputs(graph.inputs, tokens, lengths, tables, device_tokens, slots, rope_offsets)
        graph.graph.replay()
        return graph.logits[: len(tokens)]

    @property
    def captured(self) -> list[tuple[int, int]]:
        return sorted(key for key, graph in self._graphs.items() if graph is not None)

    def _graph(self, rows: int, width: int) -> _Graph | None:
        key = (rows, width)
        if key not in self._graphs:
            try:
                self._graphs[key] = self._capture(rows, width)
            except Exception as error:  # e.g. an op that syncs with the host; that bucket runs eagerly
                logger.warning("CUDA graph capture failed for batch %d, width %d; running it eagerly: %s", *key, error)
                self._graphs[key] = None
        return self._graphs[key]

    def _capture(self, rows: int, width: int) -> _Graph:
        header = header_width(self.model, self.state)  # a state slot or RoPE offset column: 0, as the blocks
        inputs = torch.zeros(rows, header + width, dtype=torch.int64, device=self.cache.device)  # all scratch
        extra = state_arg(self.state)
        side = torch.cuda.Stream(self.cache.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: lazy initialisation, compilation and autotuning happen outside capture
                self.step(self.model, self.cache, inputs, *extra)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self.step(self.model, self.cache, inputs, *extra)
        logger.info(
            "captured a CUDA graph for decode steps of batch %d, key capacity %d", rows, width * self.cache.block_size
        )
        return _Graph(graph, inputs, logits)
