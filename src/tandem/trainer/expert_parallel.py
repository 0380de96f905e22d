"""Expert parallelism: each MoE layer's experts split over a group of ranks, tokens sent to them by all-to-all.

With `model.expert_parallel = P`, ranks form groups of P consecutive ranks; rank `g * P + i` holds experts
`[i * E / P, (i + 1) * E / P)` of every MoE layer, whole (FSDP2 leaves them alone: they are `ignored_params`),
and the W / P groups are replicas of each other. A MoE layer routes its own tokens as usual, then

1. exchanges per-expert token counts with the group (one small all-to-all of `E` integers),
2. sends every (token, expert) pair's hidden state to the rank that holds the expert (`all_to_all_single` with
   uneven splits; its backward is the reverse all-to-all),
3. runs its local experts on what it received with the configured MoE backend,
4. sends the outputs back, weighs them by the router weights and sums them per token.

Gradients of the local experts hold the contributions of every token of the group. `reduce_and_clip` adds
them over the replicas and divides by the world size, which is what FSDP's reduce-scatter (a mean over ranks)
does for every other weight, so losses and gradients equal those of one process. The collectives are plain
`torch.distributed` calls (gloo on CPU, NCCL on GPUs) on their own process groups.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from tandem.config import ConfigError
from tandem.models.layers.moe import MOE_BACKENDS, MoE

# Module names that wrappers add and that state-dict keys leave out (activation checkpointing, compile, FSDP1).
_WRAPPER_PARTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


def clean_fqn(name: str) -> str:
    """A parameter's name as `get_model_state_dict` spells it (without wrapper module names)."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


@dataclass(frozen=True)
class ExpertGroups:
    """This rank's place in the expert-parallel layout."""

    group: dist.ProcessGroup
    """The P ranks that split the experts between them (tokens travel inside it)."""
    rank: int
    """Index in `group`: this rank holds experts [rank * E / P, (rank + 1) * E / P)."""
    size: int
    replica_group: dist.ProcessGroup | None
    """The ranks that hold the same experts (None when there is one copy)."""
    replica: int
    """Index in `replica_group`: replica 0 writes the experts to checkpoints."""
    replicas: int
    world_size: int


def make_groups(size: int) -> ExpertGroups:
    """Create the expert-parallel and replica process groups (every rank calls this, in the same order)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % size:
        raise ConfigError(f"model.expert_parallel {size} must divide the trainer's world size {world}")
    replicas = world // size
    group = replica_group = None
    for g in range(replicas):  # new_group is collective: every rank creates every group
        made = dist.new_group(list(range(g * size, (g + 1) * size)))
        if rank // size == g:
            group = made
    if replicas > 1:
        for i in range(size):
            made = dist.new_group(list(range(i, world, size)))
            if rank % size == i:
                replica_group = made
    assert group is not None
    return ExpertGroups(group, rank % size, size, replica_group, rank // size, replicas, world)


class _AllToAll(torch.autograd.Function):
    """`all_to_all_single` of rows with uneven splits; the gradient goes back the way the rows came."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


