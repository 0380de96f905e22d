"""SFT data as a Hugging Face dataset (the `datasets` extra): a local dataset directory, or a Hub dataset id fetched
from a loopback Hub (`support.fake_hub`) into a Hugging Face home under the test's temporary directory, then read
back from that cache under `HF_HUB_OFFLINE=1`. Every mistake is one ConfigError from `check_inputs`, before a run
directory or a model exists. Nothing here reaches a network."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.fake_hub import FakeHub, set_offline, use_endpoint, use_hub_home
from support.runs import tandem_sft
from support.servers import AppThread
from tandem.cli import main
from tandem.config import ConfigError, load_config
from tandem.config.sft import SftConfig
from tandem.trainer.sft import build_steps, check_inputs

datasets = pytest.importorskip("datasets")

PAIRS = [{"prompt": f"reverse {word}", "completion": word[::-1]} for word in ("tiger", "planet", "honey", "candle")]
CHATS = [
    {"messages": [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["completion"]}]}
    for row in PAIRS
]


@pytest.fixture
def hf_home(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face home (Hub and datasets caches) for this process and its children, offline."""
    use_hub_home(tmp_path / "hf", monkeypatch)
    return tmp_path / "hf"


@pytest.fixture
def hub(hf_home, monkeypatch) -> Iterator[FakeHub]:
    """A loopback Hub serving `acme/pairs` (prompt/completion rows as parquet: a train and a test split), online."""
    hub = FakeHub()
    with AppThread(hub.app()) as server:
        set_offline(False, monkeypatch)
        use_endpoint(server.url, monkeypatch)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        yield hub


def parquet_repo(folder: Path, rows: list[dict], test_rows: list[dict] | None = None) -> Path:
    """`rows` as the train split of a Hub-style parquet dataset repo under `folder` (and `test_rows` as its test)."""
    (folder / "data").mkdir(parents=True)
    datasets.Dataset.from_list(rows).to_parquet(folder / "data" / "train-00000-of-00001.parquet")
    if test_rows is not None:
        datasets.Dataset.from_list(test_rows).to_parquet(folder / "data" / "test-00000-of-00001.parquet")
    return folder


def sft_config(model: Path, data: str | Path, *flags: str) -> SftConfig:
    return load_config(SftConfig, ["--model", str(model), "--data.path", str(data), "--seq-len", "64", *flags])[0]


def trained_rows(config: SftConfig) -> int:
    """Check the inputs and build the steps, as `tandem sft` does; the number of samples the steps draw from."""
    steps = build_steps(config, check_inputs(config))
    return int(sum(row.loss_mask.any() for row in steps(0)))


def test_a_saved_dataset_directory_is_read_like_jsonl(tiny_model_dir, tmp_path, hf_home):
    for rows, name in ((PAIRS, "pairs"), (CHATS, "chats")):
        datasets.Dataset.from_list(rows).save_to_disk(tmp_path / name)
        config = sft_config(tiny_model_dir("qwen3"), tmp_path / name, "--batch-size", "2")
        inputs = check_inputs(config)
        assert inputs.data is None and len(inputs.dataset) == 4
        assert trained_rows(config) > 0


def test_a_directory_of_parquet_files_and_a_saved_dataset_dict_read_their_split(tiny_model_dir, tmp_path, hf_home):
    model = tiny_model_dir("qwen3")
    parquet_repo(tmp_path / "files", PAIRS, test_rows=PAIRS[:1])
    assert len(check_inputs(sft_config(model, tmp_path / "files", "--data.split", "test")).dataset) == 1
    saved = tmp_path / "saved"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(CHATS), "eval": datasets.Dataset.from_list(CHATS[:2])}
    ).save_to_disk(saved)
    assert len(check_inputs(sft_config(model, saved, "--data.split", "eval")).dataset) == 2
    with pytest.raises(ConfigError, match=r"data.split 'dev': dataset .*saved has no such split; it has train, eval"):
        check_inputs(sft_config(model, saved, "--data.split", "dev"))


