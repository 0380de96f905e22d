"""Each module names its own tensors: every mixer's and block's `hf_weights` covers exactly the parameters of the
module it describes, and the layer-kind table covers every kind a config may name."""

from __future__ import annotations

import pytest
import torch

from support.hybrid_models import NEMOTRON_H_MOE, QWEN3_5_MOE, QWEN3_NEXT
from support.model_parity import DEEPSEEK_V3, GLM4_MOE
from tandem.models import ARCHITECTURES, ModelRuntime, model_args
from tandem.models.config import LAYER_CACHES
from tandem.models.decoder import BLOCKS, LAYER_KINDS, weight_map
from tandem.models.hf_layout import Fused, nest
from tandem.testing import tiny_config

CONFIGS = {
    "llama with biases": tiny_config("llama", attention_bias=True, mlp_bias=True),
    "qwen3-moe": tiny_config("qwen3_moe", mlp_only_layers=[0]),
    "deepseek-v3": DEEPSEEK_V3,
    "deepseek-v3 without a query rank": {**DEEPSEEK_V3, "q_lora_rank": None, "attention_bias": True},
    "deepseek-v3.2": {
        **DEEPSEEK_V3,
        "architectures": ["DeepseekV32ForCausalLM"],
        "model_type": "deepseek_v32",
        **{"index_n_heads": 2, "index_head_dim": 16, "index_topk": 4},
    },
    "glm-4.5": GLM4_MOE,
    "qwen3-next": {**QWEN3_NEXT, "vocab_size": 64},
    "qwen3.5-moe": {**QWEN3_5_MOE, "vocab_size": 64},
    "nemotron-h": {**NEMOTRON_H_MOE, "vocab_size": 64},
}


def test_the_table_has_a_mixer_for_every_layer_kind():
    assert set(LAYER_KINDS) == set(LAYER_CACHES)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_each_module_names_exactly_its_own_parameters(name):
    args = model_args(CONFIGS[name])
    layout = ARCHITECTURES[args.architecture].layout
    block_class = BLOCKS[args.block]
    for i in range(args.num_layers):
        with torch.device("meta"):
            block = block_class(args, i, ModelRuntime())
        kind = LAYER_KINDS[args.layer_type(i)]
        assert set(block_class.hf_weights(args, layout, i)) == {n for n, _ in block.named_parameters()}, f"layer {i}"
        own = {n for n, _ in block.mixer.named_parameters()}
        assert set(kind.hf_weights(args, layout)) == own, f"layer {i} {args.layer_type(i)}"


def test_nest_prefixes_runtime_names_and_hf_keys_apart():
    fused = {"qkv_proj.weight": Fused((("q_proj.weight", "k_proj.weight"),), (4, 2))}
    nested = nest("layers.3.", fused, "backbone.layers.3.")
    assert nested == {
        "layers.3.qkv_proj.weight": Fused(
            (("backbone.layers.3.q_proj.weight", "backbone.layers.3.k_proj.weight"),), (4, 2)
        )
    }


def test_weight_map_names_every_parameter_of_every_family():
    for name, config in CONFIGS.items():
        args = model_args(config)
        with torch.device("meta"):
            model = ARCHITECTURES[args.architecture].model_cls(args, ModelRuntime())
        wanted = weight_map(args, ARCHITECTURES[args.architecture].layout)
        assert set(wanted) == {n for n, _ in model.named_parameters()}, name
