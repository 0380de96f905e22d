"""Sampling masks on the wire: the set of token ids top-k / top-p / min-p kept at one step, as a short string.

Standard library only, so the trainer (or any client) decodes masks without the engine. Two encodings; the
encoder picks the shorter for each set:

- `"i" + base64(sorted ids as int32 little-endian)`: 4 bytes per kept id (small sets: top-k, peaked top-p);
- `"b" + base64(bitmap)`: bit `t % 8` of byte `t // 8` is set when id `t` is kept; ceil(vocab / 8) bytes
  (large sets).

A step that kept the whole vocabulary has no mask (`None`); `kept_ids_rows` turns a sequence of masks into
the `-1`-padded rows `tandem.models.token_logprobs(kept_ids=...)` takes, where a row of -1 means "whole
vocabulary".
"""

from __future__ import annotations

import base64
import sys
from array import array
from collections.abc import Iterable, Sequence

_BIT_POSITIONS = tuple(tuple(bit for bit in range(8) if byte >> bit & 1) for byte in range(256))


def encode_mask(ids: Iterable[int], vocab_size: int) -> str:
    """The kept ids (any order, no duplicates) of a vocabulary of `vocab_size` tokens, encoded."""
    ordered = sorted(ids)
    if ordered and not 0 <= ordered[0] <= ordered[-1] < vocab_size:
        raise ValueError(f"mask ids must lie in [0, {vocab_size})")
    if 4 * len(ordered) <= (vocab_size + 7) // 8:
        packed = array("i", ordered)
        if sys.byteorder == "big":
            packed.byteswap()
        return "i" + base64.b64encode(packed.tobytes()).decode("ascii")
    bitmap = bytearray((vocab_size + 7) // 8)
    for token in ordered:
        bitmap[token >> 3] |= 1 << (token & 7)
    return "b" + base64.b64encode(bytes(bitmap)).decode("ascii")


def decode_mask(encoded: str) -> list[int]:
    """The kept ids of an encoded mask, ascending."""
    kind, payload = encoded[:1], base64.b64decode(encoded[1:], validate=True)
    if kind == "i":
        if len(payload) % 4:
            raise ValueError("an 'i' mask holds whole int32 values")
        ids = array("i")
        ids.frombytes(payload)
        if sys.byteorder == "big":
            ids.byteswap()
        return ids.tolist()
    if kind == "b":
        return [8 * i + bit for i, byte in enumerate(payload) if byte for bit in _BIT_POSITIONS[byte]]
    raise ValueError(f"unknown mask encoding {kind!r} (expected 'i' or 'b')")


def mask_size(encoded: str) -> int:
    """How many ids an encoded mask keeps, without listing them (a flat top-p set can hold most of the vocab)."""
    kind, payload = encoded[:1], base64.b64decode(encoded[1:], validate=True)
    if kind == "i":
        if len(payload) % 4:
            raise ValueError("an 'i' mask holds whole int32 values")
        return len(payload) // 4
    if kind == "b":
        return int.from_bytes(payload, "little").bit_count()
    raise ValueError(f"unknown mask encoding {kind!r} (expected 'i' or 'b')")


def kept_ids_rows(masks: Sequence[str | None]) -> list[list[int]]:
    """One row of kept ids per token, padded with -1 to a common width; `None` (no truncation) is all -1."""
    rows = [decode_mask(mask) if mask is not None else [] for mask in masks]
    width = max((len(row) for row in rows), default=0) or 1
    return [row + [-1] * (width - len(row)) for row in rows]
