"""Weight updates only read files inside the checkpoint directory, refuse broken or non-finite checkpoints with a
4xx naming the file (the served weights stay), and never move the policy version backwards."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.inference.weights import ForbiddenWeightsPath, WeightsError, read_weights, resolve_weights_path
from tandem.models import load_model

WEIGHTS = "model.safetensors"


@pytest.fixture
def weights_dir(tmp_path) -> Path:
    (tmp_path / "weights").mkdir()
    return tmp_path / "weights"


@pytest.fixture
def served(model_dir):
    return load_model(model_dir("qwen3"), dtype=torch.float32)


def _policy(source: Path, target: Path, scale: float = 1.0) -> Path:
    """A copy of checkpoint `source` at `target`, its weights scaled by `scale` (a different policy)."""
    shutil.copytree(source, target)
    tensors = load_file(target / WEIGHTS)
    save_file({k: v * scale for k, v in tensors.items()}, target / WEIGHTS, metadata={"format": "pt"})
    return target


def _write_index(policy: Path, shard_name: str) -> None:
    """An index in `policy` mapping every tensor of its `model.safetensors` to `shard_name`."""
    index = {"metadata": {}, "weight_map": dict.fromkeys(load_file(policy / WEIGHTS), shard_name)}
    (policy / "model.safetensors.index.json").write_text(json.dumps(index))


def test_an_index_naming_a_file_outside_the_checkpoint_is_refused(model_dir, served, weights_dir, tmp_path):
    outside = _policy(model_dir("qwen3"), tmp_path / "outside", scale=2.0)
    for n, name in enumerate(("../../outside/model.safetensors", str(outside / WEIGHTS))):
        policy = _policy(model_dir("qwen3"), weights_dir / f"policy-{n}")
        _write_index(policy, name)
        (policy / WEIGHTS).unlink()
        with pytest.raises(ForbiddenWeightsPath, match="outside"):
            read_weights(resolve_weights_path(policy.name, weights_dir), served)
    inside = _policy(model_dir("qwen3"), weights_dir / "sharded")  # a shard in a subfolder is fine
    _write_index(inside, "shards/part.safetensors")
    (inside / "shards").mkdir()
    (inside / WEIGHTS).rename(inside / "shards" / "part.safetensors")
    assert set(read_weights(inside, served)) == {name for name, _ in served.named_parameters()}


@pytest.mark.parametrize("linked", [WEIGHTS, "config.json", "model.safetensors.index.json"])
def test_a_symlink_out_of_the_checkpoint_is_refused(linked, model_dir, served, weights_dir, tmp_path):
    outside = _policy(model_dir("qwen3"), tmp_path / "outside", scale=2.0)
    policy = _policy(model_dir("qwen3"), weights_dir / "policy")
    _write_index(policy, WEIGHTS)
    shutil.copy(policy / "model.safetensors.index.json", outside)
    (policy / linked).unlink()
    (policy / linked).symlink_to(outside / linked)
    with pytest.raises(ForbiddenWeightsPath, match=rf"{re.escape(linked)}.*is outside"):
        read_weights(resolve_weights_path("policy", weights_dir), served)


def _truncate(policy: Path) -> None:
    data = (policy / WEIGHTS).read_bytes()
    (policy / WEIGHTS).write_bytes(data[: len(data) // 2])


def _set_config(policy: Path, **values) -> None:
    config = json.loads((policy / "config.json").read_text())
    (policy / "config.json").write_text(json.dumps({**config, **values}))


BROKEN = {
    "truncated safetensors": (WEIGHTS, _truncate),
    "empty safetensors": (WEIGHTS, lambda p: (p / WEIGHTS).write_bytes(b"")),
    "corrupt config.json": ("config.json", lambda p: (p / "config.json").write_text('{"architectures": [')),
    "config.json not an object": ("config.json", lambda p: (p / "config.json").write_text("[1, 2]")),
    "config.json with a string for a number": ("config.json", lambda p: _set_config(p, rope_theta="high")),
    "config.json with a wrong type": ("config.json", lambda p: _set_config(p, num_attention_heads="many")),
    "corrupt index": (
        "model.safetensors.index.json",
        lambda p: (p / "model.safetensors.index.json").write_text('{"weight_map": {"a": '),
    ),
    "index without weight_map": (
        "model.safetensors.index.json",
        lambda p: (p / "model.safetensors.index.json").write_text('{"metadata": {}}'),
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_checkpoint_is_a_weights_error_naming_the_file(case, model_dir, served, weights_dir):
    file, damage = BROKEN[case]
    policy = _policy(model_dir("qwen3"), weights_dir / "policy")
    damage(policy)
    with pytest.raises(WeightsError, match=re.escape(str(policy / file))):
        read_weights(policy, served)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weights_are_refused(value, model_dir, served, weights_dir):
    policy = _policy(model_dir("qwen3"), weights_dir / "policy")
    tensors = load_file(policy / WEIGHTS)
    tensors["model.layers.1.mlp.down_proj.weight"][3, 4] = value
    save_file(tensors, policy / WEIGHTS)
    with pytest.raises(WeightsError, match=r"layers\.1\.mlp\.down_proj\.weight holds NaN or infinite values"):
        read_weights(policy, served)


def test_the_server_answers_4xx_keeps_its_weights_and_never_goes_back_a_version(
    make_engine, serve, model_dir, weights_dir, tmp_path
):
    engine = make_engine()
    server = serve(engine, weights_dir=weights_dir)
    update = f"{server.url}/update_weights"
    greedy = {"prompt_token_ids": [5, 6, 7], "sampling": {"temperature": 0, "max_tokens": 8}}

    def tokens() -> list[int]:
        return httpx.post(f"{server.url}/generate", json=greedy).json()["outputs"][0]["samples"][0]["token_ids"]

    before = tokens()
    escaping = _policy(model_dir("qwen3"), weights_dir / "escaping")
    _write_index(escaping, str(_policy(model_dir("qwen3"), tmp_path / "outside", scale=3.0) / WEIGHTS))
    (escaping / WEIGHTS).unlink()
    refused = httpx.post(update, json={"path": "escaping", "version": 1})
    assert refused.status_code == 403 and "outside" in refused.json()["error"]["message"]
    truncated = _policy(model_dir("qwen3"), weights_dir / "truncated")
    _truncate(truncated)
    refused = httpx.post(update, json={"path": "truncated", "version": 1})
    assert refused.status_code == 400 and str(truncated / WEIGHTS) in refused.json()["error"]["message"]
    poisoned = _policy(model_dir("qwen3"), weights_dir / "poisoned", scale=float("nan"))
    refused = httpx.post(update, json={"path": poisoned.name, "version": 1})
    assert refused.status_code == 400 and "NaN or infinite" in refused.json()["error"]["message"]
    assert engine.version == 0 and tokens() == before  # nothing was touched

    _policy(model_dir("qwen3"), weights_dir / "policy-2", scale=3.0)
    assert httpx.post(update, json={"path": "policy-2", "version": 2}, timeout=30).status_code == 200
    changed = tokens()
    assert changed != before
    older = httpx.post(update, json={"path": "policy-2", "version": 1})
    assert older.status_code == 409 and "older than the served version 2" in older.json()["error"]["message"]
    again = httpx.post(update, json={"path": "policy-2", "version": 2}, timeout=30)  # a retried update is fine
    assert again.status_code == 200 and engine.version == 2 and tokens() == changed
    back = httpx.post(update, json={"path": "policy-2", "version": 1, "rollback": True}, timeout=30)
    assert back.status_code == 200 and engine.version == 1  # a resumed run's first load, on purpose


def test_the_vllm_routes_check_a_checkpoint_as_the_built_in_server_does(model_dir, weights_dir, tmp_path, monkeypatch):
    """Before vLLM's workers load a checkpoint: a file linking out of it is a 403, an unreadable shard a 400 naming
    the file (not a 500), and a good one passes."""
    from tandem.inference.vllm.routes import SETTINGS_ENV, RouteSettings, TandemRoutes

    settings = RouteSettings(
        model_dir=str(model_dir("qwen3")), model_name="tiny", weights_dir=str(weights_dir), admin_token=None,
        exact_replay=True, run_dir=str(tmp_path), max_body_bytes=1024,
    )  # fmt: skip
    monkeypatch.setenv(SETTINGS_ENV, settings.to_env())
    routes = TandemRoutes(app=None)
    good = _policy(model_dir("qwen3"), weights_dir / "good", scale=2.0)
    routes._check_same_model(good)
    outside = _policy(model_dir("qwen3"), tmp_path / "outside")
    for linked in ("config.json", WEIGHTS):
        policy = _policy(model_dir("qwen3"), weights_dir / f"linked-{linked}")
        (policy / linked).unlink()
        (policy / linked).symlink_to(outside / linked)
        with pytest.raises(ForbiddenWeightsPath, match=rf"{re.escape(linked)}.*is outside"):
            routes._check_same_model(policy)
    truncated = _policy(model_dir("qwen3"), weights_dir / "truncated")
    _truncate(truncated)
    with pytest.raises(WeightsError, match=rf"{re.escape(str(truncated / WEIGHTS))}.*not a readable safetensors"):
        routes._check_same_model(truncated)


def test_both_engines_and_the_in_memory_hand_off_refuse_other_shapes_with_one_check(
    model_dir, served, weights_dir, tmp_path, monkeypatch
):
    """A checkpoint whose config.json is the served model's but whose tensors are not is refused in the same words
    (`check_same_model`) by the built-in engine (from the tensors it read), by the vLLM routes (from the
    safetensors headers) and for an in-memory offer of those tensors."""
    from tandem.inference.vllm.routes import SETTINGS_ENV, RouteSettings, TandemRoutes
    from tandem.transport.weights.control import Offer, check_offer

    policy = _policy(model_dir("qwen3"), weights_dir / "reshaped")
    tensors = load_file(policy / WEIGHTS)
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:-1]
    save_file(tensors, policy / WEIGHTS, metadata={"format": "pt"})
    words = r"norm\.weight has shape \(\d+,\), the served model's \(\d+,\)"
    with pytest.raises(WeightsError, match=words):
        read_weights(policy, served)
    settings = RouteSettings(
        model_dir=str(model_dir("qwen3")), model_name="tiny", weights_dir=str(weights_dir), admin_token=None,
        exact_replay=True, run_dir=str(tmp_path), max_body_bytes=1024,
    )  # fmt: skip
    monkeypatch.setenv(SETTINGS_ENV, settings.to_env())
    with pytest.raises(WeightsError, match=words):
        TandemRoutes(app=None)._check_same_model(policy)
    targets = dict(served.named_parameters())
    manifest = [(name, param.dtype, tuple(param.shape)) for name, param in targets.items()]
    norm = next(name for name in targets if name.endswith("norm.weight"))
    reshaped = [(n, d, (s[0] - 1,)) if n == norm else (n, d, s) for n, d, s in manifest]
    assert re.search(words, check_offer(Offer(1, 1, reshaped), targets))
    assert "different model" in check_offer(Offer(1, 1, manifest[1:]), targets)
    assert check_offer(Offer(1, 1, manifest), targets) is None
