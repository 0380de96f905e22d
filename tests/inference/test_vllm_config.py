"""engine = "vllm" without vLLM itself: the arguments tandem gives it, config checks, and the error when vLLM is
missing (these run whether or not the extra is installed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tandem.cli import main
from tandem.config import ConfigError, load_config
from tandem.config.inference import InferenceConfig
from tandem.config.rl import RlConfig
from tandem.inference.vllm.launch import MIDDLEWARE, WORKER_EXTENSION, vllm_argv


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_the_vllm_arguments_carry_what_tandem_needs():
    config = InferenceConfig(
        engine="vllm", seq_len=512, max_running=32, max_logprobs=5, host="127.0.0.1", port=0, model={"dtype": "float32"}
    )
    argv = vllm_argv(config, Path("/m/tiny"), "tiny", gpu=False)
    assert flag(argv, "--model") == "/m/tiny" and flag(argv, "--served-model-name") == "tiny"
    assert flag(argv, "--host") == "127.0.0.1" and flag(argv, "--port") == "0"
    assert flag(argv, "--max-model-len") == "512" and flag(argv, "--dtype") == "float32"
    assert flag(argv, "--max-num-seqs") == "32" and flag(argv, "--max-logprobs") == "5"
    # logprobs after temperature and truncation, as the built-in engine reports them
    assert flag(argv, "--logprobs-mode") == "processed_logprobs"
    assert flag(argv, "--middleware") == MIDDLEWARE and flag(argv, "--worker-extension-cls") == WORKER_EXTENSION
    assert "--enforce-eager" in argv and "--gpu-memory-utilization" not in argv


def test_gpus_get_cuda_graphs_unless_turned_off_and_extra_arguments_come_last():
    config = InferenceConfig(engine="vllm", vllm_args=["--tensor-parallel-size", "4"], gpu_memory_utilization=0.8)
    argv = vllm_argv(config, Path("/m"), "m", gpu=True)
    assert "--enforce-eager" not in argv and flag(argv, "--gpu-memory-utilization") == "0.8"
    assert argv[-2:] == ["--tensor-parallel-size", "4"]
    assert "--enforce-eager" in vllm_argv(config.model_copy(update={"cuda_graphs": False}), Path("/m"), "m", gpu=True)
    assert "--enforce-eager" not in vllm_argv(config.model_copy(update={"compile": True}), Path("/m"), "m", gpu=False)


def test_an_unknown_engine_is_a_config_error():
    with pytest.raises(ConfigError, match="engine"):
        load_config(InferenceConfig, ["--engine", "sglang"])
    assert load_config(InferenceConfig, ["--engine", "vllm"])[0].engine == "vllm"


def test_without_vllm_installed_the_error_says_how_to_install_it(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` now raises ImportError, as when it is absent
    argv = ["inference", "--engine", "vllm", "--model", str(tiny_model_dir("qwen3")), "--output-dir", str(tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert 'engine "vllm" needs vLLM' in err and 'pip install -e ".[vllm]"' in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--host", "0.0.0.0"], "--admin-token"), (["--seq-len", "100000"], "max_position_embeddings")],
)
def test_vllm_config_mistakes_exit_2_before_vllm_starts(argv, message, tiny_model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TANDEM_ADMIN_TOKEN", raising=False)
    model = ["--model", str(tiny_model_dir("qwen3"))]
    assert main(["inference", "--engine", "vllm", *model, *argv, "--output-dir", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


def truncating_source(**sampling) -> dict:
    return {"orchestrator": {"source": [{"id": "reverse_text", "sampling": sampling}]}}


def test_tandem_rl_refuses_truncated_sampling_on_vllm_unless_exact_replay_is_off():
    with pytest.raises(ValueError, match=r"\['reverse_text'\] sample with top_k/top_p/min_p.*exact_replay = false"):
        RlConfig(inference={"engine": "vllm"}, **truncating_source(top_p=0.9))
    with pytest.raises(ValueError, match="exact_replay"):
        RlConfig(inference={"engine": "vllm"}, **truncating_source(top_k=20))
    RlConfig(inference={"engine": "vllm", "exact_replay": False}, **truncating_source(min_p=0.1))
    RlConfig(inference={"engine": "vllm"}, **truncating_source(temperature=0.7))
    RlConfig(inference={"engine": "builtin"}, **truncating_source(top_p=0.9))  # the built-in engine returns kept ids
