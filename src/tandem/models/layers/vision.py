"""Qwen3-VL's vision encoder (transformers' `Qwen3VLVisionModel`), with HF's parameter names under `model.visual.`.

Input. The processor cuts each image (or video) into `t x h x w` patches of `temporal_patch_size x patch_size x
patch_size` pixels over `in_channels` channels and flattens each patch to one row of `pixel_values`. Rows arrive
per image, per frame, and within a frame in merge-block order: the `m x m` blocks (`m = spatial_merge_size`) in
raster order, the `m^2` patches of a block in raster order. So every `m^2` consecutive rows are one block, which
the mergers fold into one LLM token (`merged_tokens`); the positions below are computed for that order.

Embedding. A Conv3d whose kernel equals its stride and covers the whole patch is one matmul per patch, so
`patch_embed.proj` is applied as `F.linear` on its flattened weight (no conv kernel, same maths). A learned square
table of `num_position_embeddings = side^2` absolute positions is resampled to each frame's `h x w` grid by
bilinear interpolation with aligned corners (F.interpolate's `align_corners=True`): patch row `r` reads table row
`r (side - 1) / (h - 1)`, likewise columns, as a weighted sum of the four nearest table entries.

Blocks (pre-norm, LayerNorm eps 1e-6): `x += proj(attn(norm1(x)))`, `x += fc2(act(fc1(norm2(x))))`. Attention is
bidirectional within each frame only (HF's `cu_seqlens` make each frame of each image its own segment; an image
is one frame), computed with SDPA batched over runs of equally long frames. q and k get a 2D axial RoPE (in fp32):
with head dim `D`, the `D/2` rotation pairs `(i, i + D/2)` take the frequencies `theta^(-4j/D)`, `j < D/4`, the
first `D/4` pairs turned by the patch's row, the last `D/4` by its column.

Mergers. `merger` norms each patch, folds each block's `m^2` patches into one row (`hidden * m^2`) and maps it by
`fc2(gelu(fc1(.)))` (exact GELU, whatever `hidden_act` is) to `out_hidden_size`: the image tokens. Each layer named
in `deepstack_visual_indexes` feeds its own merger (`deepstack_merger_list`, which folds before the norm); those
features are added to the LLM's hidden states at its first layers (DeepStack).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..config import RopeArgs
from .rope import apply_rope, inv_frequencies

NORM_EPS = 1e-6

VISION_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "gelu": F.gelu,
    "silu": F.silu,
}
"""The blocks' MLP activations, by HF `hidden_act` name."""


@dataclass(frozen=True, kw_only=True)
class TowerArgs:
    """What the Qwen-VL vision towers' shapes share; each tower's args add their own fields."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    hidden_act: str
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values per row of `pixel_values`."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @staticmethod
    def hf_fields(vision_config: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
        """The shared fields of a HF `vision_config`, `defaults` (the family's config class's) for absent keys;
        a ValueError for a RoPE other than axial."""
        rope = vision_config.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"vision rope_parameters.rope_type {rope['rope_type']!r} unsupported; only 'axial'")
        fields = {key: vision_config.get(key, default) for key, default in defaults.items()}
        fields["rope_theta"] = float(rope.get("rope_theta", vision_config.get("rope_theta", 10000.0)))
        return fields

    def validate(self) -> None:
        """A ValueError naming the first field whose value the encoder cannot run."""
        if self.hidden_act not in VISION_ACTIVATIONS:
            raise ValueError(f"vision hidden_act {self.hidden_act!r} unsupported; known: {sorted(VISION_ACTIVATIONS)}")
        for key in ("patch_size", "temporal_patch_size", "spatial_merge_size"):
            if not isinstance(getattr(self, key), int):
                raise ValueError(f"vision {key} {getattr(self, key)!r} unsupported; only a single int")
        if self.hidden_size % self.num_heads or self.head_dim % 4:
            raise ValueError(
                f"vision num_heads {self.num_heads} must split hidden_size {self.hidden_size} into heads whose "
                "size is a multiple of 4 (axial RoPE)"
            )


QWEN3_VISION_DEFAULTS = {
    "depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "in_channels": 3,
    "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 3584,
    "hidden_act": "gelu_pytorch_tanh",
}  # fmt: skip
"""`Qwen3VLVisionConfig`'s defaults for the shared fields."""


