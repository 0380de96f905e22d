"""The one MoE runtime: fp32 top-k routing, stacked expert weights, optional shared experts, and interchangeable
compute backends.

Routing (`route`) is softmax over all experts (Qwen3-MoE) or DeepSeek-V3's: per-expert sigmoid scores, chosen
with a correction bias added and only among the best expert groups, weighted by the unbiased scores.

Expert weights are stacked `[num_experts, ...]` (SwiGLU experts: `gate_up_proj` `[E, 2 * I, H]`, gate rows first;
Nemotron-H's ungated squared-ReLU experts: `up_proj` `[E, I, H]`; both: `down_proj` `[E, H, I]`), the layout every
MoE family is converted to at load time. A backend is a function `(x [T, H], weights [T, k], experts [T, k], w1,
down, activation, low_rank) -> [T, H]` (w1 the first projection, `activation` an `EXPERT_ACTIVATIONS` name,
`low_rank` the per-expert LoRA terms of adapted experts or None); `MOE_BACKENDS` maps names to them so a Triton
kernel is one more entry.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelArgs
from ..hf_layout import Fused, HFLayout, WeightMap, nest, plain
from ..runtime import ModelRuntime
from .mlp import ACTIVATIONS, MLP, GatedMLP, swiglu
from .precision import autocast_dtype

logger = logging.getLogger(__name__)


Pair = tuple[torch.Tensor, torch.Tensor]
"""A LoRA pair (a, b) of stacked experts: a `[E, r, in]`, b `[E, out, r]`."""


@dataclass(frozen=True)
class LowRank:
    """LoRA on routed experts (`tandem.models.lora.LoraExperts`): with `first = (a, b)`, expert e's first projection
    adds `scale * (h @ a[e].T) @ b[e].T` to `h @ w1[e].T`; `second` does the same for `down`. Each `a` is
    `[E, r, in]`, each `b` `[E, out, r]`; `scale` is a float, or a `[T, 1]` tensor with one value per token of the
    MoE's input (serving base and adapter side by side: 0 for the base model's tokens)."""

    first: Pair
    second: Pair
    scale: float | torch.Tensor

    def to(self, dtype: torch.dtype) -> LowRank:
        first, second = (tuple(t.to(dtype) for t in pair) for pair in (self.first, self.second))
        scale = self.scale.to(dtype) if isinstance(self.scale, torch.Tensor) else self.scale
        return LowRank(first, second, scale)  # type: ignore[arg-type]

    def of_rows(self, token: torch.Tensor) -> float | torch.Tensor:
        """The scale of the rows that hold tokens `token`."""
        return self.scale[token] if isinstance(self.scale, torch.Tensor) else self.scale


def _unpack(low_rank: LowRank | None, dtype: torch.dtype) -> tuple[LowRank | None, Pair | None, Pair | None]:
    """`low_rank` in the experts' compute dtype and its (first, second) pairs; all None without LoRA."""
    if low_rank is None:
        return None, None, None
    low_rank = low_rank.to(dtype)
    return low_rank, low_rank.first, low_rank.second


MoEBackend = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, str, LowRank | None], torch.Tensor
]
EXPERT_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"swiglu": swiglu, **ACTIVATIONS}
"""What an expert applies to its first projection's output: `swiglu` (gate and up fused, `[.., 2I] -> [.., I]`) or
an ungated MLP activation (`relu2`, Nemotron-H)."""


