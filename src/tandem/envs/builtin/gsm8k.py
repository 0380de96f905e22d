"""gsm8k: grade-school math word problems; reward 1 when the final number matches the reference.

Rows come from a local JSONL (`path`, fields `question` and `answer`) or, when
online, from `openai/gsm8k` through `datasets` (imported only then). GSM8K
references end with `#### <number>`; the same parser reads references and
model completions.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tandem.envs.base import Task, Taskset, reward
from tandem.envs.numbers import extract_boxed, extract_final_number, find_numbers

PROMPT = "{question}\n\nSolve the problem step by step, then give the final answer on its own line as '#### <number>'."


def parse_gsm8k_answer(text: str) -> str | None:
    """The final answer in canonical form, or None.

    In order of precedence: the first number after the last `####` (the GSM8K
    format), the last number inside the last `\\boxed{}`, the last number anywhere.
    """
    if "####" in text:
        after = find_numbers(text.rsplit("####", 1)[1])
        return after[0] if after else None
    boxed = extract_boxed(text)
    if boxed is not None:
        return extract_final_number(boxed)
    return extract_final_number(text)


LOCAL_FILE = 'pass args.path to a local JSONL of `question` and `answer` rows (args = {path = "../shared/data/gsm8k/test.jsonl"})'


def _load_rows(path: str | None, dataset: str, subset: str, split: str) -> list[dict[str, Any]]:
    if path is not None:
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    return _hub_rows(dataset, subset, split)


def _hub_rows(dataset: str, subset: str, split: str) -> list[dict[str, Any]]:
    """`dataset` from the Hub through `datasets`, or its cached copy offline. Reachability is asked once first:
    `datasets` retries a Hub it cannot reach for half a minute before it gives up."""
    try:
        import datasets
    except ImportError:
        raise ImportError(
            f"gsm8k without `path` loads from the Hugging Face hub and needs `datasets` (pip install datasets); or "
            f"{LOCAL_FILE}"
        ) from None
    offline = datasets.config.HF_HUB_OFFLINE  # HF_HUB_OFFLINE or HF_DATASETS_OFFLINE, as `datasets` read them
    if not offline and not Path(dataset).exists() and (unreachable := _hub_unreachable(dataset)):
        raise ConnectionError(
            f"gsm8k: the Hugging Face Hub cannot be reached to load {dataset} ({unreachable}); {LOCAL_FILE}"
        )
    try:
        return list(datasets.load_dataset(dataset, subset, split=split))
    except ConnectionError:
        if not offline:
            raise
        raise ConnectionError(
            f"gsm8k: {dataset} is not in the datasets cache and HF_HUB_OFFLINE is set; {LOCAL_FILE}"
        ) from None


def _hub_unreachable(dataset: str) -> str:
    """Why one request to the Hub about `dataset` got no answer, or "" if the Hub answered (with any status:
    a missing or gated dataset is `datasets`' error to report)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError

    try:
        HfApi().dataset_info(dataset)
    except (HfHubHTTPError, HFValidationError):
        return ""
    except Exception as error:  # the HTTP client's own transport errors: no connection, DNS, TLS, timeout
        return str(error).splitlines()[0] if str(error) else type(error).__name__
    return ""


def _reference(solution: str, idx: int) -> str:
    answer = parse_gsm8k_answer(solution)
    if answer is None:
        raise ValueError(f"gsm8k row {idx}: no final number in the reference answer {solution[-80:]!r}")
    return answer


class GSM8K(Taskset):
    """GSM8K from `path` (a local JSONL) or from `dataset`/`subset`/`split` on the hub."""

    def __init__(
        self, path: str | None = None, split: str = "test", dataset: str = "openai/gsm8k", subset: str = "main"
    ) -> None:
        if path is not None and not Path(path).is_file():
            raise FileNotFoundError(f"gsm8k: no such file {path!r} (args.path)")
        self.path, self.split, self.dataset, self.subset = path, split, dataset, subset

    def tasks(self) -> list[Task]:
        label = Path(self.path).stem if self.path is not None else self.split
        rows = _load_rows(self.path, self.dataset, self.subset, self.split)
        return [
            Task(
                idx=i,
                id=f"gsm8k-{label}-{i}",
                name="gsm8k",
                prompt=PROMPT.format(question=row["question"]),
                answer=_reference(row["answer"], i),
                info={"solution": row["answer"]},
            )
            for i, row in enumerate(rows)
        ]

    @reward
    def correct(self, completion: str, answer: str) -> float:
        return float(parse_gsm8k_answer(completion) == answer)
