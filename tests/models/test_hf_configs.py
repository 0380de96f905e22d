"""Every registered family reads the `config.json` the installed transformers writes (`save_pretrained`) as the
same model as the hub's spelling of that config, and non-finite floats (transformers' `{"__float__": "Infinity"}`)
survive load -> save -> load in tandem and in transformers."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoConfig, PreTrainedConfig

from support.hybrid_models import NEMOTRON_H_MOE, QWEN3_5, QWEN3_5_MOE, QWEN3_NEXT
from support.model_parity import DEEPSEEK_V3, GLM4_MOE
from support.vision_models import vl_config
from tandem.models import ARCHITECTURES, build_model, model_args, read_hf_config, save_model
from tandem.models.config import decode_floats, encode_floats
from tandem.testing.tiny import tiny_config

VOCAB = 320
VISION = {
    "depth": 1, "hidden_size": 16, "intermediate_size": 24, "num_heads": 2, "out_hidden_size": QWEN3_5["hidden_size"],
    "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 16,
}  # fmt: skip


def _multimodal(architecture: str, model_type: str, text: dict[str, Any]) -> dict[str, Any]:
    text = {k: v for k, v in text.items() if k not in ("architectures", "model_type", "torch_dtype")}
    return {
        "architectures": [architecture], "model_type": model_type, "text_config": {**text, "vocab_size": VOCAB},
        "vision_config": VISION,
    }  # fmt: skip


CASES: dict[str, dict[str, Any]] = {
    "Qwen3ForCausalLM": tiny_config("qwen3", vocab_size=VOCAB),
    "LlamaForCausalLM": tiny_config("llama", vocab_size=VOCAB),
    "Qwen3MoeForCausalLM": tiny_config("qwen3_moe", vocab_size=VOCAB),
    "DeepseekV3ForCausalLM": DEEPSEEK_V3,
    "DeepseekV32ForCausalLM": {
        **DEEPSEEK_V3,
        "architectures": ["DeepseekV32ForCausalLM"],
        "model_type": "deepseek_v32",
        **{"index_n_heads": 9, "index_head_dim": 12, "index_topk": 4},
    },
    "Glm4MoeForCausalLM": GLM4_MOE,
    "Qwen3NextForCausalLM": QWEN3_NEXT,
    "Qwen3_5ForCausalLM": QWEN3_5,
    "Qwen3_5MoeForCausalLM": QWEN3_5_MOE,
    "Qwen3_5ForConditionalGeneration": _multimodal("Qwen3_5ForConditionalGeneration", "qwen3_5", QWEN3_5),
    "Qwen3_5MoeForConditionalGeneration": _multimodal("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe", QWEN3_5_MOE),
    "NemotronHForCausalLM": NEMOTRON_H_MOE,
    "Qwen3VLForConditionalGeneration": vl_config("qwen3-vl", VOCAB, 300, 301, 302, 303),
    "Qwen3VLMoeForConditionalGeneration": vl_config("qwen3-vl-moe", VOCAB, 300, 301, 302, 303),
    "Qwen2_5_VLForConditionalGeneration": vl_config("qwen2.5-vl", VOCAB, 300, 301, 302, 303),
}
"""A tiny hub-spelled config.json for each registered architecture (the ones the parity tests use)."""

NON_FINITE = {"NemotronHForCausalLM": "time_step_limit"}
"""The families whose transformers config holds a non-finite default, and the key."""


def _hub_config(architecture: str) -> dict[str, Any]:
    config = CASES[architecture]
    return config if "text_config" in config else {"vocab_size": VOCAB, **config}


def _saved_by_transformers(architecture: str, path: Path) -> Path:
    AutoConfig.for_model(**_hub_config(architecture)).save_pretrained(path)
    return path


def test_every_registered_architecture_has_a_case():
    assert sorted(CASES) == sorted(ARCHITECTURES)


@pytest.mark.parametrize("architecture", sorted(CASES))
def test_a_config_saved_by_transformers_parses_as_its_hub_spelling(architecture, tmp_path):
    saved = _saved_by_transformers(architecture, tmp_path)
    text = (saved / "config.json").read_text()
    assert json.loads(text)["architectures"] == [architecture]
    assert ('"__float__"' in text) == (architecture in NON_FINITE)  # the tagged spelling is what is under test
    assert model_args(saved) == model_args(_hub_config(architecture))


def test_nemotron_h_non_finite_time_step_limit_round_trips(tmp_path):
    saved = _saved_by_transformers("NemotronHForCausalLM", tmp_path / "hf")
    assert json.loads((saved / "config.json").read_text())["time_step_limit"] == [0.0, {"__float__": "Infinity"}]
    args = model_args(saved)
    assert args.mamba is not None and args.mamba.dt_limit == (0.0, math.inf)

    save_model(build_model(saved), tmp_path / "tandem")
    text = (tmp_path / "tandem" / "config.json").read_text()
    json.loads(text, parse_constant=lambda name: pytest.fail(f"non-standard JSON constant {name}"))
    assert json.loads(text)["time_step_limit"] == [0.0, {"__float__": "Infinity"}]
    assert list(AutoConfig.from_pretrained(tmp_path / "tandem").time_step_limit) == [0.0, math.inf]
    assert model_args(tmp_path / "tandem") == args


def test_bare_infinity_of_older_writers_is_read(tmp_path):
    config = {**_hub_config("NemotronHForCausalLM"), "time_step_limit": [0.0, math.inf]}
    (tmp_path / "config.json").write_text(json.dumps(config))  # Python's json writes a bare Infinity
    assert "Infinity" in (tmp_path / "config.json").read_text()
    assert model_args(tmp_path).mamba.dt_limit == (0.0, math.inf)


def test_float_tags_decode_and_encode_as_transformers_does(tmp_path):
    tagged = {
        "a": {"__float__": "Infinity"}, "b": [{"__float__": "-Infinity"}, {"__float__": "NaN"}, 1.5],
        "nested": {"c": {"__float__": "Infinity"}, "d": [[{"__float__": "NaN"}]]},
        "unknown_tag": {"__float__": "huge"}, "not_a_tag": {"__float__": "Infinity", "other": 1},
        "number_tag": {"__float__": 3}, "plain": "Infinity",
    }  # fmt: skip
    decoded = decode_floats(tagged)
    assert repr(decoded) == repr(PreTrainedConfig._decode_special_floats(tagged))
    assert decoded["a"] == math.inf and decoded["b"][0] == -math.inf and math.isnan(decoded["b"][1])
    assert decoded["unknown_tag"] == {"__float__": "huge"} and decoded["not_a_tag"] == tagged["not_a_tag"]
    values = {"x": (0.0, math.inf), "y": [-math.inf, {"z": math.nan}], "w": 2.0, "s": "NaN"}
    assert encode_floats(values) == PreTrainedConfig._encode_special_floats(values)
    (tmp_path / "config.json").write_text(json.dumps(tagged))
    assert repr(read_hf_config(tmp_path)) == repr(decoded)
