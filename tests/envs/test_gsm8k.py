"""GSM8K: the answer parser on real reference answers and model-style completions, loading, and the reward."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys

import pytest

from tandem.envs import SelectConfig, apply_select, load_taskset
from tandem.envs.builtin.gsm8k import parse_gsm8k_answer
from tandem.testing.progress import run_while_progressing

MODEL_STYLE = [
    ("The answer is 1,234.", "1234"),
    ("$18", "18"),
    ("She makes $18.00 a day.", "18"),
    ("\\boxed{42}", "42"),
    ("So the total is \\boxed{1,450,000}.", "1450000"),
    ("First 3 + 4 = 7, so \\boxed{\\$7} and then 99 more words", "7"),
    ("\\boxed{\\frac{3}{4} + 1 = 18}", "18"),
    ("42 dollars", "42"),
    ("-3.5", "-3.5"),
    ("It was -3 degrees Celsius in the morning.", "-3"),
    ("It was \u22123 degrees.", "-3"),
    ("**72**", "72"),
    ("The final answer is **72**.", "72"),
    ("That makes 540 meters.", "540"),
    ("He pays 5 + 6 = 11, then 11 * 2 = 22", "22"),
    ("Step 1: 10 apples. Step 2: 3 eaten. Answer: 7", "7"),
    ("#### 18\nI hope this helps with 3 more problems!", "18"),
    ("Reasoning with 5 and 6... #### 1,234", "1234"),
    ("A 50% discount on 80 leaves 40.", "40"),
    ("It costs 0.50 each", "0.5"),
    ("In total $3,000.50 was spent.", "3000.5"),
    ("They lost -$25 overall", "-25"),
    ("From 5-3 we get 2 left", "2"),
    ("72.0", "72"),
    ("The numbers 1,2,3", "3"),
    ("No number here.", None),
    ("#### no number", None),
    ("", None),
]


@pytest.mark.parametrize(("text", "expected"), MODEL_STYLE)
def test_parser_on_model_style_completions(text, expected):
    assert parse_gsm8k_answer(text) == expected


def real_rows(path, idxs):
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    return {i: rows[i]["answer"] for i in idxs}


@pytest.mark.parametrize(
    ("idx", "expected"),
    [(0, "18"), (1, "3"), (2, "70000"), (146, "2125"), (489, "-10"), (611, "1450000"), (1113, "-3")],
)
def test_parser_on_real_reference_answers(gsm8k_path, idx, expected):
    """Plain, `<<calc>>`-annotated, comma-grouped (`#### 2,125`) and negative references from the test split."""
    assert parse_gsm8k_answer(real_rows(gsm8k_path, [idx])[idx]) == expected


def test_every_reference_parses_to_its_hash_line(gsm8k_path):
    with open(gsm8k_path, encoding="utf-8") as f:
        for line in f:
            answer = json.loads(line)["answer"]
            assert parse_gsm8k_answer(answer) == answer.rsplit("####", 1)[1].strip().replace(",", "")


def test_loads_from_local_jsonl(gsm8k_path):
    taskset = load_taskset("gsm8k", path=str(gsm8k_path))
    tasks = taskset.tasks()
    assert len(tasks) == 1319
    first = tasks[0]
    assert (first.idx, first.id, first.name, first.answer) == (0, "gsm8k-test-0", "gsm8k", "18")
    assert "Janet" in first.prompt and first.info["solution"].endswith("#### 18")
    assert first.model_validate_json(first.model_dump_json()) == first
    picked = apply_select(taskset, SelectConfig.model_validate({"include": {"ids": ["gsm8k-test-146"]}}))
    assert [t.answer for t in picked] == ["2125"]


def test_reward_on_correct_and_incorrect_answers(gsm8k_path):
    taskset = load_taskset("gsm8k", path=str(gsm8k_path))
    task = taskset.tasks()[2]  # answer 70000

    def reward(completion):
        return asyncio.run(taskset.score(task, completion)).reward

    assert reward("He made a profit of $70,000.\n#### 70,000") == 1.0
    assert reward("The profit is \\boxed{70000}") == 1.0
    assert reward("200,000 - 130,000 = 70,000 dollars") == 1.0
    assert reward("#### 70000.5") == 0.0
    assert reward("#### 70000 is wrong, it is 5") == 1.0  # `####` wins over later numbers
    assert reward("I think 70000 is not it; the answer is 130,000") == 0.0
    assert reward("I don't know") == 0.0


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"args\.path"):
        load_taskset("gsm8k", path=str(tmp_path / "absent.jsonl"))


def test_reference_without_answer_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "no final line"}) + "\n")
    with pytest.raises(ValueError, match="row 0: no final number"):
        load_taskset("gsm8k", path=str(bad)).tasks()


def test_online_without_datasets_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail; never reaches the hub
    with pytest.raises(ImportError, match="pip install datasets"):
        load_taskset("gsm8k").tasks()


def test_an_unreachable_hub_fails_at_once_naming_args_path(monkeypatch):
    """One request finds the Hub unreachable: no `datasets` retries for half a minute, and the error says how
    to use a local file instead."""
    import datasets
    from huggingface_hub import constants

    with socket.socket() as probe:  # a port nothing listens on: the connection is refused
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("asked the unreachable Hub again"))
    with pytest.raises(ConnectionError, match=r"cannot be reached.*args\.path.*\.\./shared/data/gsm8k/test\.jsonl"):
        load_taskset("gsm8k").tasks()


def test_offline_without_a_cached_copy_is_one_line_naming_args_path(tmp_path):
    """Under HF_HUB_OFFLINE a dataset the cache lacks is one line on the console, pointing at args.path."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "NO_COLOR": "1"}
    env.pop("HF_DATASETS_OFFLINE", None)
    env.pop("HF_DATASETS_CACHE", None)
    env.pop("HF_HUB_CACHE", None)
    result = run_while_progressing(
        [sys.executable, "-m", "tandem", "eval", "gsm8k", "--base-url", "http://127.0.0.1:9/v1", "--model", "m",
         "--output-dir", str(tmp_path / "outputs")],
        env=env,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert "HF_HUB_OFFLINE is set" in result.stderr and "args.path" in result.stderr
    assert "../shared/data/gsm8k/test.jsonl" in result.stderr
    assert not (tmp_path / "outputs").exists()
