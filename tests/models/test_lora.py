"""LoRA on tandem's fused layouts against PEFT: forward, gradients, the PEFT adapter format both ways, merging.

PEFT is the reference only: tandem never imports it. Base models are tiny transformers checkpoints (INIT_STD
weights); adapters get random B (PEFT starts B at zero, which would hide a wrong segment or scale).
"""

from __future__ import annotations

import json

import pytest
import torch

from support.lora import BROKEN_ADAPTERS, break_adapter
from support.model_parity import hf_load
from support.tiny_models import INIT_STD
from tandem.models import AttnInputs, load_model, save_model
from tandem.models.lora import (
    LORA_TARGETS,
    MAX_LORA_SCALE,
    LoraArgs,
    LoraError,
    LoraLinear,
    adapter_state_dict,
    apply_lora,
    load_peft_adapter,
    lora_args,
    lora_parameters,
    merge_lora,
    peft_key,
    read_adapter,
    save_adapter,
)

peft = pytest.importorskip("peft")

TOL = 1e-5
SUBSET = ("q_proj", "v_proj")
IDS = torch.tensor([[5, 17, 33, 2, 9, 41, 7, 100], [3, 3, 8, 61, 12, 90, 4, 1]])


@pytest.fixture(scope="module")
def base_dir(tiny_model_dir):
    return lambda arch: tiny_model_dir(arch, initializer_range=INIT_STD)


def _randomise(model: torch.nn.Module, seed: int = 1) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in lora_parameters(model):
            param.copy_(torch.randn(param.shape, generator=generator) * 0.1)


def _tandem_with_adapter(path, targets, seed=1):
    model = load_model(path, dtype=torch.float32).eval()
    apply_lora(model, LoraArgs(rank=4, alpha=12, target_modules=targets), seed=0)
    _randomise(model, seed)
    return model


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("targets", [SUBSET, LORA_TARGETS], ids=["q_v", "all"])
def test_tandem_adapter_loads_in_peft_and_computes_the_same_logits(base_dir, tmp_path, arch, targets):
    model = _tandem_with_adapter(base_dir(arch), targets)
    save_adapter(model, tmp_path / "adapter", base_model_name=str(base_dir(arch)))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 12 and config["target_modules"] == sorted(targets)
    reference = peft.PeftModel.from_pretrained(hf_load(base_dir(arch)), tmp_path / "adapter").eval()
    assert reference.peft_config["default"].target_modules == set(targets)
    with torch.no_grad():
        want = reference(IDS).logits
        got = model(IDS)
        assert (got - want).abs().max() < TOL
        plain = hf_load(base_dir(arch))(IDS).logits
        assert (plain - want).abs().max() > 1e-2  # the adapter changes the logits
    keys = set(read_adapter(tmp_path / "adapter")[1])
    assert keys == set(peft.get_peft_model_state_dict(reference))  # exactly PEFT's keys


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("targets", [SUBSET, LORA_TARGETS], ids=["q_v", "all"])
def test_peft_adapter_loads_in_tandem(base_dir, tmp_path, arch, targets):
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=list(targets), task_type="CAUSAL_LM")
    reference = peft.get_peft_model(hf_load(base_dir(arch)), config)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1)
    reference.save_pretrained(tmp_path / "peft")
    reference.eval()
    model = load_model(base_dir(arch), dtype=torch.float32).eval()
    args = load_peft_adapter(model, tmp_path / "peft")
    assert args == LoraArgs(rank=4, alpha=8, target_modules=tuple(t for t in LORA_TARGETS if t in targets))
    with torch.no_grad():
        assert (model(IDS) - reference(IDS).logits).abs().max() < TOL


def test_only_targeted_segments_get_adapters_and_names_map_to_peft(base_dir):
    model = _tandem_with_adapter(base_dir("qwen3"), ("k_proj", "up_proj"))
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, LoraLinear) and list(qkv.lora_A) == ["k_proj"]
    assert type(model.layers[0].self_attn.o_proj) is torch.nn.Linear  # untargeted: not wrapped
    names = sorted(adapter_state_dict(model))
    assert names[0] == "layers.0.mlp.gate_up_proj.lora_A.up_proj.weight"
    assert peft_key("layers.0.self_attn.qkv_proj.lora_B.k_proj.weight") == (
        "base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"
    )
    # q and v rows of the fused output are the base's exactly; k rows move
    x = torch.randn(2, 3, model.args.hidden_size)
    with torch.no_grad():
        base = torch.nn.functional.linear(x, qkv.weight)
        q, k, _ = qkv.sizes
        delta = qkv(x) - base
    assert delta[..., :q].abs().max() == 0 and delta[..., q + k :].abs().max() == 0
    assert delta[..., q : q + k].abs().max() > 1e-3


