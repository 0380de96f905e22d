"""Qwen2.5-VL's vision encoder (transformers' `Qwen2_5_VisionTransformerPretrainedModel`), with HF's parameter names
under `model.visual.`.

Input. As for Qwen3-VL (`layers.vision`): each image (or video) arrives as `t x h x w` patch rows of
`in_channels * temporal_patch_size * patch_size^2` values, per image, per frame, and within a frame in merge-block
order (the `m x m` blocks, `m = spatial_merge_size`, in raster order, the `m^2` patches of a block in raster
order), so every `m^2` consecutive rows are one block, which the merger folds into one LLM token.

Embedding. `patch_embed.proj` is a Conv3d without bias whose kernel equals its stride and covers the whole patch:
one matmul per patch, applied as `F.linear` on the flattened weight. There is no absolute position table:
positions enter only through a 2D axial RoPE on q and k, the same as Qwen3-VL's (`vision.axial_rope`): with head
dim `D`, the rotation pairs `(i, i + D/2)` take the frequencies `theta^(-4j/D)`, `j < D/4`, the first `D/4` pairs
turned by the patch's row, the last `D/4` by its column.

Blocks (pre-norm, RMSNorm eps 1e-6): `x += proj(attn(norm1(x)))`, `x += down(act(gate(y)) * up(y))` with
`y = norm2(x)` (a gated MLP with biases; `act` is SiLU in released checkpoints).

Window attention. Attention is bidirectional; which rows a patch sees depends on the layer. The layers named in
`fullatt_block_indexes` (7, 15, 23, 31 of 32 in the released checkpoints) attend within the whole frame, as every
Qwen3-VL layer does. All others attend within windows, so that their cost grows with the frame's area rather than
its square; the few full layers carry information between windows. A frame's `h/m x w/m` grid of merge blocks is
tiled from its top-left corner by squares of `n x n` blocks, `n = window_size // spatial_merge_size // patch_size`
(112 // 2 // 14 = 4 blocks, i.e. 8 patches or 112 pixels a side). Where the grid is not a multiple of `n`, the
tiles at the bottom and right edges are cut short (`n x r`, `r' x n`, `r' x r`), never padded. Windows hold whole
merge blocks, so a block's `m^2` patches stay together and consecutive.

Row order. To make every window a run of consecutive rows, the encoder reorders the rows once, right after the
patch embedding, by whole merge blocks (`window_layout`): within each frame, one window after another, the blocks of
a window in raster order. Each patch's RoPE angles come from its own (row, column), so they move with it. Every
layer then runs in this order: a windowed layer attends within runs of consecutive rows, and a full layer within
each frame, which is still consecutive because blocks only move inside their own frame, and attention over a set of
rows does not depend on their order (positions live in the RoPE angles, not in the row index). Norms and MLPs act
row by row. After the merger, one row per block, the merged rows are put back in arrival order (the inverse
permutation), so they line up with the image placeholders in the prompt.

transformers orders a frame's windows in raster order; here they are ordered largest first (raster among equals),
so equally sized windows are consecutive and one batched SDPA call covers each size, at most four per frame (full,
right edge, bottom edge, corner), where raster order breaks every row of windows at its ragged end. Any order of a
frame's windows gives the same output, since the order is undone at the end.

Merger. `merger` RMSNorms each patch (`ln_q`), folds each block's `m^2` patches into one row (`hidden * m^2`) and maps
it by `mlp.2(gelu(mlp.0(.)))` (exact GELU) to `out_hidden_size`: the image tokens. Qwen2.5-VL has no DeepStack, so
`forward` returns an empty list of DeepStack features, with the signature of `Qwen3VisionEncoder.forward`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .norm import RMSNorm
from .vision import (
    NORM_EPS,
    VISION_ACTIVATIONS,
    PatchEmbed,
    TowerArgs,
    VisionBlock,
    axial_rope,
    frame_runs,
    patch_coordinates,
)

QWEN2_5_VISION_DEFAULTS = {
    "depth": 32, "hidden_size": 3584, "intermediate_size": 3420, "num_heads": 16, "in_channels": 3,
    "patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 3584,
    "hidden_act": "silu",
}  # fmt: skip
"""`Qwen2_5_VLVisionConfig`'s defaults for the shared fields."""


@dataclass(frozen=True, kw_only=True)
class Qwen2_5VisionArgs(TowerArgs):
    """Qwen2.5-VL's tower: window attention except at `fullatt_block_indexes`; `from_hf` reads a HF
    `vision_config`."""

    window_size: int
    fullatt_block_indexes: tuple[int, ...]

    @property
    def window_blocks(self) -> int:
        """Merge blocks per side of a window (module docstring)."""
        return self.window_size // self.spatial_merge_size // self.patch_size

    @classmethod
    def from_hf(cls, vision_config: Mapping[str, Any]) -> Qwen2_5VisionArgs:
        """Absent keys take `Qwen2_5_VLVisionConfig`'s defaults; unsupported values raise a ValueError naming the
        key."""
        args = cls(
            **cls.hf_fields(vision_config, QWEN2_5_VISION_DEFAULTS),
            window_size=vision_config.get("window_size", 112),
            fullatt_block_indexes=tuple(vision_config.get("fullatt_block_indexes", (7, 15, 23, 31))),
        )
        args.validate()
        return args

    def validate(self) -> None:
        super().validate()
        if self.window_blocks < 1:
            raise ValueError(
                f"vision window_size {self.window_size} must span at least one merge block "
                f"(spatial_merge_size * patch_size = {self.spatial_merge_size * self.patch_size} pixels)"
            )