@dataclass(frozen=True, kw_only=True)
class VisionArgs(TowerArgs):
    """Qwen3-VL's tower: a learned position table and DeepStack mergers; `from_hf` reads a HF `vision_config`."""

    num_position_embeddings: int
    deepstack_visual_indexes: tuple[int, ...]

    @classmethod
    def from_hf(cls, vision_config: Mapping[str, Any]) -> VisionArgs:
        """Absent keys take `Qwen3VLVisionConfig`'s defaults; unsupported values raise a ValueError naming the key."""
        args = cls(
            **cls.hf_fields(vision_config, QWEN3_VISION_DEFAULTS),
            num_position_embeddings=vision_config.get("num_position_embeddings", 2304),
            deepstack_visual_indexes=tuple(vision_config.get("deepstack_visual_indexes", (8, 16, 24))),
        )
        args.validate()
        return args

    def validate(self) -> None:
        super().validate()
        indexes = self.deepstack_visual_indexes
        if len(set(indexes)) != len(indexes) or any(not 0 <= i < self.depth for i in indexes):
            raise ValueError(f"vision deepstack_visual_indexes {indexes} must be distinct layers below depth")


def merged_tokens(grid_thw: torch.Tensor, spatial_merge_size: int) -> torch.Tensor:
    """LLM tokens per image `[num_images]`: `t * h * w / spatial_merge_size^2`."""
    return grid_thw.prod(dim=-1) // spatial_merge_size**2


def patch_coordinates(grid_thw: torch.Tensor, spatial_merge_size: int) -> torch.Tensor:
    """(row, column) `[num_patches, 2]` of every patch in the order the rows arrive (module docstring)."""
    m, coords = spatial_merge_size, []
    for t, h, w in grid_thw.tolist():
        if h % m or w % m:
            raise ValueError(f"image grid {h}x{w} is not a whole number of {m}x{m} merge blocks")
        rows, cols = torch.meshgrid(
            torch.arange(h, device=grid_thw.device), torch.arange(w, device=grid_thw.device), indexing="ij"
        )
        grid = torch.stack((rows, cols), dim=-1).reshape(h // m, m, w // m, m, 2).transpose(1, 2)
        coords.append(grid.reshape(-1, 2).repeat(t, 1))
    return torch.cat(coords)


def interpolation_taps(coords: torch.Tensor, sizes: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear, corner-aligned resampling of a `side x side` table at patch `coords` `[N, 2]` of frames `sizes`
    `[N, 2]` (h, w): the four table rows `[N, 4]` each patch reads and their weights `[N, 4]` (fp32)."""
    src = coords.float() * (side - 1) / (sizes - 1).clamp(min=1)  # [N, 2] fractional table row, column
    low = src.floor()
    offsets = torch.arange(2, device=coords.device)
    taps = (low.long()[..., None] + offsets).clamp(0, side - 1)  # [N, axis, 2]
    weights = 1 - (src[..., None] - low[..., None] - offsets).abs()
    indices = taps[:, 0, :, None] * side + taps[:, 1, None, :]
    return indices.flatten(1), (weights[:, 0, :, None] * weights[:, 1, None, :]).flatten(1)


def axial_rope(coords: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin `[N, head_dim]` (fp32) of the 2D axial RoPE for patch `coords` `[N, 2]` (module docstring)."""
    inv_freq = inv_frequencies(RopeArgs(theta=theta), head_dim // 2)[0].to(coords.device)
    angles = (coords[..., None].float() * inv_freq).flatten(1)  # [N, D/2]: row angles, then column angles
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def frame_runs(grid_thw: torch.Tensor) -> list[tuple[int, int]]:
    """The packed frames as runs `(frames, patches per frame)` of consecutive, equally long frames."""
    runs: list[tuple[int, int]] = []
    for t, h, w in grid_thw.tolist():
        if runs and runs[-1][1] == h * w:
            runs[-1] = (runs[-1][0] + t, h * w)
        else:
            runs.append((t, h * w))
    return runs


def frame_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, runs: list[tuple[int, int]]) -> torch.Tensor:
    """Bidirectional attention within each frame: q, k, v `[N, H, D]` packed as `runs` -> `[N, H, D]`."""
    sizes = [frames * length for frames, length in runs]
    out = []
    for (frames, length), *qkv in zip(runs, q.split(sizes), k.split(sizes), v.split(sizes), strict=True):
        qf, kf, vf = (x.unflatten(0, (frames, length)).transpose(1, 2) for x in qkv)  # [frames, H, length, D]
        out.append(F.scaled_dot_product_attention(qf, kf, vf).transpose(1, 2).flatten(0, 1))
    return torch.cat(out)


class PatchEmbed(nn.Module):
    """One patch row -> `hidden_size`; `proj` keeps HF's Conv3d weight `[hidden, C, T, P, P]` (module docstring),
    with a bias in Qwen3-VL's tower and none in Qwen2.5-VL's."""

    def __init__(self, args: TowerArgs, bias: bool = True) -> None:
        super().__init__()
        kernel = (args.temporal_patch_size, args.patch_size, args.patch_size)
        self.proj = nn.Conv3d(args.in_channels, args.hidden_size, kernel_size=kernel, stride=kernel, bias=bias)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(pixel_values.to(weight.dtype), weight.flatten(1), self.proj.bias)


class VisionAttention(nn.Module):
    """Bidirectional attention over runs of rows (frames, or Qwen2.5-VL's windows), q and k rotated in fp32;
    `qkv` and `proj` with biases, as both Qwen-VL towers store them."""

    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size)
        self.proj = nn.Linear(hidden_size, hidden_size)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, runs: list[tuple[int, int]]
    ) -> torch.Tensor:
        """`x` `[N, hidden]`, cos/sin `[N, head_dim]` -> `[N, hidden]`."""
        q, k, v = self.qkv(x).unflatten(-1, (3, self.num_heads, -1)).unbind(dim=1)
        q_rot, k_rot = apply_rope(q.float(), k.float(), cos, sin)
        out = frame_attention(q_rot.to(q.dtype), k_rot.to(k.dtype), v, runs)
        return self.proj(out.flatten(1))


