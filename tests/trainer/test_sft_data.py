"""SFT data: the assistant-only loss mask comes from the chat template; bad rows; packing."""

from __future__ import annotations

import json

import pytest
import torch

from tandem.trainer.batching import balance_rows, step_indices
from tandem.trainer.data import BadRow, DatasetError, Sample, load_samples, pack, pad_each, read_jsonl, tokenize_row


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir("qwen3"))


def masked_text(tokenizer, sample: Sample) -> str:
    return tokenizer.decode([t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m])


def test_chat_loss_mask_is_exactly_the_assistant_turns(tokenizer):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "reverse: abc"},
        {"role": "assistant", "content": "cba"},
        {"role": "user", "content": "reverse: hello"},
        {"role": "assistant", "content": "olleh"},
    ]
    sample = tokenize_row({"messages": messages}, tokenizer)
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert tokenizer.decode(sample.input_ids) == rendered
    # Exactly what the template writes for each assistant turn after the generation prompt.
    assert masked_text(tokenizer, sample) == "cba<|im_end|>\nolleh<|im_end|>\n"
    learned = [i for i, m in enumerate(sample.loss_mask) if m]
    prompt = tokenizer.apply_chat_template(messages[:2], add_generation_prompt=True, tokenize=False)
    prompt_len = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    assert learned[0] == prompt_len  # the first learned token directly follows "<|im_start|>assistant\n"


def test_prompt_completion_rows_learn_completion_and_eos(tokenizer):
    sample = tokenize_row({"prompt": "2+2=", "completion": "4"}, tokenizer)
    assert masked_text(tokenizer, sample) == "4<|im_end|>"
    assert not any(sample.loss_mask[: len(tokenizer("2+2=")["input_ids"])])


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ({"text": "x"}, "neither `messages` nor `prompt`/`completion`"),
        ({"prompt": "x", "completion": ""}, "empty `completion`"),
        ({"prompt": 3, "completion": "x"}, "must both be strings"),
        ({"messages": []}, "non-empty list"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "no non-empty assistant message"),
        ({"messages": [{"role": "assistant"}]}, "no string `content`"),
        ([1, 2], "not a JSON object"),
    ],
)
def test_bad_rows_say_why(tokenizer, row, reason):
    with pytest.raises(BadRow, match=reason):
        tokenize_row(row, tokenizer)


def write_rows(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_bad_rows_skip_and_count_or_fail_with_row_number(tokenizer, tmp_path):
    good = {"prompt": "a", "completion": "b"}
    path = write_rows(
        tmp_path / "d.jsonl",
        [good, "{not json", {"prompt": "a"}, good, {"prompt": "x " * 400, "completion": "y"}, good],
    )
    samples, report = load_samples(read_jsonl(path), tokenizer, seq_len=64, on_bad_row="skip")
    assert len(samples) == 3
    assert report.total == 3
    assert report.examples["invalid JSON"] == [2]
    assert report.examples["longer than seq_len"] == [5]
    with pytest.raises(DatasetError, match=r"row 2: invalid JSON"):
        load_samples(read_jsonl(path), tokenizer, seq_len=64, on_bad_row="fail")
    with pytest.raises(DatasetError, match="not found"):
        list(read_jsonl(tmp_path / "missing.jsonl"))


def test_a_line_that_is_not_utf8_is_a_bad_row_not_a_crash(tokenizer, tmp_path):
    path = tmp_path / "mixed.jsonl"
    good = json.dumps({"prompt": "a", "completion": "b"}).encode()
    path.write_bytes(b"\n".join([good, b'{"prompt": "caf\xe9", "completion": "b"}', good]) + b"\n")
    samples, report = load_samples(read_jsonl(path), tokenizer, seq_len=64, on_bad_row="skip")
    assert len(samples) == 2 and report.examples == {"not UTF-8 text": [2]}
    with pytest.raises(DatasetError, match=r"row 2: not UTF-8 text \(invalid byte at column 16\)"):
        load_samples(read_jsonl(path), tokenizer, seq_len=64, on_bad_row="fail")


def test_a_line_nested_past_the_parser_is_a_bad_row_not_a_crash(tokenizer, tmp_path):
    path = tmp_path / "deep.jsonl"
    good = json.dumps({"prompt": "a", "completion": "b"})
    path.write_text("\n".join([good, "[" * 100_000, good]) + "\n")
    samples, report = load_samples(read_jsonl(path), tokenizer, seq_len=64, on_bad_row="skip")
    assert len(samples) == 2 and report.examples == {"invalid JSON": [2]}


def test_packing_restarts_positions_and_keeps_targets_inside_documents():
    samples = [
        Sample([1, 2, 3], [False, True, True]),
        Sample([4, 5], [False, True]),
        Sample([6, 7, 8, 9], [False] + [True] * 3),
    ]
    rows = pack(samples, seq_len=6, pad_id=0)
    assert len(rows) == 2
    first = rows[0]
    assert first.input_ids.tolist() == [1, 2, 3, 4, 5, 0]
    assert first.position_ids.tolist() == [0, 1, 2, 0, 1, 0]
    # A document's last token predicts nothing: no target leaks into the next document.
    assert first.target_ids.tolist()[:5] == [2, 3, 0, 5, 0]
    assert first.loss_mask.tolist() == [True, True, False, True, False, False]
    assert first.num_real == 5
    padded = pad_each(samples, seq_len=6, pad_id=0)
    assert [row.num_real for row in padded] == [3, 2, 4]
    assert sum(int(r.loss_mask.sum()) for r in rows) == sum(int(r.loss_mask.sum()) for r in padded) == 6


def test_step_rows_depend_only_on_seed_and_step():
    assert step_indices(3, 4, 10, seed=1) == step_indices(3, 4, 10, seed=1)
    epoch = [i for s in range(5) for i in step_indices(s, 2, 10, seed=1)]
    assert sorted(epoch) == list(range(10))  # one epoch covers each row once
    assert step_indices(0, 4, 10, seed=1) != step_indices(0, 4, 10, seed=2)


def test_balance_gives_equal_counts_and_even_tokens():
    rows = [pad_each([Sample([1] * n, [False] + [True] * (n - 1))], 10, 0)[0] for n in (9, 1, 8, 2, 7, 3, 6, 4)]
    groups = balance_rows(rows, 2)
    assert [len(g) for g in groups] == [4, 4]
    assert [sum(r.num_real for r in g) for g in groups] == [20, 20]
    with pytest.raises(ValueError, match="evenly"):
        balance_rows(rows[:3], 2)
    assert torch.equal(groups[0][0].input_ids, rows[0].input_ids)
