"""The one MoE runtime: fp32 softmax top-k routing, stacked expert weights, and interchangeable compute backends.

Expert weights are stacked `[num_experts, ...]` (`gate_up_proj`: `[E, 2 * I, H]`, gate rows first;
`down_proj`: `[E, H, I]`), the layout every MoE family is converted to at load time. A backend is a function
`(x [T, H], weights [T, k], experts [T, k], gate_up, down) -> [T, H]`; `MOE_BACKENDS` maps names to them so a
Triton kernel is one more entry.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .precision import autocast_dtype

logger = logging.getLogger(__name__)

MoEBackend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def route(
    logits: torch.Tensor, top_k: int, norm_topk_prob: bool, balanced: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax in fp32, top-k, optional renormalisation; weights are cast back to the logits dtype (as HF does).

    `balanced` (benchmarks only) replaces the top-k choice by a round-robin one, so every expert gets the same
    number of tokens, like torchtitan's `debug.moe_force_load_balance`: throughput then does not depend on how
    a random router happens to split the batch.
    """
    probs = logits.softmax(dim=-1, dtype=torch.float32)
    if balanced:
        slots = torch.arange(probs.shape[0] * top_k, device=probs.device).view(-1, top_k)
        experts = slots % probs.shape[-1]
        weights = probs.gather(-1, experts)
    else:
        weights, experts = probs.topk(top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts


def _expert_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


def experts_loop(
    x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """Reference: for each expert, gather its tokens, run its MLP, scatter-add weighted outputs (like HF).

    Token selection has data-dependent shapes, so this backend does not compile with `fullgraph=True`.
    """
    x, weights, gate_up, down = _in_autocast_dtype(x, weights, gate_up, down)
    out = torch.zeros_like(x)
    for e in range(gate_up.shape[0]):
        token, slot = torch.where(experts == e)
        y = _expert_mlp(x[token], gate_up[e], down[e])
        out.index_add_(0, token, y * weights[token, slot, None])
    return out


def _in_autocast_dtype(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors in autocast's dtype when it is on: it casts neither `torch._grouped_mm` nor `index_add_`."""
    dtype = autocast_dtype(tensors[0].device.type)
    return tensors if dtype is None else tuple(t.to(dtype) for t in tensors)


def _grouped_mm_unsupported(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """Why `torch._grouped_mm(a, b)` cannot run here, or None if it can."""
    if not hasattr(torch, "_grouped_mm"):
        return "this torch build has no torch._grouped_mm"
    if torch.compiler.is_compiling() and a.dtype != torch.bfloat16:
        return f"torch.compile traces torch._grouped_mm only in bfloat16, got {a.dtype}"
    if a.device.type == "cuda":
        if a.dtype != torch.bfloat16:
            return f"torch._grouped_mm on CUDA needs bfloat16, got {a.dtype}"
        if torch.cuda.get_device_capability(a.device) < (9, 0):
            return "torch._grouped_mm on CUDA needs compute capability 9.0 or newer"
    elif a.device.type != "cpu":
        return f"torch._grouped_mm is not available on {a.device.type}"
    row_bytes = (a.shape[-1] * a.element_size(), b.shape[-1] * b.element_size())
    if any(n % 16 for n in row_bytes):
        return f"torch._grouped_mm needs rows that are multiples of 16 bytes, got {row_bytes}"
    return None


@functools.cache
def _warn_fallback(reason: str) -> None:
    logger.warning("MoE grouped_mm falls back to a per-expert loop of matmuls: %s", reason)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """`a[rows of group g] @ b[g]` for row groups ending at `offs`; `torch._grouped_mm` or a loop (logged once)."""
    reason = _grouped_mm_unsupported(a, b)
    if reason is None:
        return torch._grouped_mm(a, b, offs=offs)
    _warn_fallback(reason)
    ends = offs.tolist()
    starts = [0, *ends[:-1]]
    return torch.cat([a[s:e] @ b[g] for g, (s, e) in enumerate(zip(starts, ends, strict=True))])


def experts_grouped_mm(
    x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """Sort (token, expert) pairs by expert, run two grouped GEMMs, scatter back. Shapes are static."""
    x, weights, gate_up, down = _in_autocast_dtype(x, weights, gate_up, down)
    num_experts, k = gate_up.shape[0], experts.shape[1]
    flat = experts.reshape(-1)
    order = flat.argsort(stable=True)
    token = order // k
    counts = torch.zeros(num_experts, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    offs = counts.cumsum(0).to(torch.int32)
    gate, up = grouped_mm(x[token], gate_up.transpose(1, 2), offs).chunk(2, dim=-1)
    y = grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs)
    y = y * weights.reshape(-1)[order, None]
    return torch.zeros_like(x).index_add_(0, token, y)


MOE_BACKENDS: dict[str, MoEBackend] = {"loop": experts_loop, "grouped_mm": experts_grouped_mm}


class Experts(nn.Module):
    """The stacked expert weights (plain Parameters, so FSDP shards them along the expert dimension)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))


class MoE(nn.Module):
    """Router + experts. `freeze_router` detaches the router weight so it never gets a gradient;
    `balanced_routing` (benchmarks) gives every expert the same number of tokens (see `route`)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        backend: str = "grouped_mm",
        freeze_router: bool = False,
        balanced_routing: bool = False,
    ) -> None:
        super().__init__()
        if backend not in MOE_BACKENDS:
            raise ValueError(f"unknown MoE backend {backend!r}; known: {sorted(MOE_BACKENDS)}")
        self.router = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden_size, intermediate_size)
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.backend, self.freeze_router, self.balanced_routing = backend, freeze_router, balanced_routing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        router_weight = self.router.weight.detach() if self.freeze_router else self.router.weight
        weights, experts = route(F.linear(x, router_weight), self.top_k, self.norm_topk_prob, self.balanced_routing)
        return self.run_experts(x, weights, experts).reshape(shape)

    def run_experts(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """`[T, H]`: each token's chosen experts, weighted and summed (expert parallelism overrides this)."""
        return MOE_BACKENDS[self.backend](x, weights, experts, self.experts.gate_up_proj, self.experts.down_proj)

    def extra_repr(self) -> str:
        return (
            f"top_k={self.top_k}, backend={self.backend!r}, freeze_router={self.freeze_router}, "
            f"balanced_routing={self.balanced_routing}"
        )
