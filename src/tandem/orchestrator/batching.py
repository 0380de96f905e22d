"""Pack scored rollouts into the trainer's micro-batches: rows of seq_len, balanced over ranks.

Position i of a row predicts token i+1, so a sample's completion token j (after p prompt tokens)
is the target at row position offset + p − 1 + j: that is where its advantage, inference logprob,
loss weight, temperature, sampling mask and policy version go.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.packing import balance, first_fit_decreasing
from tandem.transport.batches import MicroBatch

IGNORE_INDEX = -100


@dataclass
class TrainSample:
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # inference logprob of each completion token
    advantage: float
    weight: float  # loss weight of each of this sample's loss tokens (from `loss_weights`)
    temperature: float
    versions: list[int]  # policy version that produced each completion token
    kept_ids: list[list[int]] | None = None  # per completion token, the ids sampling kept (None: whole vocab)

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


def _empty_row(seq_len: int, kept_width: int) -> MicroBatch:
    row = {
        "input_ids": torch.zeros(seq_len, dtype=torch.long),
        "position_ids": torch.arange(seq_len),
        "target_ids": torch.full((seq_len,), IGNORE_INDEX, dtype=torch.long),
        "advantages": torch.zeros(seq_len),
        "inference_logprobs": torch.zeros(seq_len),
        "loss_weights": torch.zeros(seq_len),
        "temperatures": torch.ones(seq_len),
        "versions": torch.zeros(seq_len, dtype=torch.long),
    }
    if kept_width:
        row["kept_ids"] = torch.full((seq_len, kept_width), -1, dtype=torch.long)
    return row


def _fill(row: MicroBatch, samples: list[TrainSample], seq_len: int) -> None:
    offset = 0
    for sample in samples:
        tokens = torch.tensor([*sample.prompt_ids, *sample.completion_ids], dtype=torch.long)
        n, p, c = len(tokens), len(sample.prompt_ids), len(sample.completion_ids)
        row["input_ids"][offset : offset + n] = tokens
        row["position_ids"][offset : offset + n] = torch.arange(n)
        targets = slice(offset + p - 1, offset + p - 1 + c)
        row["target_ids"][targets] = tokens[p:]
        row["advantages"][targets] = sample.advantage
        row["inference_logprobs"][targets] = torch.tensor(sample.logprobs)
        row["loss_weights"][targets] = sample.weight
        row["temperatures"][targets] = sample.temperature
        row["versions"][targets] = torch.tensor(sample.versions, dtype=torch.long)
        if "kept_ids" in row and sample.kept_ids is not None:
            for j, kept in enumerate(sample.kept_ids):
                row["kept_ids"][offset + p - 1 + j, : len(kept)] = torch.tensor(kept, dtype=torch.long)
        offset += n
    # The padding tail is its own "document" (positions restart), carrying no loss.
    row["position_ids"][offset:] = torch.arange(seq_len - offset)


def pack_batch(
    samples: list[TrainSample], seq_len: int, world_size: int, micro_batch_rows: int = 1
) -> list[list[MicroBatch]]:
    """Per rank, a list of micro-batches `[micro_batch_rows, seq_len]`; empty rows pad the count evenly."""
    for index, sample in enumerate(samples):
        if not sample.prompt_ids or len(sample) > seq_len:
            raise ValueError(
                f"sample {index} has {len(sample)} tokens; it must have a prompt and fit seq_len {seq_len}"
            )
    bins = first_fit_decreasing([len(s) for s in samples], seq_len)
    unit = world_size * micro_batch_rows
    bins += [[] for _ in range(-len(bins) % unit)]
    kept_width = max((len(k) for s in samples if s.kept_ids for k in s.kept_ids), default=0)
    rows = []
    for members in bins:
        row = _empty_row(seq_len, kept_width)
        _fill(row, [samples[i] for i in members], seq_len)
        rows.append(row)
    per_rank = balance([sum(len(samples[i]) for i in members) for members in bins], world_size)
    ranks = []
    for indices in per_rank:
        micros = []
        for start in range(0, len(indices), micro_batch_rows):
            chunk = [rows[i] for i in indices[start : start + micro_batch_rows]]
            micros.append({name: torch.stack([r[name] for r in chunk]) for name in chunk[0]})
        ranks.append(micros)
    return ranks
