"""LoRA on routed MoE experts (`model.lora.experts`) against PEFT's `target_parameters` LoRA on transformers'
stacked experts: forward, the adapter format both ways, merging; both MoE backends, gradients, folding and
per-row routing.

PEFT is the reference only: tandem never imports it. The base is a tiny Qwen3-MoE checkpoint (INIT_STD weights);
adapters get random B (PEFT starts B at zero, which would hide a wrong layout or scale).
"""

from __future__ import annotations

import json

import pytest
import torch

from support.model_parity import hf_load
from support.tiny_models import INIT_STD
from tandem.models import ModelRuntime, load_model, save_model
from tandem.models.lora import (
    LoraArgs,
    LoraError,
    LoraExperts,
    apply_lora,
    fold_adapters,
    load_peft_adapter,
    lora_parameters,
    merge_lora,
    read_adapter,
    route_adapters,
    save_adapter,
)

peft = pytest.importorskip("peft")

TOL = 1e-5
ARGS = LoraArgs(rank=4, alpha=12, target_modules=("q_proj", "o_proj"), experts=True)
IDS = torch.tensor([[5, 17, 33, 2, 9, 41, 7, 100], [3, 3, 8, 61, 12, 90, 4, 1]])


@pytest.fixture(scope="module")
def moe_dir(tiny_model_dir):
    return tiny_model_dir("qwen3_moe", initializer_range=INIT_STD)


def _adapted(path, args: LoraArgs = ARGS, seed: int = 1, backend: str = "grouped_mm"):
    model = load_model(path, dtype=torch.float32, runtime=ModelRuntime(moe_backend=backend)).eval()
    apply_lora(model, args, seed=0)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in lora_parameters(model):
            param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model


def test_tandem_expert_adapter_loads_in_peft_and_computes_the_same_logits(moe_dir, tmp_path):
    model = _adapted(moe_dir)
    experts = model.layers[0].mlp.experts
    assert isinstance(experts, LoraExperts) and set(experts.lora_A) == {"gate_up_proj", "down_proj"}
    save_adapter(model, tmp_path / "adapter", base_model_name=str(moe_dir))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["experts.down_proj", "experts.gate_up_proj"]
    reference = peft.PeftModel.from_pretrained(hf_load(moe_dir), tmp_path / "adapter").eval()
    with torch.no_grad():
        want = reference(IDS).logits
        assert (model(IDS) - want).abs().max() < TOL
        assert (hf_load(moe_dir)(IDS).logits - want).abs().max() > 1e-2  # the adapter changes the logits
    assert set(read_adapter(tmp_path / "adapter")[1]) == set(peft.get_peft_model_state_dict(reference))


def test_peft_expert_adapter_loads_in_tandem(moe_dir, tmp_path):
    torch.manual_seed(0)
    config = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["v_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )
    reference = peft.get_peft_model(hf_load(moe_dir), config)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1)
    reference.save_pretrained(tmp_path / "peft")
    reference.eval()
    model = load_model(moe_dir, dtype=torch.float32).eval()
    args = load_peft_adapter(model, tmp_path / "peft")
    assert args == LoraArgs(rank=4, alpha=8, target_modules=("v_proj",), experts=True)
    with torch.no_grad():
        assert (model(IDS) - reference(IDS).logits).abs().max() < TOL


def test_both_backends_agree_and_only_adapters_get_gradients(moe_dir):
    models = [_adapted(moe_dir, backend=backend).train() for backend in ("loop", "grouped_mm")]
    losses = [model(IDS).logsumexp(-1).mean() for model in models]
    assert abs(losses[0].item() - losses[1].item()) < TOL
    for loss in losses:
        loss.backward()
    grads = [{n: p.grad for n, p in model.named_parameters() if p.grad is not None} for model in models]
    assert set(grads[0]) == set(grads[1]) == {n for n, p in models[0].named_parameters() if p.requires_grad}
    assert any(".experts.lora_A." in name for name in grads[0])  # the expert adapters train
    for name, grad in grads[0].items():
        assert (grad - grads[1][name]).abs().max() < 1e-4, name
    assert all(p.grad is None for n, p in models[0].named_parameters() if not p.requires_grad)


def test_merged_checkpoint_equals_base_plus_adapter(moe_dir, tmp_path):
    model = _adapted(moe_dir)
    with torch.no_grad():
        expected = model(IDS)
    merge_lora(model)
    assert not any(isinstance(m, LoraExperts) for m in model.modules())
    save_model(model, tmp_path / "merged")
    with torch.no_grad():
        assert (hf_load(tmp_path / "merged")(IDS).logits - expected).abs().max() < TOL


def test_folded_and_routed_serving_compute_the_adapter(moe_dir):
    """Folded: the stacked weights hold base + adapters (the forward adds nothing); routed: a per-row gate picks
    the adapter (1) or the base (0) for each sequence of one batch."""
    adapted, plain = _adapted(moe_dir), load_model(moe_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want, base = adapted(IDS), plain(IDS)
        routed = _adapted(moe_dir)
        gates = torch.tensor([1.0] * IDS.shape[1] + [0.0] * IDS.shape[1])
        route_adapters(routed, gates)
        mixed = routed(IDS)
        assert (mixed[0] - want[0]).abs().max() < TOL and (mixed[1] - base[1]).abs().max() < TOL
        fold_adapters(adapted)
        assert adapted.layers[0].mlp.experts.low_rank(IDS.numel()) is None
        assert (adapted(IDS) - want).abs().max() < TOL


def test_expert_adapter_mistakes_are_named(moe_dir, tiny_model_dir, tmp_path):
    with pytest.raises(LoraError, match="needs an MoE model"):
        apply_lora(load_model(tiny_model_dir("qwen3")), LoraArgs(rank=4, experts=True))
    save_adapter(_adapted(moe_dir), tmp_path / "a")
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    (tmp_path / "a" / "adapter_config.json").write_text(
        json.dumps({**config, "target_parameters": ["experts.down_proj"]})
    )
    with pytest.raises(LoraError, match="adapt one expert projection"):
        read_adapter(tmp_path / "a")
    (tmp_path / "a" / "adapter_config.json").write_text(
        json.dumps({**config, "target_parameters": ["mlp.gate.weight"]})
    )
    with pytest.raises(LoraError, match="is not supported"):
        read_adapter(tmp_path / "a")
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps({**config, "target_parameters": None}))
    with pytest.raises(LoraError, match="has rank 4, alpha 12 on q_proj, o_proj;"):
        load_peft_adapter(_adapted(moe_dir), tmp_path / "a")  # the same adapters without the experts'
