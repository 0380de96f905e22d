"""Save/load round trips through transformers, sharding, dtypes, meta materialisation, and clear errors."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil

import pytest
import torch
from safetensors.torch import save_file

from support.model_parity import disk_tensors, hf_load
from tandem.models import (
    ModelArgs,
    ModelConfigError,
    ModelRuntime,
    ModelWeightsError,
    build_model,
    hf_tensors,
    load_model,
    load_weights,
    model_args,
    save_model,
)
from tandem.testing import tiny_config, write_tiny_model
from tandem.testing.tiny import TINY_ARCHITECTURES as ARCHS


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_dir_round_trips_unchanged(arch, model_dir, tmp_path):
    """HF dir -> tandem -> save: same keys, shapes and values on disk; transformers loads it with no warnings."""
    src = model_dir(arch)
    out = save_model(load_model(src), tmp_path / "saved")
    original, saved = disk_tensors(src), disk_tensors(out)
    assert sorted(saved) == sorted(original)
    for key, tensor in original.items():
        assert saved[key].dtype == tensor.dtype and torch.equal(saved[key], tensor), key
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes()
    config = json.loads((out / "config.json").read_text())
    assert config == json.loads((src / "config.json").read_text())
    reloaded = hf_load(out)
    ids = torch.randint(3, 500, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, hf_load(src)(ids).logits, atol=0, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_tandem_model_round_trips_through_transformers(arch, tmp_path):
    """Random tandem model -> save -> transformers (same logits) -> save_pretrained -> tandem (same weights)."""
    model = build_model(tiny_config(arch, initializer_range=0.1), seed=0).eval()
    save_model(model, tmp_path / "ours")
    hf = hf_load(tmp_path / "ours")
    ids = torch.randint(3, 500, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (model(ids) - hf(ids).logits).abs().max().item()
    assert diff < 1e-4
    hf.save_pretrained(tmp_path / "theirs")
    back = load_model(tmp_path / "theirs")
    expected = model.state_dict()
    for name, tensor in back.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


def test_sharded_save_writes_index_and_loads_both_ways(model_dir, tmp_path):
    src = model_dir("qwen3_moe")
    model = load_model(src)
    out = save_model(model, tmp_path / "sharded", max_shard_size="100KB")
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for _, t in hf_tensors(model))
    hf_load(out)
    back = load_model(out)
    for name, tensor in back.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name


def test_bf16_save_and_load(model_dir, tmp_path):
    model = load_model(model_dir("llama"))
    out = save_model(model, tmp_path / "bf16", dtype=torch.bfloat16)
    config = json.loads((out / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    assert {t.dtype for t in disk_tensors(out).values()} == {torch.bfloat16}
    back = load_model(out)
    assert back.embed_tokens.weight.dtype == torch.bfloat16
    hf = hf_load(out, dtype=torch.bfloat16)
    torch.testing.assert_close(hf.model.embed_tokens.weight, back.embed_tokens.weight, atol=0, rtol=0)
    fp32 = load_model(out, dtype=torch.float32)
    assert fp32.lm_head.weight.dtype == torch.float32


def test_save_replaces_existing_dir_atomically(model_dir, tmp_path):
    model = load_model(model_dir("qwen3"))
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "stale.txt").write_text("old")
    save_model(model, target)
    assert not (target / "stale.txt").exists() and (target / "model.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temp or backup dirs left


def test_meta_build_then_materialise(model_dir):
    path = model_dir("qwen3_moe")
    meta = load_model(path, device="meta")
    assert all(p.is_meta for p in meta.parameters())
    load_weights(meta, path)
    eager = load_model(path)
    ids = torch.randint(3, 500, (1, 6))
    torch.testing.assert_close(meta(ids), eager(ids), atol=0, rtol=0)
    assert all(p.is_meta for p in build_model(tiny_config("llama"), device="meta").parameters())


def test_stacked_experts_checkpoint_loads(model_dir, tmp_path):
    """A checkpoint that stores experts stacked (transformers' in-memory layout) loads to the same model."""
    src = model_dir("qwen3_moe")
    tensors = disk_tensors(src)
    stacked = {}
    for key, tensor in tensors.items():
        if ".mlp.experts." not in key:
            stacked[key] = tensor
    for layer in range(2):
        p = f"model.layers.{layer}.mlp.experts"
        gate_up = [
            torch.cat([tensors[f"{p}.{e}.gate_proj.weight"], tensors[f"{p}.{e}.up_proj.weight"]]) for e in range(4)
        ]
        stacked[f"{p}.gate_up_proj"] = torch.stack(gate_up)
        stacked[f"{p}.down_proj"] = torch.stack([tensors[f"{p}.{e}.down_proj.weight"] for e in range(4)])
    out = tmp_path / "stacked"
    out.mkdir()
    shutil.copy(src / "config.json", out / "config.json")
    save_file(stacked, out / "model.safetensors")
    ids = torch.randint(3, 500, (1, 7))
    torch.testing.assert_close(load_model(out)(ids), load_model(src)(ids), atol=0, rtol=0)


def test_missing_and_unexpected_weights_are_named(model_dir, tmp_path):
    src = model_dir("llama")
    tensors = disk_tensors(src)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    tensors["model.layers.1.extra.weight"] = torch.zeros(1)
    (tmp_path / "bad").mkdir()
    shutil.copy(src / "config.json", tmp_path / "bad" / "config.json")
    save_file(tensors, tmp_path / "bad" / "model.safetensors")
    with pytest.raises(ModelWeightsError, match=r"1 missing: model\.layers\.1\.self_attn\.k_proj\.weight.*extra"):
        load_model(tmp_path / "bad")
    (tmp_path / "bad" / "model.safetensors").unlink()
    with pytest.raises(ModelWeightsError, match="missing weights"):
        load_model(tmp_path / "bad")


def test_config_errors_name_the_problem(tmp_path):
    with pytest.raises(ModelConfigError, match=r"unsupported architecture 'GPT2LMHeadModel'.*LlamaForCausalLM"):
        build_model({**tiny_config("llama"), "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ModelConfigError, match="missing required key 'hidden_size'"):
        build_model({k: v for k, v in tiny_config("qwen3").items() if k != "hidden_size"})
    with pytest.raises(ModelConfigError, match="rope_type 'dynamic' is not supported"):
        build_model(tiny_config("llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0}))
    with pytest.raises(ModelConfigError, match="sliding-window"):
        build_model(tiny_config("qwen3", use_sliding_window=True))
    with pytest.raises(TypeError, match="vocab_size"):  # the checkpoint's config is not a runtime choice
        ModelRuntime(vocab_size=3)
    with pytest.raises(ModelConfigError, match="attn_backend 'eager' is not one of"):
        ModelRuntime(attn_backend="eager")
    with pytest.raises(ModelConfigError, match=r"moe_backend has 1 entries, expected one per layer \(2\)"):
        build_model(tiny_config("qwen3_moe"), runtime=ModelRuntime(moe_backend=["loop"]))
    with pytest.raises(ModelConfigError, match="needs both vision_config and vision_tower"):
        model_args(tiny_config("qwen3")).replace(vision_tower="qwen3_vl")


def test_model_args_are_the_checkpoint_config_and_runtime_apart(tmp_path):
    """A model loaded in another dtype with other kernels keeps the config's ModelArgs (dtype too); the run's
    choices are `model.runtime`, and reach the modules."""
    src = write_tiny_model(tmp_path / "src", "qwen3_moe")
    runtime = ModelRuntime(attn_backend="sdpa", moe_backend=["loop", "grouped_mm"], freeze_router=True)
    model = load_model(src, dtype=torch.bfloat16, runtime=runtime)
    assert model.args == model_args(src) and model.args.dtype == torch.float32
    assert model.runtime == runtime and runtime.moe_backend == ("loop", "grouped_mm")
    assert [layer.mlp.backend for layer in model.layers] == ["loop", "grouped_mm"]
    assert all(layer.mlp.freeze_router for layer in model.layers)
    assert {f.name for f in dataclasses.fields(ModelArgs)}.isdisjoint(f.name for f in dataclasses.fields(ModelRuntime))


VARIANTS = {
    "llama with attention and MLP biases": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "qwen3 with attention bias": ("qwen3", {"attention_bias": True}),
    "qwen3_moe with a dense layer": ("qwen3_moe", {"mlp_only_layers": [0]}),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_config_variants_match_and_round_trip(variant, tmp_path):
    """Biases (randomised: transformers initialises them to zero) and mixed dense/MoE layers."""
    arch, overrides = VARIANTS[variant]
    src = write_tiny_model(tmp_path / "src", arch, initializer_range=0.1, **overrides)
    hf = hf_load(src)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith(".bias"):
                param.normal_(std=0.1)
    hf.save_pretrained(src)
    model = load_model(src)
    ids = torch.randint(3, 500, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max() < 1e-4
    original, saved = disk_tensors(src), disk_tensors(save_model(model, tmp_path / "out"))
    assert sorted(saved) == sorted(original)
    assert all(torch.equal(saved[k], original[k]) for k in original)


def test_unreadable_files_are_named(model_dir, tmp_path):
    """A truncated shard, a corrupt index or config.json: a ModelWeightsError or ModelConfigError naming the file."""
    bad = shutil.copytree(model_dir("qwen3"), tmp_path / "bad")
    weights = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(weights[: len(weights) - 100])
    with pytest.raises(
        ModelWeightsError, match=re.escape(f"{bad / 'model.safetensors'} is not a readable safetensors file")
    ):
        load_model(bad)
    (bad / "model.safetensors").write_bytes(weights)
    (bad / "model.safetensors.index.json").write_text('{"weight_map": ')
    with pytest.raises(ModelWeightsError, match=r"model\.safetensors\.index\.json is not a valid safetensors index"):
        load_model(bad)
    index = {"weight_map": dict.fromkeys(disk_tensors(bad), "missing.safetensors")}
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelWeightsError, match=r"missing\.safetensors is not a readable safetensors file"):
        load_weights(load_model(bad, device="meta"), bad)
    (bad / "config.json").write_bytes(b"\xff{")
    with pytest.raises(ModelConfigError, match=r"config\.json is not valid JSON"):
        load_model(bad)


def test_a_confined_load_opens_nothing_outside_its_directory(model_dir, tmp_path):
    """`iter_runtime_tensors(confined=True)` (what the inference server uses) refuses an index entry or a symlink
    that leaves the directory; a plain load follows symlinks (a hub-cache snapshot links to ../../blobs)."""
    from tandem.models import OutsideDirectoryError, iter_runtime_tensors, model_args

    src = model_dir("qwen3")
    blobs = shutil.copytree(src, tmp_path / "blobs")
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    (snapshot / "config.json").symlink_to(blobs / "config.json")
    (snapshot / "model.safetensors").symlink_to(blobs / "model.safetensors")
    args = model_args(src)
    assert len(list(iter_runtime_tensors(snapshot, args))) == len(dict(load_model(src).named_parameters()))
    with pytest.raises(OutsideDirectoryError, match=r"model\.safetensors .*is outside"):
        next(iter_runtime_tensors(snapshot, args, confined=True))
    (snapshot / "model.safetensors").unlink()
    index = {"weight_map": dict.fromkeys(disk_tensors(src), "../blobs/model.safetensors")}
    (snapshot / "model.safetensors.index.json").write_text(json.dumps(index))
    assert len(list(iter_runtime_tensors(snapshot, args))) > 0
    with pytest.raises(OutsideDirectoryError, match=r"\.\./blobs/model.safetensors .*is outside"):
        next(iter_runtime_tensors(snapshot, args, confined=True))


def test_a_save_removes_what_a_killed_save_of_the_same_directory_left(model_dir, tmp_path):
    model = load_model(model_dir("qwen3"))
    for stale in (".final.tmp-0badc0de", ".final.old-0badc0de"):  # killed before its rename / its clean-up
        (tmp_path / stale).mkdir()
        (tmp_path / stale / "model.safetensors").write_bytes(b"half")
    (tmp_path / ".other.tmp-0badc0de").mkdir()  # another directory's save is not touched
    save_model(model, tmp_path / "final")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.tmp-0badc0de", "final"]
