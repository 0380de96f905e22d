"""Hugging Face Hub ids as `model.name`, resolved offline against a Hub cache laid out in a temporary directory
(`models--org--name/refs/main` naming a commit, `snapshots/<commit>/` holding the files) under
`HF_HUB_OFFLINE=1`: nothing here reaches a network."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import huggingface_hub.constants
import pytest

from support.fake_hub import FakeHub
from support.runs import tandem_rl, write_rl_sources
from support.servers import AppThread
from tandem.cli import main
from tandem.config import ConfigError, load_config
from tandem.config.eval import EvalConfig
from tandem.config.inference import InferenceConfig
from tandem.config.rl import RlConfig
from tandem.hub import fetch, is_hub_id, resolve_models

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def add_to_cache(cache: Path, repo_id: str, files: Path, commit: str = COMMIT, ref: str = "main") -> Path:
    """Lay `files` out as the cached snapshot `commit` of `repo_id`, with `ref` naming it; the snapshot's path."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(files, snapshot)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """An empty Hub cache that this process (and every child it starts) uses, offline."""
    home = tmp_path / "hf"
    cache = home / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))  # both read once, at import
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return cache


@pytest.mark.parametrize(
    ("name", "expected"),
    [("Qwen/Qwen3-0.6B", True), ("gpt2", True), ("org/name.v2_b", True), ("./model", False), ("/abs/dir", False),
     ("a/b/c", False), ("../up", False), ("org/../x", False), ("", False), ("~/model", False)],
)  # fmt: skip
def test_hub_ids_are_told_from_paths(name, expected):
    assert is_hub_id(name) is expected


