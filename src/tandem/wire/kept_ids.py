"""Kept ids on the wire: the token ids top-k / top-p / min-p kept at one step, encoded as a short string.

A `/generate` sample carries one encoded string per token in its `masks` field (the wire name, kept for the
clients and the vLLM routes that speak it); everywhere else the concept is "kept ids". Standard library only,
so the orchestrator (or any client) decodes them without the engine. Two encodings; the encoder picks the shorter
for each step:

- `"i" + base64(sorted ids as int32 little-endian)`: 4 bytes per kept id (few ids: top-k, peaked top-p);
- `"b" + base64(bitmap)`: bit `t % 8` of byte `t // 8` is set when id `t` is kept; ceil(vocab / 8) bytes
  (many ids).

A step that kept the whole vocabulary has no encoding (`None`); `decode_kept_matrix` turns a sample's encoded
kept ids into the rows of the `-1`-padded kept matrix `tandem.models.token_logprobs(kept_matrix=...)` takes,
where a row of -1 means "whole vocabulary".
"""

from __future__ import annotations

import base64
import sys
from array import array
from collections.abc import Iterable, Sequence

_BIT_POSITIONS = tuple(tuple(bit for bit in range(8) if byte >> bit & 1) for byte in range(256))


def encode_kept_ids(ids: Iterable[int], vocab_size: int) -> str:
    """The kept ids (any order, no duplicates) of a vocabulary of `vocab_size` tokens, encoded."""
    ordered = sorted(ids)
    if ordered and not 0 <= ordered[0] <= ordered[-1] < vocab_size:
        raise ValueError(f"kept ids must lie in [0, {vocab_size})")
    if 4 * len(ordered) <= (vocab_size + 7) // 8:
        packed = array("i", ordered)
        if sys.byteorder == "big":
            packed.byteswap()
        return "i" + base64.b64encode(packed.tobytes()).decode("ascii")
    bitmap = bytearray((vocab_size + 7) // 8)
    for token in ordered:
        bitmap[token >> 3] |= 1 << (token & 7)
    return "b" + base64.b64encode(bytes(bitmap)).decode("ascii")


def decode_kept_ids(encoded: str) -> list[int]:
    """The kept ids of one encoded step, ascending."""
    kind, payload = encoded[:1], base64.b64decode(encoded[1:], validate=True)
    if kind == "i":
        if len(payload) % 4:
            raise ValueError("'i'-encoded kept ids hold whole int32 values")
        ids = array("i")
        ids.frombytes(payload)
        if sys.byteorder == "big":
            ids.byteswap()
        return ids.tolist()
    if kind == "b":
        return [8 * i + bit for i, byte in enumerate(payload) if byte for bit in _BIT_POSITIONS[byte]]
    raise ValueError(f"unknown kept-ids encoding {kind!r} (expected 'i' or 'b')")


def count_kept_ids(encoded: str) -> int:
    """How many ids one encoded step kept, without listing them (a flat top-p step can keep most of the vocab)."""
    kind, payload = encoded[:1], base64.b64decode(encoded[1:], validate=True)
    if kind == "i":
        if len(payload) % 4:
            raise ValueError("'i'-encoded kept ids hold whole int32 values")
        return len(payload) // 4
    if kind == "b":
        return int.from_bytes(payload, "little").bit_count()
    raise ValueError(f"unknown kept-ids encoding {kind!r} (expected 'i' or 'b')")


def decode_kept_matrix(encoded: Sequence[str | None]) -> list[list[int]]:
    """The kept matrix of a sequence of encoded steps, as lists: one row of kept ids per token, padded with -1 to
    a common width; `None` (no truncation) is a row of -1. `torch.tensor` of it is a `[tokens, K]` kept matrix."""
    rows = [decode_kept_ids(step) if step is not None else [] for step in encoded]
    width = max((len(row) for row in rows), default=0) or 1
    return [row + [-1] * (width - len(row)) for row in rows]