class ExpertParallelMoE(MoE):
    """A MoE layer that holds only its share of the experts (same parameter names, `[E / P, ...]` shapes)."""

    def __init__(self, moe: MoE, groups: ExpertGroups) -> None:
        num_experts, hidden, intermediate = moe.experts.down_proj.shape
        if num_experts % groups.size:
            raise ConfigError(f"model.expert_parallel {groups.size} must divide the number of experts {num_experts}")
        with torch.device("meta"):
            super().__init__(
                hidden,
                intermediate,
                num_experts,
                moe.top_k,
                moe.norm_topk_prob,
                backend=moe.backend,
                freeze_router=moe.freeze_router,
                balanced_routing=moe.balanced_routing,
                expert_activation=moe.experts.activation,
            )
        self.router, self.shared_experts = moe.router, moe.shared_experts
        self.num_experts, self.groups = num_experts, groups
        self.local_experts = num_experts // groups.size
        mine = slice(groups.rank * self.local_experts, (groups.rank + 1) * self.local_experts)
        for name, full in moe.experts.named_parameters():
            setattr(self.experts, name, nn.Parameter(full.detach()[mine].clone(), requires_grad=full.requires_grad))

    def run_experts(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        size, local = self.groups.size, self.local_experts
        flat = experts.reshape(-1)
        order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert, hence by destination rank
        token = order // experts.shape[1]
        counts = torch.bincount(flat, minlength=self.num_experts)
        received = torch.empty_like(counts)  # [source rank, my expert]: rows each rank sends to each of mine
        dist.all_to_all_single(received, counts, group=self.groups.group)
        send_splits = counts.view(size, local).sum(1).tolist()
        recv_splits = received.view(size, local).sum(1).tolist()
        rows = _AllToAll.apply(x[token], recv_splits, send_splits, self.groups.group)
        expert_of_row = torch.arange(local, device=x.device).repeat(size).repeat_interleave(received)
        w1, down = (p.to(x.dtype) for p in (self.experts.w1, self.experts.down_proj))
        ones = rows.new_ones(rows.shape[0], 1)
        y = MOE_BACKENDS[self.backend](rows, ones, expert_of_row[:, None], w1, down, self.experts.activation)
        back = _AllToAll.apply(y, send_splits, recv_splits, self.groups.group)
        return torch.zeros_like(x).index_add_(0, token, back * weights.reshape(-1)[order, None])

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, experts {self.groups.rank * self.local_experts}+{self.local_experts}"


def apply_expert_parallel(model: nn.Module, size: int) -> None:
    """Replace every MoE layer of `model` (full weights, same on every rank) by its expert-parallel share."""
    moe_layers = [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]
    if not moe_layers:
        raise ConfigError(f"model.expert_parallel = {size} needs a MoE model; this one has no MoE layers")
    groups = make_groups(size)
    for name, moe in moe_layers:
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, ExpertParallelMoE(moe, groups))


def expert_params(model: nn.Module) -> dict[str, tuple[nn.Parameter, ExpertGroups]]:
    """The expert-parallel parameters by state-dict name, with their groups (empty without expert parallelism)."""
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, ExpertParallelMoE):
            for param_name, param in module.experts.named_parameters():
                found[clean_fqn(f"{name}.experts.{param_name}")] = (param, module.groups)
    return found


@dataclass(frozen=True)
class Piece:
    """Where a rank's local tensor sits in the global one, and whether this rank writes it to checkpoints."""

    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    writer: bool


def expert_piece(local: torch.Tensor, groups: ExpertGroups) -> Piece:
    """An expert-parallel tensor (a parameter or an optimizer state of one): rows `[rank * E/P, ...)` of `[E, ...]`."""
    start = groups.rank * local.shape[0]
    global_shape = (local.shape[0] * groups.size, *local.shape[1:])
    return Piece(global_shape, (start, *(0,) * (local.dim() - 1)), groups.replica == 0)


def gather_experts(local: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
    """The whole `[E, ...]` tensor on every rank of the group."""
    parts = [torch.empty_like(local) for _ in range(groups.size)]
    dist.all_gather(parts, local.contiguous(), group=groups.group)
    return torch.cat(parts)


def param_groups(model: nn.Module) -> list[dict] | Iterator[nn.Parameter]:
    """The optimizer's parameters: FSDP's DTensors and the expert-parallel plain tensors apart, since the foreach
    and fused optimizer kernels refuse lists that mix the two."""
    local = {id(p) for p, _ in expert_params(model).values()}
    if not local:
        return model.parameters()
    sharded = [p for p in model.parameters() if id(p) not in local]
    return [{"params": sharded}, {"params": [p for p in model.parameters() if id(p) in local]}]


@torch.no_grad()
def reduce_and_clip(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Finish the expert gradients (sum over replicas, mean over the world, as FSDP does for the rest), then clip
    every gradient to a global norm of `max_norm`; returns the norm before clipping."""
    experts = {id(p): groups for p, groups in expert_params(model).values()}
    world = dist.get_world_size() if dist.is_initialized() else 1
    squares, grads = None, []
    for param in model.parameters():
        if param.grad is None:
            continue
        groups = experts.get(id(param))
        if groups is not None:
            if groups.replica_group is not None:
                dist.all_reduce(param.grad, group=groups.replica_group)
            param.grad.div_(world)
        grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
        # Each element counts once over the world: FSDP shards are unique, expert shards have `replicas` copies.
        copies = 1 if isinstance(param.grad, DTensor) else groups.replicas if groups else world
        square = grad.float().pow(2).sum() / copies
        squares = square if squares is None else squares + square
        grads.append(grad)
    if squares is None:
        return torch.zeros(())
    if world > 1:
        dist.all_reduce(squares)
    norm = squares.sqrt()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for grad in grads:
        grad.mul_(scale.to(grad.dtype))
    return norm
