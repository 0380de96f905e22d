"""Expert parallelism on 2 and 4 gloo processes: the loss, every gradient and the gradient norm equal one process's."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from support.dist import run_ranks

SEQ, ROWS_PER_RANK = 16, 2


def _batch(world: int):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (world * ROWS_PER_RANK, SEQ + 1), generator=generator)
    return ids[:, :-1], ids[:, 1:]


def _build(backend: str):
    from tandem.models import ModelRuntime, build_model
    from tandem.testing import tiny_config

    config = tiny_config("qwen3_moe", num_experts=8, num_experts_per_tok=2)
    return build_model(config, dtype=torch.float32, seed=0, runtime=ModelRuntime(moe_backend=backend))


def _full_grads(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    from tandem.trainer.expert_parallel import clean_fqn, expert_params, gather_experts

    experts = expert_params(model)
    grads = {}
    for wrapped, param in model.named_parameters():
        name = clean_fqn(wrapped)
        if isinstance(param.grad, DTensor):
            grads[name] = param.grad.full_tensor()
        elif name in experts:
            grads[name] = gather_experts(param.grad, experts[name][1])
        else:
            grads[name] = param.grad
    return grads


def _compare(rank: int, world: int, sizes: list[int], backend: str, checkpointing: bool) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from tandem.config import ConfigError
    from tandem.models import NllSum
    from tandem.trainer.expert_parallel import ExpertParallelMoE, apply_expert_parallel, reduce_and_clip
    from tandem.trainer.parallel import shard_model

    inputs, targets = _batch(world)
    tokens = targets.numel()
    reference = _build(backend)
    (reference(inputs, head=NllSum(targets)) / tokens).backward()
    reference_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9)
    reference_grads = {name: p.grad for name, p in reference.named_parameters()}
    mine = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
    for size in sizes:
        model = _build(backend)
        apply_expert_parallel(model, size)
        layer = model.layers[0].mlp
        assert isinstance(layer, ExpertParallelMoE) and layer.experts.gate_up_proj.shape[0] == 8 // size
        if checkpointing:  # backward recomputes each block, all-to-alls included, on every rank alike
            for index, block in enumerate(model.layers):
                model.layers[index] = checkpoint_wrapper(block, preserve_rng_state=False)
        shard_model(model, "float32")
        nll = model(inputs[mine], head=NllSum(targets[mine]))
        (nll * world / tokens).backward()  # as the trainers do: FSDP (and reduce_and_clip) average over ranks
        norm = reduce_and_clip(model, 1e9)
        loss = nll.detach().clone()
        dist.all_reduce(loss)
        torch.testing.assert_close(loss / tokens, reference(inputs, head=NllSum(targets)).detach() / tokens)
        torch.testing.assert_close(norm, reference_norm, rtol=1e-5, atol=0)
        for name, grad in _full_grads(model).items():
            torch.testing.assert_close(grad, reference_grads[name], rtol=1e-4, atol=1e-6, msg=f"ep {size}: {name}")
    with pytest.raises(ConfigError, match="must divide the trainer's world size"):
        apply_expert_parallel(_build(backend), 3)
    from tandem.models import build_model
    from tandem.testing import tiny_config

    with pytest.raises(ConfigError, match="needs a MoE model"):
        apply_expert_parallel(build_model(tiny_config("qwen3"), dtype=torch.float32), world)


@pytest.mark.parametrize(
    ("world", "sizes", "backend", "checkpointing"),
    [(2, [2], "grouped_mm", True), (4, [2, 4], "loop", False)],
    ids=["2 ranks, ep 2, activation checkpointing", "4 ranks, ep 2 (two replicas) and ep 4"],
)
def test_expert_parallel_gives_the_losses_and_gradients_of_one_process(world, sizes, backend, checkpointing):
    run_ranks(world, _compare, sizes, backend, checkpointing)
