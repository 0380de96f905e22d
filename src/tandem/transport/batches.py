"""Training batches from the orchestrator to the trainer, as files.

`<run>/batches/step-<N>.safetensors` holds every micro-batch of every trainer rank for step N,
keyed `rank<r>.micro<m>.<field>`, plus JSON metadata (step, world size, micro-batches per rank,
anything else the orchestrator reports). Safetensors is self-describing and never unpickles; the
file is written atomically (`tandem.files.atomic_path`), so a reader never sees half a batch.

The kept ids of truncated sampling are stored compressed, as CSR: `KEPT_COUNTS` `[rows, seq_len]` int32 (how many
ids sampling kept at each position; 0: the whole vocabulary) and `KEPT_IDS_FLAT` `[sum of counts]` int32 (those
ids, position after position in row-major order). `kept_matrix_from_csr` rebuilds the `-1`-padded
`[rows, seq_len, K]` kept matrix the model's logprobs take, K being the largest count of that micro-batch only.

A vision-language model's images travel as their references (`tandem.images`: the data URLs the rollouts were
sampled with), never as pixels: `IMAGE_REFS` `[total bytes]` uint8, the UTF-8 references one after another in the
order of their placeholder spans, and `IMAGE_SIZES` `[images]` int64, each one's length (`pack_refs`,
`unpack_refs`), with `IMAGE_MASK` marking the placeholder tokens. The trainer reads the pixels from those bytes,
as the server did.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tandem.files import atomic_path

MicroBatch = dict[str, torch.Tensor]

KEPT_COUNTS = "kept_counts"
"""Micro-batch field (and batch-file key): `[rows, seq_len]` int32, the number of kept ids at each position."""
KEPT_IDS_FLAT = "kept_ids"
"""Micro-batch field (and batch-file key): `[sum of counts]` int32, every position's kept ids, flat. The key stays
`kept_ids`, the name batch files have always used, so a run resumes from the batch files of an earlier version."""


IMAGE_REFS = "image_refs"
"""Micro-batch field: `[total bytes]` uint8, the micro-batch's image references, UTF-8, one after another."""
IMAGE_SIZES = "image_sizes"
"""Micro-batch field: `[images]` int64, the byte length of each image reference in `IMAGE_REFS`."""
IMAGE_MASK = "image_mask"
"""Micro-batch field: `[rows, seq_len]` bool, True at the images' placeholder tokens (the spans the server
expanded; a completion may sample the placeholder id as text)."""


def pack_refs(refs: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(`IMAGE_REFS`, `IMAGE_SIZES`) tensors of image references."""
    encoded = [ref.encode() for ref in refs]
    joined = b"".join(encoded)
    data = torch.frombuffer(bytearray(joined), dtype=torch.uint8) if joined else torch.empty(0, dtype=torch.uint8)
    return data, torch.tensor([len(e) for e in encoded], dtype=torch.int64)


def unpack_refs(data: torch.Tensor, sizes: torch.Tensor) -> list[str]:
    """The image references `pack_refs` stored."""
    raw = data.to(torch.uint8).cpu().numpy().tobytes()
    ends = sizes.cumsum(0).tolist()
    return [raw[start:end].decode() for start, end in zip([0, *ends][:-1], ends, strict=True)]


class BatchTimeout(TimeoutError):
    """No batch for a step arrived in time: the orchestrator is gone or stuck."""


def batch_path(root: Path, step: int) -> Path:
    return root / f"step-{step:06d}.safetensors"


def write_batch(root: Path, step: int, ranks: list[list[MicroBatch]], meta: dict[str, Any]) -> Path:
    """Write all ranks' micro-batches of one step atomically."""
    micro_counts = {len(micros) for micros in ranks}
    if len(micro_counts) != 1:
        raise ValueError(f"every rank needs the same number of micro-batches, got {sorted(micro_counts)}")
    tensors = {
        f"rank{rank}.micro{index}.{name}": tensor.contiguous()
        for rank, micros in enumerate(ranks)
        for index, micro in enumerate(micros)
        for name, tensor in micro.items()
    }
    header = {"step": step, "world_size": len(ranks), "micro_batches": micro_counts.pop(), **meta}
    final = batch_path(root, step)
    with atomic_path(final) as tmp:
        save_file(tensors, str(tmp), metadata={"tandem": json.dumps(header)})
    return final


def read_batch(root: Path, step: int, rank: int, world_size: int) -> tuple[list[MicroBatch], dict[str, Any]]:
    """This rank's micro-batches of a step and the batch metadata."""
    path = batch_path(root, step)
    with safe_open(str(path), "pt") as handle:
        header = json.loads(handle.metadata()["tandem"])
        if header["world_size"] != world_size:
            raise ValueError(f"{path} was packed for {header['world_size']} trainer ranks, this run has {world_size}")
        micros: list[MicroBatch] = [{} for _ in range(header["micro_batches"])]
        prefix = f"rank{rank}."
        for key in handle.keys():  # noqa: SIM118 (safe_open is not iterable)
            if key.startswith(prefix):
                _, micro, name = key.split(".", 2)
                micros[int(micro.removeprefix("micro"))][name] = handle.get_tensor(key)
    return micros, header


def kept_matrix_from_csr(
    counts: torch.Tensor, flat: torch.Tensor, vocab_size: int, device: torch.device | None = None
) -> torch.Tensor:
    """The `[rows, seq_len, K]` int64 kept matrix on `device` (kept ids padded with -1; a position of all -1 keeps
    the whole vocabulary) of a micro-batch's CSR kept ids (`KEPT_COUNTS`, `KEPT_IDS_FLAT`), as read (on the host).
    Raises ValueError on kept ids that do not add up. Built on `device` by a gather whose width is known on the
    host, so a GPU step does not wait for it."""
    counts = counts.long()
    if (counts < 0).any() or int(counts.sum()) != flat.numel():
        raise ValueError(f"kept ids do not add up: {int(counts.sum())} counted, {flat.numel()} kept ids stored")
    if flat.numel() and not (int(flat.min()) >= 0 and int(flat.max()) < vocab_size):
        raise ValueError(f"kept ids name token ids outside the vocabulary of {vocab_size}")
    width = max(int(counts.max()) if counts.numel() else 0, 1)
    counts, flat = counts.to(device), flat.to(device, torch.long)
    slots = torch.arange(width, device=counts.device)
    starts = (counts.flatten().cumsum(0) - counts.flatten()).view(counts.shape)
    index = (starts.unsqueeze(-1) + slots).clamp_(max=max(flat.numel() - 1, 0))
    ids = flat[index] if flat.numel() else torch.zeros_like(index)
    return ids.masked_fill_(slots >= counts.unsqueeze(-1), -1)


def wait_for_batch(root: Path, step: int, timeout_s: float, poll_s: float = 0.05) -> Path:
    """Block until step's batch exists; raise BatchTimeout after timeout_s."""
    path = batch_path(root, step)
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise BatchTimeout(
                f"no batch for step {step} in {root} after {timeout_s:.0f}s: is the orchestrator running?"
            )
        time.sleep(poll_s)
    return path