def test_a_hub_dataset_is_downloaded_once_then_read_offline_from_the_cache(tiny_model_dir, tmp_path, hub, monkeypatch):
    hub.add("acme/pairs", parquet_repo(tmp_path / "repo", PAIRS, test_rows=PAIRS[:1]), "dataset")
    config = sft_config(tiny_model_dir("qwen3"), "acme/pairs", "--batch-size", "2")
    assert len(check_inputs(config).dataset) == 4
    assert hub.served == ["acme/pairs/data/train-00000-of-00001.parquet", "acme/pairs/data/test-00000-of-00001.parquet"]
    assert any((tmp_path / "hf" / "hub").glob("datasets--acme--pairs/snapshots/*/data/*.parquet"))
    hub.repos.clear()  # and offline: the Hub is never asked again
    set_offline(True, monkeypatch)
    assert trained_rows(config) > 0
    with pytest.raises(
        ConfigError, match="acme/absent is not in the Hugging Face datasets cache and HF_HUB_OFFLINE is set"
    ):
        check_inputs(sft_config(tiny_model_dir("qwen3"), "acme/absent"))


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (
            ["--data.path", "acme/absent"],
            r"acme/absent: no such file or directory, and no Hugging Face dataset repo of that id",
        ),
        (
            ["--data.path", "acme/gated"],
            r"acme/gated is a gated dataset: accept its terms on huggingface.co, then set HF_TOKEN",
        ),
        (["--data.split", "dev"], r"data.split 'dev': dataset acme/pairs has no such split; it has train, test$"),
        (["--data.revision", "v9"], r"acme/pairs@v9: the dataset repo has no revision `v9`"),
        (["--data.subset", "fr"], r"dataset acme/pairs has no subset 'fr'; its subsets are default$"),
        (
            ["--data.path", "acme/columns"],
            r"acme/columns \(split train\) has columns question, answer; tandem trains on a `messages`",
        ),
    ],
    ids=["missing-repo", "gated", "missing-split", "missing-revision", "missing-subset", "wrong-columns"],
)
def test_each_hub_mistake_is_one_config_error(tiny_model_dir, tmp_path, hub, flags, expected):
    hub.add("acme/pairs", parquet_repo(tmp_path / "pairs", PAIRS, test_rows=PAIRS[:1]), "dataset")
    hub.add("acme/gated", parquet_repo(tmp_path / "gated", PAIRS), "dataset", gated=True)
    hub.add("acme/columns", parquet_repo(tmp_path / "columns", [{"question": "1+1", "answer": "2"}]), "dataset")
    with pytest.raises(ConfigError, match=expected):
        check_inputs(sft_config(tiny_model_dir("qwen3"), "acme/pairs", *flags))


def test_without_the_datasets_extra_a_dataset_says_what_to_install(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    with pytest.raises(ConfigError, match=r"needs the datasets extra: pip install 'tandem\[datasets\]'"):
        check_inputs(sft_config(tiny_model_dir("qwen3"), "acme/pairs"))


def test_a_bad_dataset_fails_before_the_run_directory_or_model_exist(tiny_model_dir, tmp_path, hf_home, capsys):
    datasets.Dataset.from_list([{"text": "no prompt here"}]).save_to_disk(tmp_path / "text")
    capsys.readouterr()
    model, out = str(tiny_model_dir("qwen3")), str(tmp_path / "out")
    code = main(["sft", "--model", model, "--data.path", str(tmp_path / "text"), "--output-dir", out])
    err = capsys.readouterr().err
    assert code == 2 and "has columns text; tandem trains on" in err.splitlines()[-1] and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_tandem_sft_trains_on_a_cached_hub_dataset_offline(tiny_model_dir, tmp_path, hub, monkeypatch):
    hub.add("acme/chats", parquet_repo(tmp_path / "repo", CHATS * 4), "dataset")
    config = sft_config(tiny_model_dir("qwen3"), "acme/chats")
    check_inputs(config)  # into the cache, online; the run is offline, in a child process
    set_offline(True, monkeypatch)
    out = tmp_path / "out"
    result = tandem_sft(
        "--model", str(tiny_model_dir("qwen3")), "--model.dtype", "float32", "--data.path", "acme/chats",
        "--seq-len", "64", "--batch-size", "2", "--max-steps", "2", "--output-dir", str(out), "--run-name", "hub",
    )  # fmt: skip
    assert "data acme/chats: 16 rows (split train, columns messages)" in result.stderr
    assert (out / "hub" / "hf" / "final" / "model.safetensors").is_file()
