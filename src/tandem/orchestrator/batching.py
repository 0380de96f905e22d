"""Pack scored rollouts into the trainer's micro-batches: rows of seq_len, balanced over ranks.

Position i of a row predicts token i+1, so a sample's completion token j (after p prompt tokens)
is the target at row position offset + p − 1 + j: that is where its advantage, inference logprob,
loss weight, temperature, kept ids and policy version go.

Kept ids travel compactly, as CSR (`tandem.transport.batches`): per target position the number of kept ids
(`KEPT_COUNTS`, 0: the whole vocabulary), and the kept ids of the whole micro-batch in one flat int32 tensor
(`KEPT_IDS_FLAT`). A token that kept more than `MAX_REPLAY_KEPT` ids cannot be replayed within the cap and is
taken off the loss (`replay_overflow` counts them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.config.orchestrator import MAX_REPLAY_KEPT
from tandem.packing import balance, first_fit_decreasing
from tandem.transport.batches import (
    IMAGE_MASK,
    IMAGE_REFS,
    IMAGE_SIZES,
    KEPT_COUNTS,
    KEPT_IDS_FLAT,
    MicroBatch,
    pack_refs,
)

IGNORE_INDEX = -100


@dataclass(kw_only=True)
class TrainSample:
    """One rollout as the trainer trains it; built by keyword (eleven fields, several alike in type)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # inference logprob of each completion token
    advantage: float
    weight: float  # loss weight of each of this sample's loss tokens (from `loss_weights`)
    temperature: float
    versions: list[int]  # policy version that produced each completion token
    # Per completion token, the ids sampling kept ([]: the whole vocabulary; None, or more than MAX_REPLAY_KEPT:
    # a set too large to replay); None when no token was truncated.
    kept_ids: list[list[int] | None] | None = None
    # Per completion token, whether it is a loss target: False on an environment's messages between the turns
    # of a multi-turn rollout (context the model did not generate); None: every completion token is.
    trained: list[bool] | None = None
    # A vision-language prompt's image references, and their placeholder spans `[start, end)` in `prompt_ids`.
    images: tuple[str, ...] = ()
    image_spans: tuple[tuple[int, int], ...] = ()

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


def _replayable(kept: list[int] | None) -> bool:
    return kept is not None and len(kept) <= MAX_REPLAY_KEPT


def replay_overflow(samples: list[TrainSample]) -> int:
    """Completion tokens that kept more ids than the replay cap (taken off the loss when packed)."""
    return sum(not _replayable(kept) for s in samples if s.kept_ids for kept in s.kept_ids)


def _empty_row(seq_len: int, with_kept_ids: bool) -> MicroBatch:
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
    if with_kept_ids:
        row[KEPT_COUNTS] = torch.zeros(seq_len, dtype=torch.int32)
    return row


def _fill_kept_ids(row: MicroBatch, sample: TrainSample, start: int, kept_ids_flat: list[int]) -> None:
    """Count each completion token's kept ids at its target position (from `start`) and append them to
    `kept_ids_flat`; a token over the cap leaves the loss instead."""
    for j, kept in enumerate(sample.kept_ids or ()):
        if not _replayable(kept):
            row["target_ids"][start + j] = IGNORE_INDEX
            row["loss_weights"][start + j] = 0.0
        else:
            row[KEPT_COUNTS][start + j] = len(kept)
            kept_ids_flat.extend(kept)


def _fill(row: MicroBatch, samples: list[TrainSample], seq_len: int) -> None:
    offset = 0
    kept_ids_flat: list[int] = []
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
        if KEPT_COUNTS in row:
            _fill_kept_ids(row, sample, offset + p - 1, kept_ids_flat)
        if sample.trained is not None:
            context = offset + p - 1 + torch.tensor([not t for t in sample.trained]).nonzero().view(-1)
            row["target_ids"][context] = IGNORE_INDEX
            row["loss_weights"][context] = 0.0
        offset += n
    # The padding tail is its own "document" (positions restart), carrying no loss.
    row["position_ids"][offset:] = torch.arange(seq_len - offset)
    if KEPT_COUNTS in row:
        row[KEPT_IDS_FLAT] = torch.tensor(kept_ids_flat, dtype=torch.int32)


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
    with_kept_ids = any(s.kept_ids for s in samples)
    rows = []
    with_images = any(s.images for s in samples)
    for members in bins:
        row = _empty_row(seq_len, with_kept_ids)
        _fill(row, [samples[i] for i in members], seq_len)
        if with_images:  # each row's images in its samples' order: the order of its placeholder spans
            row[IMAGE_REFS], row[IMAGE_SIZES] = pack_refs([ref for i in members for ref in samples[i].images])
            row[IMAGE_MASK] = _image_mask([samples[i] for i in members], seq_len)
        rows.append(row)
    per_rank = balance([sum(len(samples[i]) for i in members) for members in bins], world_size)
    ranks = []
    for indices in per_rank:
        micros = []
        for start in range(0, len(indices), micro_batch_rows):
            chunk = [rows[i] for i in indices[start : start + micro_batch_rows]]
            micros.append({name: _join(name, [r[name] for r in chunk]) for name in chunk[0]})
        ranks.append(micros)
    return ranks


def _image_mask(samples: list[TrainSample], seq_len: int) -> torch.Tensor:
    """`[seq_len]` bool: True at the packed samples' image placeholder spans."""
    mask = torch.zeros(seq_len, dtype=torch.bool)
    offset = 0
    for sample in samples:
        for start, end in sample.image_spans:
            mask[offset + start : offset + end] = True
        offset += len(sample)
    return mask


def _join(name: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    """Rows into a micro-batch: `[rows, seq_len]`, except the flat kept ids and images, concatenated in row
    order."""
    return torch.cat(tensors) if name in (KEPT_IDS_FLAT, IMAGE_REFS, IMAGE_SIZES) else torch.stack(tensors)
