"""Routed experts: the experts an MoE model's router chose for every position of a sample, returned with it.

A trainer that replays the engine's routing (prime-rl's router replay) needs them, and verifiers' traces carry
them (`routed_experts`) from the token route. With `inference.return_routed_experts`, every MoE layer writes each
forward's top-k choice into one device buffer `[moe_layers, rows, k]` (`record_routing`; CUDA graphs write it at
its address). After each forward the runner reads the step's rows back and files them by position into each
sequence's `ExpertRows`: a preempted sequence that is prefilled again overwrites its own rows, and a forked sample
starts from a copy of its parent's prompt rows.

A finished sample reports positions `[0, prompt + completion - 1)`: its last token never ran through the model.
Reading the rows back synchronises with the device after every forward, so the option costs decode speed; it is
off unless asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tandem.models import CausalLM
from tandem.models.layers.moe import record_routing
from tandem.wire.protocol import RoutedExperts

if TYPE_CHECKING:
    from tandem.inference.scheduler import Sequence


def routing_dtype(num_experts: int) -> torch.dtype:
    """The narrowest integer type that holds every expert id (the wire's `uint8` or, as int16 bytes, `uint16`)."""
    return torch.uint8 if num_experts <= 256 else torch.int16


class ExpertRows:
    """One sequence's routing: row p `[moe_layers, k]` holds the experts of position p, filled as positions are
    computed (host memory)."""

    def __init__(self, layers: int, top_k: int, dtype: torch.dtype) -> None:
        self.rows = torch.zeros(0, layers, top_k, dtype=dtype)
        self.filled = 0
        """Positions `[0, filled)` are written."""

    def write(self, start: int, rows: torch.Tensor) -> None:
        """Positions `[start, start + len(rows))` get `rows` (`[n, moe_layers, k]`)."""
        if start > self.filled:
            raise RuntimeError(f"routing of position {start} filed before positions {self.filled}..{start - 1}")
        end = start + rows.shape[0]
        if end > self.rows.shape[0]:
            grown = torch.zeros(max(end, 2 * self.rows.shape[0]), *self.rows.shape[1:], dtype=self.rows.dtype)
            grown[: self.filled] = self.rows[: self.filled]
            self.rows = grown
        self.rows[start:end] = rows
        self.filled = max(self.filled, end)

    def copy(self) -> ExpertRows:
        twin = ExpertRows(*self.rows.shape[1:], dtype=self.rows.dtype)
        twin.write(0, self.rows[: self.filled])
        return twin

    def wire(self, positions: int) -> RoutedExperts:
        """Positions `[0, positions)` in the wire's shape."""
        if positions > self.filled:
            raise RuntimeError(f"routing asked for {positions} positions, {self.filled} recorded")
        rows = self.rows[:positions].contiguous()
        dtype = "uint8" if rows.dtype == torch.uint8 else "uint16"  # int16 bytes of ids < 2**15 read as uint16
        return RoutedExperts.of_bytes(rows.numpy().tobytes(), dtype, tuple(rows.shape))


class RoutingRecorder:
    """The device buffer every MoE layer of the served model writes its choices into, and their filing."""

    def __init__(self, model: CausalLM, rows: int, device: torch.device) -> None:
        moe = model.args.moe
        if moe is None:
            raise ValueError(
                f"inference.return_routed_experts: {model.args.architecture} is not a mixture of experts, so it "
                "routes no tokens; turn the option off"
            )
        self.dtype = routing_dtype(moe.num_experts)
        self.buffer = torch.zeros(len(moe.layers), rows, moe.top_k, dtype=self.dtype, device=device)
        record_routing(model, self.buffer)

    def file_prefill(self, chunks: list[tuple[Sequence, int]]) -> None:
        """After a prefill forward of `chunks`, before their cached counts move on."""
        rows = self._read(sum(take for _, take in chunks))
        start = 0
        for seq, take in chunks:
            self._rows_of(seq).write(seq.num_cached, rows[start : start + take])
            start += take

    def file_decode(self, seqs: list[Sequence]) -> None:
        """After a decode forward of `seqs` (one row each), before their cached counts move on."""
        rows = self._read(len(seqs))
        for row, seq in enumerate(seqs):
            self._rows_of(seq).write(seq.num_cached, rows[row : row + 1])

    @staticmethod
    def fork(parent: Sequence, children: list[Sequence]) -> None:
        """Forked samples share their parent's prompt, and so its routing."""
        if parent.routing is not None:
            for child in children:
                child.routing = parent.routing.copy()

    def _read(self, rows: int) -> torch.Tensor:
        """The last forward's first `rows` rows, `[rows, moe_layers, k]` on the host."""
        return self.buffer[:, :rows].transpose(0, 1).cpu()

    def _rows_of(self, seq: Sequence) -> ExpertRows:
        if seq.routing is None:
            seq.routing = ExpertRows(self.buffer.shape[0], self.buffer.shape[2], self.dtype)
        return seq.routing
