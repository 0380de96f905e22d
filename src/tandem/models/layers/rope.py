"""Rotary position embeddings: one frequency table, one cos/sin function, one `apply_rope` for every attention path.

Frequencies and angles are computed in fp32 and cos/sin cast to the activation dtype afterwards, as Hugging Face
does, so training, packed, and cached inference all rotate q and k identically.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from ..config import RopeArgs


def inv_frequencies(rope: RopeArgs, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies `[head_dim // 2]` (fp32) and the cos/sin scale for the configured RoPE scaling type."""
    powers = rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    inv_freq = 1.0 / powers
    if rope.type == "default":
        return inv_freq, 1.0
    if rope.type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.type == "llama3":
        return _llama3(inv_freq, rope), 1.0
    if rope.type == "yarn":
        return _yarn(powers, rope, head_dim)
    raise ValueError(f"unsupported rope type {rope.type!r}")


def _llama3(inv_freq: torch.Tensor, rope: RopeArgs) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate smoothly in between."""
    old_len = rope.original_max_position_embeddings
    low_wavelen, high_wavelen = old_len / rope.low_freq_factor, old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def yarn_mscale(factor: float, m: float = 1.0) -> float:
    """YaRN's attention temperature correction for a context extended `factor` times."""
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def softmax_scale(rope: RopeArgs, head_dim: int) -> float:
    """MLA's softmax scale: `head_dim ** -0.5`, times `yarn_mscale(factor, mscale_all_dim) ** 2` when scaled RoPE
    sets `mscale_all_dim`, so the correction reaches the non-rotary dims too (DeepSeek; HF `yarn_apply_mscale`)."""
    scale = head_dim**-0.5
    if rope.type != "default" and rope.mscale_all_dim:
        scale *= yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
    return scale


def _yarn(powers: torch.Tensor, rope: RopeArgs, head_dim: int) -> tuple[torch.Tensor, float]:
    """YaRN: blend interpolated and extrapolated frequencies by a linear ramp over dimensions; scale cos/sin."""
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
        else:
            attention_factor = yarn_mscale(rope.factor)

    def correction_dim(rotations: float) -> float:
        original = rope.original_max_position_embeddings
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    interpolated, extrapolated = 1.0 / (rope.factor * powers), 1.0 / powers
    blended = interpolated * (1 - extrapolation) + extrapolated * extrapolation
    return blended, float(attention_factor)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, scale: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin `[*positions.shape, head_dim]` for integer positions, computed in fp32 then cast to `dtype`."""
    angles = positions[..., None].float() * inv_freq.float()
    angles = torch.cat((angles, angles), dim=-1)
    return (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q `[..., S, Hq, D]` and k `[..., S, Hkv, D]` by cos/sin `[..., S, D]` (broadcast over heads)."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


RopeFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def rotate_leading(
    rope: RopeFn, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope` on the leading `cos.shape[-1]` dims of each head; the rest pass through (partial rotary, GLM)."""
    dim = cos.shape[-1]
    if dim == q.shape[-1]:
        return rope(q, k, cos, sin)
    q_rot, k_rot = rope(q[..., :dim], k[..., :dim], cos, sin)
    return torch.cat((q_rot, q[..., dim:]), dim=-1), torch.cat((k_rot, k[..., dim:]), dim=-1)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """`(x0, x1), (x2, x3), ...` pairs -> `(x0, x2, ..., x1, x3, ...)`: the half-split layout `apply_rope` rotates.

    Rotating interleaved pairs equals rotating the de-interleaved vector; q and k are permuted alike, so their
    dot products are unchanged (what HF's `apply_rotary_pos_emb_interleave` computes, bit for bit).
    """
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


# `rope_backend` names. Kernels that must match `apply_rope` bit for bit (tandem.kernels.rope) are registered by
# their user, since this package imports nothing else of tandem.
ROPE_BACKENDS: dict[str, RopeFn] = {"torch": apply_rope}


def check_rope_backend(name: str) -> None:
    """A ValueError listing the known backends unless `name` is one (attention modules check at build time)."""
    if name not in ROPE_BACKENDS:
        raise ValueError(f"unknown rope_backend {name!r}; known: {sorted(ROPE_BACKENDS)}")


