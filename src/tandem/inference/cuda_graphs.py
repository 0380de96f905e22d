"""Decode steps replayed from CUDA graphs: one graph per (batch-size bucket, block-table width bucket).

A decode step of a small model is hundreds of small kernels; launching them one by one from Python costs
more than running them. A graph replays the whole step in one launch. Graphs need static shapes and
addresses, so each bucket owns its input buffers (`decode.decode_step`'s `[N, 2 + W]` tensor, padded rows
pointing at the scratch block) and an output buffer; weights are updated in place (`weights.py`), so graphs
stay valid across weight swaps. Multi-step decodes (`decode.decode_many`: K steps with the sampler in the
graph) get graphs of their own, keyed also by K and by whether any row samples. Graphs are captured on first
use of a bucket and share one memory pool; the output of one replay is consumed before the next. Steps
larger than the largest bucket, and buckets whose capture fails (a host sync in the step, or a compile
error), run eagerly and uncompiled.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tandem.inference.decode import (
    EagerDecoder,
    SamplingKeys,
    StepFunction,
    decode_inputs,
    decode_many,
    decode_step,
)
from tandem.models import CausalLM, KVCache

logger = logging.getLogger(__name__)

MIN_KEY_CAPACITY = 256
"""Smallest key capacity (tokens) of a width bucket; widths double from there up to the context."""


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, ...]
    output: torch.Tensor

    def replay(self, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        for buffer, host in zip(self.inputs, inputs, strict=True):
            buffer.copy_(host)
        self.graph.replay()
        return self.output


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
    ) -> None:
        self.model, self.cache, self.step = model, cache, step
        self.batch_sizes = sorted(set(batch_sizes))
        self.widths = width_buckets(cache.block_size, max_blocks)
        self.eager = EagerDecoder(model, cache)  # plain: it is also the fallback when capturing `step` fails
        self._graphs: dict[tuple[int, int], _Graph | None] = {}
        self._pool = torch.cuda.graph_pool_handle()

    def __call__(self, tokens: Sequence[int], lengths: Sequence[int], tables: Sequence[Sequence[int]]) -> torch.Tensor:
        bucket = self._bucket(tokens, tables)
        if bucket is None:
            return self.eager(tokens, lengths, tables)
        rows, width = bucket
        inputs = (decode_inputs(tokens, lengths, tables, rows, width),)
        graph = self._graph(("step", rows, width), inputs, lambda buffer: self.step(self.model, self.cache, buffer))
        if graph is None:
            return self.eager(tokens, lengths, tables)
        return graph.replay(inputs)[: len(tokens)]

    def many(
        self,
        tokens: Sequence[int],
        lengths: Sequence[int],
        tables: Sequence[Sequence[int]],
        keys: SamplingKeys,
        num_steps: int,
        sampled: bool,
    ) -> torch.Tensor:
        """`EagerDecoder.many`, replayed from the graph of (bucket, num_steps, sampled)."""
        bucket = self._bucket(tokens, tables)
        if bucket is None:
            return self.eager.many(tokens, lengths, tables, keys, num_steps, sampled)
        rows, width = bucket
        inputs = (decode_inputs(tokens, lengths, tables, rows, width), *keys.tensors(rows))

        def run(inputs: torch.Tensor, keys: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
            return decode_many(self.step, self.model, self.cache, inputs, keys, temperature, num_steps, sampled)

        graph = self._graph(("many", rows, width, num_steps, sampled), inputs, run)
        if graph is None:
            return self.eager.many(tokens, lengths, tables, keys, num_steps, sampled)
        return graph.replay(inputs)[:, :, : len(tokens)]

    @property
    def captured(self) -> list[tuple[int, int]]:
        """(batch, width) of the single-step graphs captured so far."""
        return sorted(key[1:] for key, graph in self._graphs.items() if graph is not None and key[0] == "step")

    def _bucket(self, tokens: Sequence[int], tables: Sequence[Sequence[int]]) -> tuple[int, int] | None:
        rows = next((b for b in self.batch_sizes if b >= len(tokens)), None)
        if rows is None:
            return None
        return rows, next(w for w in self.widths if w >= max(len(table) for table in tables))

    def _graph(self, key: tuple, inputs: Sequence[torch.Tensor], run: Callable[..., torch.Tensor]) -> _Graph | None:
        if key not in self._graphs:
            try:
                self._graphs[key] = self._capture(inputs, run)
                logger.info("captured a CUDA graph for %s", key)
            except Exception as error:  # e.g. an op that syncs with the host; that bucket runs eagerly
                logger.warning("CUDA graph capture failed for %s; running it eagerly: %s", key, error)
                self._graphs[key] = None
        return self._graphs[key]

    def _capture(self, inputs: Sequence[torch.Tensor], run: Callable[..., torch.Tensor]) -> _Graph:
        # zeros are valid inputs: token 0 at position 0 of the scratch block, greedy
        buffers = tuple(torch.zeros_like(t, device=self.cache.device) for t in inputs)
        side = torch.cuda.Stream(self.cache.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: lazy initialisation, compilation and autotuning happen outside capture
                run(*buffers)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            output = run(*buffers)
        return _Graph(graph, buffers, output)
