"""tandem's model layer: one implementation per architecture family, shared by the trainer and inference.

Imports nothing else from tandem. See docs/models.md.
"""

from .architecture import Architecture
from .build import build_model, load_model, model_args
from .checkpoint import (
    ModelWeightsError,
    OutsideDirectoryError,
    all_finite,
    hf_tensors,
    iter_runtime_tensors,
    load_weights,
    open_safetensors,
    resolve_inside,
    save_model,
)
from .config import ModelArgs, ModelConfigError, MoEArgs, RopeArgs, read_hf_config
from .decoder import CausalLM, DecoderBlock, weight_map
from .heads import Head, Hidden, Logits, Logprobs, NllSum
from .hf_layout import Fused, HFLayout
from .layers import MOE_BACKENDS, AttnInputs, CacheBatch, KVCache, StateBatch, StateCache
from .logprobs import IGNORE_INDEX, TokenLogprobs, cross_entropy, reference_token_logprobs, token_logprobs
from .nll_sum import fused_nll_sum
from .registry import ARCHITECTURES, get_architecture
from .runtime import ModelRuntime

__all__ = [
    "ARCHITECTURES",
    "IGNORE_INDEX",
    "MOE_BACKENDS",
    "Architecture",
    "AttnInputs",
    "CacheBatch",
    "CausalLM",
    "DecoderBlock",
    "Fused",
    "HFLayout",
    "Head",
    "Hidden",
    "KVCache",
    "Logits",
    "Logprobs",
    "MoEArgs",
    "ModelArgs",
    "ModelConfigError",
    "ModelRuntime",
    "ModelWeightsError",
    "NllSum",
    "OutsideDirectoryError",
    "RopeArgs",
    "StateBatch",
    "StateCache",
    "TokenLogprobs",
    "all_finite",
    "build_model",
    "cross_entropy",
    "fused_nll_sum",
    "get_architecture",
    "hf_tensors",
    "iter_runtime_tensors",
    "load_model",
    "load_weights",
    "model_args",
    "open_safetensors",
    "read_hf_config",
    "reference_token_logprobs",
    "resolve_inside",
    "save_model",
    "token_logprobs",
    "weight_map",
]