def window_layout(
    grid_thw: torch.Tensor, spatial_merge_size: int, window_blocks: int
) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """The order in which the encoder holds the merge blocks, `[num_blocks]` indexes into their arrival order, and
    the windows in that order as runs `(windows, patches per window)` of consecutive, equally long windows (module
    docstring)."""
    m, device = spatial_merge_size, grid_thw.device
    order, windows, offset = [], [], 0
    for t, h, w in grid_thw.tolist():
        per_row = -(-(w // m) // window_blocks)
        rows = torch.arange(h // m, device=device) // window_blocks
        cols = torch.arange(w // m, device=device) // window_blocks
        window = (rows[:, None] * per_row + cols).flatten()  # each block's window, blocks in raster order
        sizes = torch.bincount(window)
        # Sort key: larger windows first, then window number; the stable sort keeps raster order inside a window.
        frame = torch.argsort((sizes.max() - sizes[window]) * len(sizes) + window, stable=True)
        order.append((frame + offset + len(window) * torch.arange(t, device=device)[:, None]).flatten())
        offset += t * len(window)
        windows += sizes.sort(descending=True).values.tolist() * t
    runs: list[tuple[int, int]] = []
    for size in windows:
        if runs and runs[-1][1] == size * m * m:
            runs[-1] = (runs[-1][0] + 1, size * m * m)
        else:
            runs.append((1, size * m * m))
    return torch.cat(order), runs


class GatedVisionMLP(nn.Module):
    def __init__(self, args: Qwen2_5VisionArgs) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size)
        self.activation = VISION_ACTIVATIONS[args.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activation(self.gate_proj(x)) * self.up_proj(x))


class PatchMerger(nn.Module):
    """Each merge block's `m^2` patches -> one `out_hidden_size` row: RMSNorm per patch, fold, MLP."""

    def __init__(self, args: Qwen2_5VisionArgs) -> None:
        super().__init__()
        self.merged_size = args.hidden_size * args.spatial_merge_size**2
        self.ln_q = RMSNorm(args.hidden_size, eps=NORM_EPS)
        self.mlp = nn.Sequential(
            nn.Linear(self.merged_size, self.merged_size), nn.GELU(), nn.Linear(self.merged_size, args.out_hidden_size)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`[N, hidden]` -> `[N / m^2, out_hidden_size]`."""
        return self.mlp(self.ln_q(x).reshape(-1, self.merged_size))


class Qwen2_5VisionEncoder(nn.Module):
    """Patches of any number of images -> their LLM tokens, and no DeepStack features (module docstring)."""

    def __init__(self, args: Qwen2_5VisionArgs) -> None:
        super().__init__()
        args.validate()
        self.args = args
        self.patch_embed = PatchEmbed(args, bias=False)
        self.blocks = nn.ModuleList(VisionBlock(args, RMSNorm, GatedVisionMLP(args)) for _ in range(args.depth))
        self.merger = PatchMerger(args)

    def reset_parameters(self, std: float, generator: torch.Generator | None = None) -> None:
        """transformers' init: Linear and Conv3d weights normal(0, std), biases zero, RMSNorms ones."""
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, nn.Linear | nn.Conv3d):
                    module.weight.normal_(0.0, std, generator=generator)
                    if module.bias is not None:
                        module.bias.zero_()
                if isinstance(module, RMSNorm):
                    module.reset_parameters()

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`pixel_values` `[N, patch_dim]` for `grid_thw` `[images, 3]` (t, h, w in patches) -> the image tokens
        `[N / m^2, out_hidden_size]` (all images, in order) and an empty list (no DeepStack)."""
        args = self.args
        block = args.spatial_merge_size**2
        coords = patch_coordinates(grid_thw, args.spatial_merge_size)  # first: it refuses grids of partial blocks
        order, window_runs = window_layout(grid_thw, args.spatial_merge_size, args.window_blocks)

        def to_windows(rows: torch.Tensor) -> torch.Tensor:
            return rows.unflatten(0, (-1, block))[order].flatten(0, 1)

        x = to_windows(self.patch_embed(pixel_values))
        cos, sin = axial_rope(to_windows(coords), args.head_dim, args.rope_theta)
        full_runs = frame_runs(grid_thw)
        for i, layer in enumerate(self.blocks):
            x = layer(x, cos, sin, full_runs if i in args.fullatt_block_indexes else window_runs)
        return self.merger(x)[torch.argsort(order)], []
