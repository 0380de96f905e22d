"""DeepSeek-V3.2 (`DeepseekV32ForCausalLM`): DeepSeek-V3 with DeepSeek Sparse Attention. Every layer's MLA attends,
per query, only to the `index_topk` keys its lightning indexer (`index_n_heads` heads of `index_head_dim`)
scores highest; see `layers.indexer`. MoE, MTP layers and everything else as DeepSeek-V3 (`deepseek_v3`).

transformers' V3.2 always uses the low-rank query (the indexer reads its latent) and interleaved MLA RoPE, so a
null `q_lora_rank` or `rope_interleave: false` is refused rather than silently ignored. `mlp_layer_types`, when
a config lists it, says which layers are MoE (`"sparse"`), as in transformers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from .architecture import Architecture
from .config import IndexerArgs, ModelArgs, ModelConfigError
from .deepseek_v3 import DEFAULTS as V3_DEFAULTS
from .deepseek_v3 import parse as parse_v3

# transformers' DeepseekV32Config defaults for the keys a config.json may leave out (the rest as DeepSeek-V3)
DEFAULTS = {**V3_DEFAULTS, "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 64}


def parse(hf: Mapping[str, Any]) -> ModelArgs:
    if "q_lora_rank" in hf and hf["q_lora_rank"] is None:
        raise ModelConfigError("DeepSeek-V3.2 needs q_lora_rank: transformers' indexer reads the query latent")
    if not hf.get("rope_interleave", True):
        raise ModelConfigError("rope_interleave=false is not supported (transformers' V3.2 always interleaves)")
    args = parse_v3({**hf, "rope_interleave": True})  # V3's defaults are V3.2's
    indexer = IndexerArgs(
        num_heads=int(hf.get("index_n_heads", DEFAULTS["index_n_heads"])),
        head_dim=int(hf.get("index_head_dim", DEFAULTS["index_head_dim"])),
        topk=int(hf.get("index_topk", DEFAULTS["index_topk"])),
    )
    assert args.mla is not None and args.moe is not None
    if not args.mla.qk_rope_head_dim <= indexer.head_dim:
        raise ModelConfigError(f"index_head_dim={indexer.head_dim} is smaller than qk_rope_head_dim")
    if indexer.topk < 1:
        raise ModelConfigError(f"index_topk={indexer.topk} must be at least 1")
    moe = args.moe
    if hf.get("mlp_layer_types") is not None:
        types = list(hf["mlp_layer_types"])
        if len(types) != args.num_layers or set(types) - {"dense", "sparse"}:
            raise ModelConfigError(f"mlp_layer_types must list 'dense'/'sparse' for each of {args.num_layers} layers")
        moe = dataclasses.replace(moe, layers=tuple(i for i, kind in enumerate(types) if kind == "sparse"))
    return args.replace(indexer=indexer, moe=moe, hf_config=dict(hf))


ARCHITECTURE = Architecture("DeepseekV32ForCausalLM", parse)