def test_adapters_start_at_zero_and_only_adapters_get_gradients(base_dir):
    model = load_model(base_dir("qwen3"), dtype=torch.float32)
    before = model(IDS).detach()
    apply_lora(model, LoraArgs(rank=4, alpha=8), seed=0)
    with torch.no_grad():
        assert torch.equal(model(IDS), before)  # B = 0: the adapted model is the base model
    assert lora_args(model) == LoraArgs(rank=4, alpha=8)
    _randomise(model)
    model(IDS).float().logsumexp(-1).mean().backward()
    adapters = {id(p) for p in lora_parameters(model)}
    assert len(adapters) == 2 * 7 * model.args.num_layers
    for name, param in model.named_parameters():
        if id(param) in adapters:
            assert param.requires_grad and param.dtype == torch.float32
            assert param.grad is not None and param.grad.abs().sum() > 0, name
        else:
            assert not param.requires_grad and param.grad is None, name


def test_dropout_applies_in_training_only(base_dir):
    model = load_model(base_dir("llama"), dtype=torch.float32)
    apply_lora(model, LoraArgs(rank=4, alpha=8, dropout=0.5), seed=0)
    _randomise(model)
    with torch.no_grad():
        model.eval()
        assert torch.equal(model(IDS), model(IDS))
        model.train()
        assert not torch.equal(model(IDS), model(IDS))


def test_merged_checkpoint_loads_in_transformers_and_equals_base_plus_adapter(base_dir, tmp_path):
    model = _tandem_with_adapter(base_dir("qwen3"), LORA_TARGETS)
    save_adapter(model, tmp_path / "adapter")
    with torch.no_grad():
        expected = peft.PeftModel.from_pretrained(hf_load(base_dir("qwen3")), tmp_path / "adapter")(IDS).logits
    merge_lora(model)
    assert lora_args(model) is None and not any(isinstance(m, LoraLinear) for m in model.modules())
    save_model(model, tmp_path / "merged")
    with torch.no_grad():
        assert (hf_load(tmp_path / "merged")(IDS).logits - expected).abs().max() < TOL


def test_block_with_adapters_compiles_fullgraph(base_dir):
    model = _tandem_with_adapter(base_dir("qwen3"), SUBSET)
    block = model.layers[0]
    x = torch.randn(2, 5, model.args.hidden_size)
    cos, sin = model.rotary(torch.arange(5).expand(2, -1), torch.float32)
    eager = block(x, cos, sin, AttnInputs())
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)(x, cos, sin, AttnInputs())
    torch.testing.assert_close(compiled, eager)


def test_mistakes_are_named(base_dir, tmp_path):
    with pytest.raises(LoraError, match="unknown LoRA targets"):
        LoraArgs(rank=4, target_modules=("qkv_proj",))
    with pytest.raises(LoraError, match="rank must be positive"):
        LoraArgs(rank=0)
    model = _tandem_with_adapter(base_dir("qwen3"), SUBSET)
    with pytest.raises(LoraError, match="already has LoRA"):
        apply_lora(model, LoraArgs(rank=4))
    save_adapter(model, tmp_path / "a")
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(LoraError, match="use_dora"):
        load_peft_adapter(load_model(base_dir("qwen3")), tmp_path / "a")
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps({**config, "r": 8}))
    with pytest.raises(LoraError, match="rank 8"):
        load_peft_adapter(model, tmp_path / "a")


@pytest.mark.parametrize("case", sorted(BROKEN_ADAPTERS))
def test_a_broken_adapter_is_refused_by_the_one_loader(base_dir, tmp_path, case):
    """Malformed configs, non-finite or integer tensors, absurd alphas: a LoraError naming the file and what is
    wrong, from `read_adapter` and from `load_peft_adapter` (merge-lora), before the model is touched."""
    good = save_adapter(_tandem_with_adapter(base_dir("qwen3"), SUBSET), tmp_path / "good")
    broken = break_adapter(good, tmp_path / case, case)
    message = BROKEN_ADAPTERS[case][1]
    with pytest.raises(LoraError, match=message) as refused:
        read_adapter(broken)
    assert str(broken) in str(refused.value) and "\n" not in str(refused.value)
    model = load_model(base_dir("qwen3"))
    with pytest.raises(LoraError, match=message):
        load_peft_adapter(model, broken)
    assert lora_args(model) is None


def test_lora_args_bound_rank_alpha_and_scale():
    assert LoraArgs(rank=1, alpha=MAX_LORA_SCALE).scale == MAX_LORA_SCALE
    with pytest.raises(LoraError, match=r"alpha / rank = 2001 / 2 = 1000.5 is over 1000"):
        LoraArgs(rank=2, alpha=2001)
    for alpha in (float("nan"), float("inf"), 0.0, -8.0, True):
        with pytest.raises(LoraError, match="alpha must be a positive, finite number"):
            LoraArgs(rank=4, alpha=alpha)
    for rank in (0, -1, 4.0, True):
        with pytest.raises(LoraError, match="rank must be positive"):
            LoraArgs(rank=rank)