class VisionMLP(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(args.hidden_size, args.intermediate_size)
        self.linear_fc2 = nn.Linear(args.intermediate_size, args.hidden_size)
        self.activation = VISION_ACTIVATIONS[args.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.activation(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    """Pre-norm attention then MLP, residual each; the towers differ in the norm (Qwen3-VL LayerNorm, Qwen2.5-VL
    RMSNorm) and in the MLP (plain, or gated)."""

    def __init__(self, args: TowerArgs, norm: Callable[..., nn.Module], mlp: nn.Module) -> None:
        super().__init__()
        self.norm1 = norm(args.hidden_size, eps=NORM_EPS)
        self.norm2 = norm(args.hidden_size, eps=NORM_EPS)
        self.attn = VisionAttention(args.hidden_size, args.num_heads)
        self.mlp = mlp

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, runs: list[tuple[int, int]]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, runs)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each merge block's `m^2` patches -> one `out_hidden_size` row; the norm before the fold (`merger`) or after
    it (`postshuffle`, the DeepStack mergers)."""

    def __init__(self, args: VisionArgs, postshuffle: bool) -> None:
        super().__init__()
        self.merged_size = args.hidden_size * args.spatial_merge_size**2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.merged_size if postshuffle else args.hidden_size, eps=NORM_EPS)
        self.linear_fc1 = nn.Linear(self.merged_size, self.merged_size)
        self.linear_fc2 = nn.Linear(self.merged_size, args.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`[N, hidden]` -> `[N / m^2, out_hidden_size]`."""
        if self.postshuffle:
            x = self.norm(x.reshape(-1, self.merged_size))
        else:
            x = self.norm(x).reshape(-1, self.merged_size)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3VisionEncoder(nn.Module):
    """Patches of any number of images -> their LLM tokens and DeepStack features (module docstring)."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        args.validate()
        self.args = args
        self.side = math.isqrt(args.num_position_embeddings)
        self.patch_embed = PatchEmbed(args)
        self.pos_embed = nn.Embedding(args.num_position_embeddings, args.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(args, nn.LayerNorm, VisionMLP(args)) for _ in range(args.depth))
        self.merger = PatchMerger(args, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(args, postshuffle=True) for _ in args.deepstack_visual_indexes
        )

    def reset_parameters(self, std: float, generator: torch.Generator | None = None) -> None:
        """transformers' init: Linear, Conv3d and Embedding weights normal(0, std), biases zero, LayerNorms ones and
        zeros."""
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, nn.Linear | nn.Conv3d | nn.Embedding):
                    module.weight.normal_(0.0, std, generator=generator)
                if isinstance(module, nn.Linear | nn.Conv3d) and module.bias is not None:
                    module.bias.zero_()
                if isinstance(module, nn.LayerNorm):
                    module.weight.fill_(1.0)
                    module.bias.zero_()

    def _positions(self, coords: torch.Tensor, grid_thw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The resampled absolute position embedding `[N, hidden]` of the patches at `coords`."""
        sizes = grid_thw[:, 1:].repeat_interleave(grid_thw.prod(dim=-1), dim=0)
        indices, weights = interpolation_taps(coords, sizes, self.side)
        return (self.pos_embed(indices) * weights[..., None]).sum(dim=1).to(dtype)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`pixel_values` `[N, patch_dim]` for `grid_thw` `[images, 3]` (t, h, w in patches) -> the image tokens
        `[N / m^2, out_hidden_size]` (all images, in order) and one such tensor per DeepStack layer, in layer
        order."""
        args = self.args
        coords = patch_coordinates(grid_thw, args.spatial_merge_size)
        x = self.patch_embed(pixel_values)
        x = x + self._positions(coords, grid_thw, x.dtype)
        cos, sin = axial_rope(coords, args.head_dim, args.rope_theta)
        runs = frame_runs(grid_thw)
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, runs)
            if i in args.deepstack_visual_indexes:
                deepstack.append(self.deepstack_merger_list[args.deepstack_visual_indexes.index(i)](x))
        return self.merger(x), deepstack