class RotaryEmbedding(nn.Module):
    """Holds the frequency table as a non-persistent buffer (never in checkpoints) and produces cos/sin."""

    def __init__(self, rope: RopeArgs, head_dim: int) -> None:
        super().__init__()
        self.rope, self.head_dim = rope, head_dim
        inv_freq, self.scale = inv_frequencies(rope, head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def init_buffers(self, device: torch.device | str) -> None:
        """Recompute the table on `device` (after building on `meta` and materialising)."""
        self.inv_freq = inv_frequencies(self.rope, self.head_dim)[0].to(device)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> RotaryEmbedding:
        """Keep the table fp32 when the model is cast (`model.to(torch.bfloat16)`), and real after `to_empty`."""
        super()._apply(fn, recurse)
        self.init_buffers(self.inv_freq.device)
        return self

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin `[*positions.shape, D]` for integer positions, or `[B, S, D]` for a model with M-RoPE given
        positions `[3, B, S]` (time, height, width: `mrope_angles`)."""
        if not (self.rope.mrope_section and positions.ndim == 3):
            return rope_cos_sin(positions, self.inv_freq, self.scale, dtype)
        angles = mrope_angles(positions, self.inv_freq, self.rope.mrope_section, self.rope.mrope_interleaved)
        angles = torch.cat((angles, angles), dim=-1)
        return (angles.cos() * self.scale).to(dtype), (angles.sin() * self.scale).to(dtype)


def mrope_angles(
    positions: torch.Tensor, inv_freq: torch.Tensor, section: tuple[int, ...], interleaved: bool
) -> torch.Tensor:
    """M-RoPE's angles `[B, S, D/2]` for positions `[3, B, S]`: each frequency rotates by one axis's position.
    Interleaved (Qwen3-VL): frequency i takes height if i % 3 == 1 and i < 3 * section[1], width likewise with
    i % 3 == 2, else time; in blocks (Qwen2.5-VL): the first section[0] frequencies take time, the next section[1]
    height, the last section[2] width. Text tokens have the same position on all three axes: plain RoPE."""
    if len(section) != 3 or sum(section) != inv_freq.shape[0]:
        raise ValueError(f"mrope_section {section} must be three counts summing to {inv_freq.shape[0]} frequencies")
    angles = positions[..., None].float() * inv_freq.float()  # [3, B, S, D/2]
    if interleaved:
        axis = torch.zeros(inv_freq.shape[0], dtype=torch.long, device=positions.device)
        index = torch.arange(inv_freq.shape[0], device=positions.device)
        for a in (1, 2):
            axis[(index % 3 == a) & (index < 3 * section[a])] = a
    else:
        axis = torch.repeat_interleave(
            torch.arange(3, device=positions.device), torch.tensor(section).to(positions.device)
        )
    return angles.gather(0, axis.expand(*angles.shape[1:])[None]).squeeze(0)


def mrope_positions(
    input_ids: torch.Tensor,
    image_token_id: int,
    grid_thw: torch.Tensor,
    spatial_merge_size: int,
    position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    placeholders: torch.Tensor | None = None,
) -> torch.Tensor:
    """M-RoPE positions `[3, B, S]` of a batch with images (Qwen-VL's rule, transformers' `get_rope_index`).

    Text tokens count up on all three axes. An image's placeholder span (`image_token_id` repeated t * h * w /
    merge^2 times, images in batch order, one row of `grid_thw` each) starts at the current position p: its
    merged patch (i, j) of frame f sits at (p + f, p + i, p + j), and the text after it resumes at p + max(h, w)
    / merge. `position_ids` restarting at 0 starts a packed document (positions count from 0 again);
    `attention_mask` 0 marks padding, which neither takes nor advances a position. `placeholders` `[B, S]`, when
    given, says which tokens are image placeholders (a completion may sample the placeholder id as text); else
    every `image_token_id` is. Computed on the host: a Python walk over the rows, as the data pipeline does once
    per batch."""
    ids = input_ids.tolist()
    marked = (input_ids == image_token_id if placeholders is None else placeholders).tolist()
    starts = (position_ids == 0).tolist() if position_ids is not None else None
    real = attention_mask.bool().tolist() if attention_mask is not None else None
    grids = iter(grid_thw.tolist())
    out = torch.zeros(3, *input_ids.shape, dtype=torch.long)
    for b, row in enumerate(ids):
        current, i = 0, 0
        while i < len(row):
            if real is not None and not real[b][i]:
                i += 1
                continue
            if starts is not None and starts[b][i]:
                current = 0
            if not marked[b][i]:
                out[:, b, i] = current
                current, i = current + 1, i + 1
                continue
            t, h, w = next(grids, (0, 0, 0))
            h, w = h // spatial_merge_size, w // spatial_merge_size
            span = t * h * w
            if span == 0 or row[i : i + span] != [image_token_id] * span or not all(marked[b][i : i + span]):
                raise ValueError(
                    f"row {b}: the image placeholder at token {i} does not match the next image's grid {t}x{h}x{w}"
                    " (one placeholder token per merged patch)"
                )
            grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"))
            out[:, b, i : i + span] = grid.reshape(3, -1) + current
            current, i = current + max(h, w), i + span
    if next(grids, None) is not None:
        raise ValueError(f"{len(grid_thw)} images but fewer placeholder spans in the batch")
    return out.to(input_ids.device)