def route(
    logits: torch.Tensor,
    top_k: int,
    norm_topk_prob: bool,
    balanced: bool = False,
    *,
    scoring: str = "softmax",
    correction_bias: torch.Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Score experts in fp32 (softmax or sigmoid), pick top-k, optionally renormalise and scale; the weights are
    cast back to the logits dtype (as HF does).

    The choice uses `scores + correction_bias` (DeepSeek-V3's load-balancing offset) restricted to the
    `topk_group` best of `n_group` expert groups, a group scored by the sum of its two best biased scores; the
    weights are the unbiased scores of the chosen experts. `balanced` (benchmarks only) replaces the choice by
    a round-robin one, so every expert gets the same number of tokens, like torchtitan's
    `debug.moe_force_load_balance`: throughput then does not depend on how a random router splits the batch.
    """
    scores = logits.float().sigmoid() if scoring == "sigmoid" else logits.softmax(dim=-1, dtype=torch.float32)
    if balanced:
        slots = torch.arange(scores.shape[0] * top_k, device=scores.device).view(-1, top_k)
        experts = slots % scores.shape[-1]
    else:
        choice = scores if correction_bias is None else scores + correction_bias.float()
        experts = _top_experts(choice, top_k, n_group, topk_group)
    weights = scores.gather(-1, experts)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return (weights * scaling_factor).to(logits.dtype), experts


def _top_experts(choice: torch.Tensor, top_k: int, n_group: int, topk_group: int) -> torch.Tensor:
    """The top-k experts `[T, k]` by `choice` `[T, E]`, among the `topk_group` groups with the best top-2 sums."""
    if n_group > 1:
        groups = choice.unflatten(-1, (n_group, -1))  # [T, G, E / G]
        best = groups.topk(2, dim=-1).values.sum(dim=-1).topk(topk_group, dim=-1).indices
        keep = torch.zeros(groups.shape[:2], dtype=torch.bool, device=choice.device).scatter_(1, best, True)
        choice = groups.masked_fill(~keep[..., None], float("-inf")).flatten(1)
    return choice.topk(top_k, dim=-1).indices


def experts_loop(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    w1: torch.Tensor,
    down: torch.Tensor,
    activation: str = "swiglu",
    low_rank: LowRank | None = None,
) -> torch.Tensor:
    """Reference: for each expert, gather its tokens, run its MLP, scatter-add weighted outputs (like HF).

    Token selection has data-dependent shapes, so this backend does not compile with `fullgraph=True`.
    """
    x, weights, w1, down = _in_autocast_dtype(x, weights, w1, down)
    low_rank, first, second = _unpack(low_rank, x.dtype)
    act = EXPERT_ACTIVATIONS[activation]
    out = torch.zeros_like(x)
    for e in range(w1.shape[0]):
        token, slot = torch.where(experts == e)
        scale = 0.0 if low_rank is None else low_rank.of_rows(token)
        hidden = act(_expert_linear(x[token], w1, e, first, scale))
        y = _expert_linear(hidden, down, e, second, scale)
        out.index_add_(0, token, y * weights[token, slot, None])
    return out


def _expert_linear(
    rows: torch.Tensor,
    w: torch.Tensor,
    expert: int,
    pair: Pair | None,
    scale: float | torch.Tensor,
) -> torch.Tensor:
    """`rows @ w[expert].T`, plus the expert's LoRA term `scale * (rows @ a[expert].T) @ b[expert].T` if `pair`."""
    y = F.linear(rows, w[expert])
    return y if pair is None else y + F.linear(F.linear(rows, pair[0][expert]), pair[1][expert]) * scale


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
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    w1: torch.Tensor,
    down: torch.Tensor,
    activation: str = "swiglu",
    low_rank: LowRank | None = None,
) -> torch.Tensor:
    """Sort (token, expert) pairs by expert, run two grouped GEMMs (each with two thin ones more for LoRA), scatter
    back. Shapes are static."""
    x, weights, w1, down = _in_autocast_dtype(x, weights, w1, down)
    low_rank, first, second = _unpack(low_rank, x.dtype)
    num_experts, k = w1.shape[0], experts.shape[1]
    flat = experts.reshape(-1)
    order = flat.argsort(stable=True)
    token = order // k
    counts = torch.zeros(num_experts, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    offs = counts.cumsum(0).to(torch.int32)

    def project(rows: torch.Tensor, w: torch.Tensor, pair: Pair | None) -> torch.Tensor:
        y = grouped_mm(rows, w.transpose(1, 2), offs)
        if low_rank is None or pair is None:
            return y
        thin = grouped_mm(grouped_mm(rows, pair[0].transpose(1, 2), offs), pair[1].transpose(1, 2), offs)
        return y + thin * low_rank.of_rows(token)

    hidden = EXPERT_ACTIVATIONS[activation](project(x[token], w1, first))
    y = project(hidden, down, second)
    y = y * weights.reshape(-1)[order, None]
    return torch.zeros_like(x).index_add_(0, token, y)


MOE_BACKENDS: dict[str, MoEBackend] = {"loop": experts_loop, "grouped_mm": experts_grouped_mm}


class Experts(nn.Module):
    """The stacked expert weights (plain Parameters, so FSDP shards them along the expert dimension): SwiGLU experts
    hold `gate_up_proj`, ungated ones (`activation` relu2) `up_proj`."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, activation: str = "swiglu") -> None:
        super().__init__()
        if activation not in EXPERT_ACTIVATIONS:
            raise ValueError(f"unknown expert activation {activation!r}; known: {sorted(EXPERT_ACTIVATIONS)}")
        self.activation = activation
        rows = 2 * intermediate_size if activation == "swiglu" else intermediate_size
        w1 = nn.Parameter(torch.empty(num_experts, rows, hidden_size))
        self.register_parameter("gate_up_proj" if activation == "swiglu" else "up_proj", w1)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    @property
    def w1(self) -> nn.Parameter:
        """The first projection: `gate_up_proj` or `up_proj`."""
        return getattr(self, self.projections[0])

    @property
    def projections(self) -> tuple[str, str]:
        """The stacked parameters' names, first projection first."""
        return ("gate_up_proj" if self.activation == "swiglu" else "up_proj", "down_proj")

    def low_rank(self, tokens: int) -> LowRank | None:
        """The LoRA terms of adapted experts for a forward of `tokens` tokens (`LoraExperts`); None here."""
        return None


class Router(nn.Module):
    """The routing weight `[E, H]` (HF `mlp.gate.weight`), DeepSeek-V3's `e_score_correction_bias` `[E]` if the
    family has one, and how `route` uses them. The bias is set by the load-balancing rule of pre-training, not by
    gradients: a Parameter (so it loads, saves and syncs like the weights) that never requires grad."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        *,
        scoring: str = "softmax",
        score_correction_bias: bool = False,
        n_group: int = 1,
        topk_group: int = 1,
        scaling_factor: float = 1.0,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False) if score_correction_bias else None
        self.e_score_correction_bias = bias
        self.top_k, self.norm_topk_prob, self.scoring = top_k, norm_topk_prob, scoring
        self.n_group, self.topk_group, self.scaling_factor = n_group, topk_group, scaling_factor

    def forward(
        self, x: torch.Tensor, frozen: bool = False, balanced: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Weights and expert ids `[T, k]` for tokens `[T, H]`; `frozen` detaches the weight (no gradient).

        Sigmoid routers compute their logits in fp32 (HF keeps `gate.weight` in fp32 for them).
        """
        weight = self.weight.detach() if frozen else self.weight
        logits = F.linear(x.float(), weight.float()) if self.scoring == "sigmoid" else F.linear(x, weight)
        weights, experts = route(
            logits,
            self.top_k,
            self.norm_topk_prob,
            balanced,
            scoring=self.scoring,
            correction_bias=self.e_score_correction_bias,
            n_group=self.n_group,
            topk_group=self.topk_group,
            scaling_factor=self.scaling_factor,
        )
        return weights.to(x.dtype), experts

    def extra_repr(self) -> str:
        return (
            f"top_k={self.top_k}, scoring={self.scoring!r}, groups={self.topk_group}/{self.n_group}, "
            f"scaling_factor={self.scaling_factor}"
        )


def record_routing(model: nn.Module, buffer: torch.Tensor) -> None:
    """Make every MoE layer of `model`, in layer order, write each forward's chosen experts into its plane of
    `buffer` `[moe_layers, rows, k]` (rows: at least any forward's tokens); CUDA graphs write it at its address."""
    layers = [module for module in model.modules() if isinstance(module, MoE)]
    if len(layers) != buffer.shape[0]:
        raise ValueError(f"a routing buffer of {buffer.shape[0]} planes for {len(layers)} MoE layers")
    for plane, module in zip(buffer, layers, strict=True):
        module.routing_record = plane


class MoE(nn.Module):
    """Router + experts (+ shared experts: a dense MLP every token goes through, added to the routed output, SwiGLU
    or, with ungated experts, of their activation;
    with `shared_expert_gate` (Qwen3-Next) scaled per token by `sigmoid(shared_expert_gate(x))`, a `[1, H]` weight).

    `freeze_router` detaches the router weight so it never gets a gradient (the correction bias never gets one);
    `balanced_routing` (benchmarks) gives every expert the same number of tokens (see `route`). Routing options
    past `norm_topk_prob` are `Router`'s.
    """

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
        *,
        shared_intermediate_size: int = 0,
        shared_activation: str = "torch",
        shared_expert_gate: bool = False,
        expert_activation: str = "swiglu",
        **routing: Any,
    ) -> None:
        super().__init__()
        if backend not in MOE_BACKENDS:
            raise ValueError(f"unknown MoE backend {backend!r}; known: {sorted(MOE_BACKENDS)}")
        self.router = Router(hidden_size, num_experts, top_k, norm_topk_prob, **routing)
        self.experts = Experts(num_experts, hidden_size, intermediate_size, expert_activation)
        self.shared_experts: nn.Module | None = None
        if shared_intermediate_size and expert_activation == "swiglu":
            self.shared_experts = GatedMLP(hidden_size, shared_intermediate_size, activation=shared_activation)
        elif shared_intermediate_size:  # ungated experts come with an ungated shared expert (Nemotron-H)
            self.shared_experts = MLP(hidden_size, shared_intermediate_size, activation=expert_activation)
        gated = shared_intermediate_size and shared_expert_gate
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if gated else None
        self.backend, self.freeze_router, self.balanced_routing = backend, freeze_router, balanced_routing
        self.routing_record: torch.Tensor | None = None
        """Set by `record_routing`: a `[rows, k]` buffer each forward writes its tokens' chosen experts into."""

    @property
    def top_k(self) -> int:
        return self.router.top_k

    @property
    def norm_topk_prob(self) -> bool:
        return self.router.norm_topk_prob

    def forward(self, x: torch.Tensor, *_: object) -> torch.Tensor:
        """`[..., H]` -> `[..., H]`; as a one-mixer block's mixer (Nemotron-H), the extra arguments are ignored."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, experts = self.router(x, self.freeze_router, self.balanced_routing)
        if self.routing_record is not None:
            self.routing_record[: experts.shape[0]].copy_(experts)
        out = self.run_experts(x, weights, experts)
        if self.shared_experts is not None:
            shared = self.shared_experts(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out.reshape(shape)

    @staticmethod
    def mixer(args: ModelArgs, layer_idx: int, runtime: ModelRuntime) -> MoE:
        """The MoE of `args.moe` at layer `layer_idx`, with the run's backend and router choices."""
        moe = args.moe
        assert moe is not None
        return MoE(
            args.hidden_size,
            moe.intermediate_size,
            moe.num_experts,
            moe.top_k,
            moe.norm_topk_prob,
            backend=runtime.moe_backend_for(layer_idx),
            freeze_router=runtime.freeze_router,
            balanced_routing=runtime.moe_balanced_routing,
            shared_intermediate_size=moe.shared_intermediate_size,
            shared_activation=runtime.swiglu_backend,
            shared_expert_gate=moe.shared_expert_gate,
            expert_activation=moe.expert_activation,
            scoring=moe.scoring,
            score_correction_bias=moe.score_correction_bias,
            n_group=moe.n_group,
            topk_group=moe.topk_group,
            scaling_factor=moe.routed_scaling_factor,
        )

    @staticmethod
    def hf_weights(args: ModelArgs, layout: HFLayout) -> WeightMap:
        """Router (+ correction bias) from HF's `gate`, the experts stacked from per-expert tensors (or read
        stacked, `layout.stacked_experts`), the shared expert and its gate; names from `layout`."""
        moe = args.moe
        assert moe is not None
        out = {"router.weight": plain(layout.router)}
        if moe.score_correction_bias:
            out["router.e_score_correction_bias"] = plain(layout.router_bias)
        if moe.shared_intermediate_size:
            gated = moe.expert_activation == "swiglu"  # else ungated, as its experts
            shared = GatedMLP.hf_weights(moe.shared_intermediate_size, False) if gated else MLP.hf_weights(False)
            out |= nest("shared_experts.", shared, layout.shared_experts)
        if moe.shared_intermediate_size and moe.shared_expert_gate:
            out["shared_expert_gate.weight"] = plain(layout.shared_expert_gate)
        gate, up, down = (layout.expert.replace("{proj}", proj) for proj in layout.expert_projs)
        experts = range(moe.num_experts)
        stacked_down = Fused(tuple((down.format(expert=e),) for e in experts), stacked=True)
        if moe.expert_activation != "swiglu":  # ungated experts (Nemotron-H), stored one by one
            out["experts.up_proj"] = Fused(tuple((up.format(expert=e),) for e in experts), stacked=True)
            return out | {"experts.down_proj": stacked_down}
        if layout.stacked_experts:
            return out | {
                "experts.gate_up_proj": plain(layout.stacked_gate_up),
                "experts.down_proj": plain(layout.stacked_down),
            }
        size = moe.intermediate_size
        pairs = tuple((gate.format(expert=e), up.format(expert=e)) for e in experts)
        out["experts.gate_up_proj"] = Fused(pairs, (size, size), stacked=True)
        return out | {"experts.down_proj": stacked_down}

    def run_experts(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """`[T, H]`: each token's chosen experts, weighted and summed (expert parallelism overrides this)."""
        stacked = self.experts
        low_rank = stacked.low_rank(x.shape[0])
        return MOE_BACKENDS[self.backend](
            x, weights, experts, stacked.w1, stacked.down_proj, stacked.activation, low_rank
        )

    def extra_repr(self) -> str:
        return f"backend={self.backend!r}, freeze_router={self.freeze_router}, balanced_routing={self.balanced_routing}"
