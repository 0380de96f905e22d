"""tandem rl's split of a GPU that trainer and inference share: the estimate, the plan, and what the user set."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from support.hybrid_models import QWEN3_NEXT
from tandem.config import ConfigError
from tandem.config.common import LoraConfig
from tandem.config.rl import RlConfig
from tandem.inference.kv_budget import state_bytes
from tandem.models import Logprobs, build_model, model_args
from tandem.shared_gpu import (
    GIB,
    activation_bytes_per_token,
    parameter_counts,
    plan_shared_gpu,
    server_need,
    split_shared_gpu,
    trainer_need,
)
from tandem.testing.tiny import tiny_config

H200 = int(139.8 * GIB)
QWEN3 = {"vocab_size": 151936, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128}
SHAPES = {  # Qwen3-0.6B and Qwen3-1.7B: 28 layers, tied embeddings
    "0.6b": {**QWEN3, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28},
    "1.7b": {**QWEN3, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28},
}


def write_shape(path: Path, **shape) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(tiny_config("qwen3", **shape)))
    return path


def rl_config(model: Path, **sections) -> RlConfig:
    """A named run: the default run name holds the time, so two configs built a second apart would differ."""
    return RlConfig.model_validate(
        {"model": {"name": str(model)}, "seq_len": 4096, "run_name": "rl", "trainer": {"random_init": True}, **sections}
    )


@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("shapes")
    return {name: write_shape(root / name, **shape) for name, shape in SHAPES.items()}


def test_activation_rule_covers_what_autograd_saves_within_2x(tmp_path):
    """The per-token rule against the tensors a real forward (blocks, final norm, chunked loss) saves for
    backward under bf16 autocast, per token: the slope between two sequence lengths, so weights drop out."""
    model_dir = write_shape(
        tmp_path, vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=4, head_dim=64
    )
    model = build_model(model_dir, dtype=torch.float32)

    def saved(tokens: int) -> int:
        storages: dict[int, int] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        ids = torch.randint(0, 512, (1, tokens))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", torch.bfloat16):
            model(ids, head=Logprobs(ids.roll(-1, 1), chunk_size=128))
        return sum(storages.values())

    measured = (saved(512) - saved(256)) / 256
    estimate = activation_bytes_per_token(model_args(model_dir), "off")
    assert measured <= estimate <= 2 * measured, (measured, estimate)
    assert activation_bytes_per_token(model_args(model_dir), "full") < estimate / 2


@pytest.mark.parametrize(
    ("name", "trainer_gib"),
    [("0.6b", (8, 40)), ("1.7b", (27, 80))],
)
def test_a_shared_h200_is_split_with_sane_numbers(shapes, name, trainer_gib):
    config = rl_config(shapes[name])
    params = parameter_counts(model_args(shapes[name]), config.model.lora).base
    need = trainer_need(config)
    assert need.states == 16 * params  # fp32 weights, grads, AdamW's two moments
    assert trainer_gib[0] * GIB <= need.total <= trainer_gib[1] * GIB
    assert 4 * GIB <= need.activations <= 30 * GIB  # 4096 tokens through 28 blocks

    planned, message = plan_shared_gpu(config, H200, "NVIDIA H200")
    inference = planned.inference
    share = inference.gpu_memory_utilization * H200
    assert need.total + share <= H200 and 0.3 < inference.gpu_memory_utilization < 0.95
    kv_per_token = 2 * 28 * 8 * 128 * 2  # K and V, 28 layers, 8 KV heads of 128, bf16
    kv = inference.kv_cache_blocks * 16 * kv_per_token
    assert 0.8 * (share - 10 * GIB) <= kv <= share  # most of the share is cache; weights are 1-4 GiB
    assert inference.kv_cache_blocks <= 256 * 4096 // 16 + 1  # never more than max_running full sequences
    assert message.startswith("GPU 0 (NVIDIA H200, 139.8 GiB) shared: trainer ~")
    assert f"gpu_memory_utilization {inference.gpu_memory_utilization:g}" in message
    assert f"{inference.kv_cache_blocks} blocks" in message
    assert config.inference.kv_cache_blocks == 0  # the plan is a new config


def test_lora_counts_adapters_as_trained_and_the_folded_copy_on_the_server(shapes):
    """LoRA rank 16 on Qwen3-1.7B: the trainer holds the bf16 base once plus fp32 adapters with their gradients and
    AdamW state (~4 GiB, not full fine-tuning's ~27 GiB) and hands off only adapters; a folding server holds one
    more copy of the adapted weights (every projection: most of the model besides the embedding)."""

    def config(**model) -> RlConfig:
        model = {"name": str(shapes["1.7b"]), "dtype": "bfloat16", **model}
        return RlConfig.model_validate({"model": model, "seq_len": 4096, "run_name": "rl"})

    full, adapted = config(), config(lora={"rank": 16, "alpha": 32})
    counts = parameter_counts(model_args(shapes["1.7b"]), adapted.model.lora)
    assert counts.base == parameter_counts(model_args(shapes["1.7b"]), full.model.lora).base
    assert 0.003 * counts.base < counts.adapters < 0.02 * counts.base  # rank 16 of 2048-wide projections
    assert 0.6 * counts.base < counts.adapted < 0.9 * counts.base  # all but the 151936 x 2048 embedding
    need, full_need = trainer_need(adapted), trainer_need(full)
    assert need.states == 16 * counts.adapters + 2 * counts.base
    assert need.handoff == 4 * counts.adapters and full_need.handoff == 2 * counts.base
    assert full_need.total - need.total > 20 * GIB
    folded, unmerged = server_need(adapted), server_need(adapted.model_copy(update={
        "inference": adapted.inference.model_copy(update={"lora_fold": False})}))  # fmt: skip
    assert folded.weights - unmerged.weights == 2 * counts.adapted
    assert unmerged.weights == 2 * counts.base + 4 * counts.adapters


def test_expert_adapters_count_each_experts_pair_and_stack(tiny_model_dir):
    """`model.lora.experts` on a Qwen3-MoE: the adapters add one rank-r pair per expert on both stacked
    projections, and a folding server keeps a copy of the stacks too."""
    args = model_args(tiny_model_dir("qwen3_moe"))
    lora = {"rank": 4, "target_modules": ["q_proj"]}
    plain, experts = (
        parameter_counts(args, LoraConfig.model_validate({**lora, "experts": on})) for on in (False, True)
    )
    e, h, i, layers = args.moe.num_experts, args.hidden_size, args.moe.intermediate_size, len(args.moe.layers)
    assert experts.adapters - plain.adapters == layers * e * 4 * ((h + 2 * i) + (i + h))
    assert experts.adapted - plain.adapted == layers * e * 3 * h * i


def test_a_utilisation_the_user_set_wins_and_is_checked(shapes):
    config = rl_config(shapes["0.6b"], inference={"gpu_memory_utilization": 0.4})
    planned, message = plan_shared_gpu(config, H200)
    assert planned.inference.gpu_memory_utilization == 0.4 and "0.4 (set)" in message
    # the built-in engine gets the blocks the share holds, whatever the trainer has allocated when it starts
    assert 0 < planned.inference.kv_cache_blocks * 16 * 2 * 28 * 8 * 128 * 2 < 0.4 * H200

    written_out = rl_config(shapes["0.6b"], inference={"gpu_memory_utilization": 0.9})  # the default: auto
    assert (
        plan_shared_gpu(written_out, H200)[0].inference == plan_shared_gpu(rl_config(shapes["0.6b"]), H200)[0].inference
    )

    too_much = rl_config(shapes["1.7b"], inference={"gpu_memory_utilization": 0.8})
    with pytest.raises(ConfigError, match=r"inference.gpu_memory_utilization gives .*the most a server can take"):
        plan_shared_gpu(too_much, H200)


def test_the_trainers_share_can_be_set_and_vllm_sizes_its_own_cache(shapes):
    config = rl_config(shapes["0.6b"], deploy={"trainer_memory_gib": 60})
    planned, message = plan_shared_gpu(config, H200)
    assert planned.inference.gpu_memory_utilization * H200 <= H200 - 60 * GIB
    assert "trainer 60.0 GiB (deploy.trainer_memory_gib; the estimate is" in message

    vllm = rl_config(shapes["0.6b"], inference={"engine": "vllm"}, trainer={"weights": {"transport": "file"}})
    planned, message = plan_shared_gpu(vllm, H200)
    assert planned.inference.kv_cache_blocks == 0 and "sized by vLLM" in message
    assert 0.3 < planned.inference.gpu_memory_utilization < 0.95


def test_a_gpu_too_small_for_both_is_a_config_error_naming_the_numbers(shapes):
    with pytest.raises(ConfigError) as error:
        plan_shared_gpu(rl_config(shapes["1.7b"]), 24 * GIB, "NVIDIA L4")
    text = str(error.value)
    assert text.startswith("GPU 0 (NVIDIA L4, 24.0 GiB) cannot hold both the trainer and inference: trainer ~")
    assert "deploy.trainer_gpus" in text and "micro_batch_rows" in text


def test_split_or_cpu_deploys_are_left_alone(shapes):
    split = rl_config(shapes["0.6b"], deploy={"trainer_gpus": [0], "inference_gpus": [1]})
    assert split_shared_gpu(split) == (split, None)
    on_cpu = rl_config(shapes["0.6b"], inference={"device": "cpu"})
    assert split_shared_gpu(on_cpu) == (on_cpu, None)
    if not torch.cuda.is_available():
        shared = rl_config(shapes["0.6b"])
        assert split_shared_gpu(shared) == (shared, None)


def test_compiled_blocks_and_the_fused_loss_are_estimated_near_the_measured_peak(shapes):
    """The 0.6B shape with rl_throughput.py's max-perf switches (compiled blocks, the fused policy loss, 4 x 4096
    tokens a micro-batch) peaked at 39.6 GiB reserved inside tandem rl on an H200 (benchmarks/RESULTS.md): the
    estimate stays above that, within 1.5x, so an 80 GiB GPU still holds trainer and inference."""
    speed = {"fused_loss": True, "fused_optimizer": True, "fsdp_single_process": False}
    trainer = {"random_init": True, "compile": True, "loss_chunk_size": 16384, "speed": speed}
    config = rl_config(shapes["0.6b"], trainer=trainer, orchestrator={"micro_batch_rows": 4})
    need = trainer_need(config)
    assert 39.6 * GIB <= need.total <= 1.5 * 39.6 * GIB
    eager = trainer_need(rl_config(shapes["0.6b"], orchestrator={"micro_batch_rows": 4}))
    assert need.activations < 0.7 * eager.activations
    planned, _ = plan_shared_gpu(config, int(79.2 * GIB), "NVIDIA H100 80GB HBM3")
    assert planned.inference.kv_cache_blocks * 16 >= 256 * 300  # a step's 256 rollouts of ~300 tokens


def test_a_hybrid_servers_recurrent_state_is_counted(tmp_path):
    """Qwen3-Next keeps a recurrent state per running sequence beside its KV cache: the server's fixed share holds it
    (a state slot per `max_running` sequence and a scratch one), and the sentence says so."""
    model = tmp_path / "qwen3-next"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**QWEN3_NEXT, "vocab_size": 256}))
    config = RlConfig.model_validate({"model": {"name": str(model)}, "seq_len": 1024, "run_name": "rl"})
    server = server_need(config)
    slots = config.inference.max_running + 1
    assert server.state == state_bytes(model_args(model), slots, torch.bfloat16) > 0
    assert server.fixed == server.context + server.weights + server.activations + server.state
    _, message = plan_shared_gpu(config, H200, "NVIDIA H200")
    assert "recurrent state" in message