@pytest.mark.parametrize(
    "name", ["a" * 97, "org/" + "b" * 97, "a/b.", "a" * 10_000, "a-/b", "org/x--y", "org/x.git"],
    ids=["97-chars", "97-char-name", "trailing-dot", "10000-chars", "trailing-dash", "double-dash", "dot-git"],
)  # fmt: skip
def test_an_id_the_hubs_rules_refuse_is_one_line_and_exit_2(name, hub_cache, capsys):
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    with pytest.raises(HFValidationError):
        validate_repo_id(name)  # the case is one huggingface_hub itself refuses
    assert main(["inference", "--model.name", name]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and len(err) < 600, err[:300]
    assert err.startswith("tandem inference: error: model ") and "not a valid Hugging Face repo id" in err


def test_the_longest_valid_ids_are_still_hub_ids(hub_cache):
    for name in ("a" * 96, f"{'o' * 96}/{'n' * 96}", "Foo-BAR_foo.bar123"):
        assert is_hub_id(name)
        with pytest.raises(ConfigError, match="not in the Hugging Face cache"):
            fetch(name)  # validated, then looked up


def test_an_existing_directory_is_never_a_hub_id(tmp_path, monkeypatch):
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert not is_hub_id("org/name")


def test_a_cached_repo_resolves_to_its_snapshot(hub_cache, tiny_model_dir):
    snapshot = add_to_cache(hub_cache, "acme/tiny", tiny_model_dir("qwen3"))
    assert fetch("acme/tiny") == snapshot
    other = add_to_cache(hub_cache, "acme/tiny", tiny_model_dir("qwen3"), commit="f" * 40, ref="v2")
    assert fetch("acme/tiny", "v2") == other


def test_every_model_of_an_rl_config_resolves_to_one_snapshot_served_under_the_hub_id(hub_cache, tiny_model_dir):
    snapshot = add_to_cache(hub_cache, "acme/tiny", tiny_model_dir("qwen3"))
    config, _ = load_config(RlConfig, ["--model", "acme/tiny"])
    resolve_models(config)
    assert config.model.name == config.trainer.model.name == str(snapshot)
    assert config.inference.model.name == config.orchestrator.model.name == str(snapshot)
    assert config.inference.served_model_name == "acme/tiny"


def test_an_evals_built_in_server_serves_the_hub_id(hub_cache, tiny_model_dir):
    snapshot = add_to_cache(hub_cache, "acme/tiny", tiny_model_dir("qwen3"))
    config, _ = load_config(EvalConfig, ["--model", "acme/tiny"])
    resolve_models(config)
    assert (config.model.name, config.served_model_name) == (str(snapshot), "acme/tiny")


def test_a_name_the_user_gave_the_server_is_kept(hub_cache, tiny_model_dir):
    add_to_cache(hub_cache, "acme/tiny", tiny_model_dir("qwen3"))
    config, _ = load_config(InferenceConfig, ["--model", "acme/tiny", "--served-model-name", "mine"])
    resolve_models(config)
    assert config.served_model_name == "mine"


def test_a_repo_missing_from_the_cache_offline_says_how_to_get_it(hub_cache):
    with pytest.raises(ConfigError, match="not in the Hugging Face cache and HF_HUB_OFFLINE is set"):
        fetch("acme/absent")


def test_a_repo_without_safetensors_is_refused_and_its_pickle_never_read(hub_cache, tiny_model_dir, tmp_path):
    files = tmp_path / "pickled"
    shutil.copytree(tiny_model_dir("qwen3"), files)
    for weights in files.glob("*.safetensors"):
        weights.rename(files / "pytorch_model.bin")
    add_to_cache(hub_cache, "acme/pickled", files)
    with pytest.raises(ConfigError, match=r"no \*\.safetensors weights"):
        fetch("acme/pickled")
    assert fetch("acme/pickled", weights=False).is_dir()  # the orchestrator needs only the tokenizer


def test_a_repo_without_config_is_no_model(hub_cache, tmp_path):
    files = tmp_path / "data-only"
    files.mkdir()
    (files / "train.jsonl").write_text(json.dumps({"text": "x"}) + "\n")
    add_to_cache(hub_cache, "acme/data-only", files)
    with pytest.raises(ConfigError, match=r"has no config\.json"):
        fetch("acme/data-only", weights=False)


@pytest.mark.slow
def test_tandem_rl_runs_on_a_hub_id(hub_cache, tiny_model_dir, tmp_path):
    snapshot = add_to_cache(hub_cache, "acme/tiny", tiny_model_dir("qwen3"))
    result = tandem_rl(
        Path("acme/tiny"), tmp_path, "@", write_rl_sources(tmp_path), "--max-steps", "2", "--orchestrator.eval.interval", "0",
        "--orchestrator.no-filter-zero-advantage",
    )  # fmt: skip
    run_dir = tmp_path / "rl"
    for process in ("trainer", "inference", "orchestrator"):
        assert f'name = "{snapshot}"' in (run_dir / f"{process}.toml").read_text(), process
    assert json.loads((run_dir / "server.json").read_text())["model"] == "acme/tiny"
    assert "model acme/tiny:" in result.stderr


@pytest.fixture
def fake_hub(hub_cache, monkeypatch) -> Iterator[FakeHub]:
    """A loopback Hub that `HF_ENDPOINT` points at, online (this process only: huggingface_hub read the
    endpoint at import)."""
    hub = FakeHub()
    with AppThread(hub.app()) as server:
        monkeypatch.delenv("HF_HUB_OFFLINE")
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", server.url)
        monkeypatch.setattr(
            huggingface_hub.constants,
            "HUGGINGFACE_CO_URL_TEMPLATE",
            server.url + "/{repo_id}/resolve/{revision}/{filename}",
        )
        yield hub


def test_a_download_fetches_safetensors_config_and_tokenizer_and_never_a_pickle(fake_hub, tiny_model_dir, tmp_path):
    files = tmp_path / "repo"
    shutil.copytree(tiny_model_dir("qwen3"), files)
    (files / "pytorch_model.bin").write_bytes(b"a pickle that must never be fetched")
    (files / "README.md").write_text("# a model card\n")
    repo = fake_hub.add("acme/tiny", files)
    path = fetch("acme/tiny")
    assert path.parts[-2:] == ("snapshots", repo.commit)
    fetched = sorted(p.name for p in path.iterdir())
    assert "pytorch_model.bin" not in fetched and "README.md" not in fetched
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(fetched)
    assert all(not name.endswith((".bin", ".md")) for name in fake_hub.served)
    assert (path / "model.safetensors").read_bytes() == (files / "model.safetensors").read_bytes()


def test_missing_and_gated_repos_are_one_line_errors(fake_hub, tiny_model_dir, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    fake_hub.add("acme/gated", tiny_model_dir("qwen3"), gated=True)
    with pytest.raises(ConfigError, match="no Hugging Face repo of that id"):
        fetch("acme/absent")
    with pytest.raises(ConfigError, match="gated repo: accept its terms"):
        fetch("acme/gated")
