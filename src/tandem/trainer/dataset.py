"""Where SFT's rows come from: `data.path` as a local JSONL file, a dataset directory (what `datasets`'
`save_to_disk` wrote, or a folder of data files) or a Hugging Face Hub dataset id, found and checked before the
run directory or the model exists. A JSONL file is read row by row later (`tandem.trainer.data.read_jsonl`); a
dataset is loaded here, once, through `datasets` and its cache, and every way that fails is one ConfigError that
says what to do.
"""

from __future__ import annotations

import ast
import logging
import re
from pathlib import Path
from typing import Any

from tandem.config import ConfigError
from tandem.config.sft import SftConfig
from tandem.run import setup_logging

logger = logging.getLogger(__name__)


def local_data_file(config: SftConfig) -> Path | None:
    """The local JSONL file `data.path` names, checked to be a file; None for a dataset directory or a Hugging
    Face Hub dataset id (anything that is neither an existing path nor a `.jsonl` one)."""
    path = Path(config.data.path)
    if path.is_dir():
        if not any(entry.is_file() for entry in path.rglob("*")):
            raise ConfigError(
                f"data.path {path} is not a file (a JSONL file of prompt/completion or messages rows), and as a "
                "dataset directory it is empty"
            )
        return None
    if not (path.suffix == ".jsonl" or path.exists()):
        return None
    if not path.exists():
        raise ConfigError(f"data.path {path}: no such file")
    if not path.is_file():
        raise ConfigError(f"data.path {path} is not a file (a JSONL file of prompt/completion or messages rows)")
    return path


SAVED_DATASET_FILES = ("state.json", "dataset_dict.json")
"""`datasets`' `save_to_disk` writes one of these: such a directory is read with `load_from_disk`."""


def load_hf_dataset(config: SftConfig):
    """The `datasets.Dataset` that `data` names: a directory `save_to_disk` wrote, a directory of data files
    (parquet, JSONL, CSV, ...), or a Hub dataset id, read through `datasets` and its cache (`HF_HOME`,
    `HF_DATASETS_CACHE`, `HF_TOKEN`, `HF_HUB_OFFLINE` mean what they mean to every Hugging Face tool). Every way
    that fails, and a dataset without the columns tandem trains on, is one ConfigError."""
    data = config.data
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            f"data.path {data.path} is not a JSONL file, and reading it as a Hugging Face dataset needs the datasets "
            "extra: pip install 'tandem[datasets]'"
        ) from None
    directory = Path(data.path) if Path(data.path).is_dir() else None
    at = f"{data.path}@{data.revision}" if data.revision else data.path
    if directory is not None and data.revision:
        raise ConfigError(
            f"data.revision {data.revision!r} is for a Hub dataset id; data.path {at} is a local directory"
        )
    if not logging.getLogger().handlers:  # loading logs before the run directory (and its log) exists
        setup_logging(config.log.level)
    try:
        if directory is not None and any((directory / name).is_file() for name in SAVED_DATASET_FILES):
            dataset = _split_of(datasets.load_from_disk(str(directory)), data.split, at)
        else:
            if directory is None and not datasets.config.HF_HUB_OFFLINE:
                logger.info("data %s: loading from the Hugging Face Hub (cached after the first time)", at)
            dataset = datasets.load_dataset(
                data.path, name=data.subset or None, split=data.split, revision=data.revision or None
            )
    except ConfigError:
        raise
    except Exception as error:  # every failure of `datasets` and the Hub below it, as one line
        raise _dataset_error(error, config, at, hub=directory is None, offline=datasets.config.HF_HUB_OFFLINE) from None
    columns = list(dataset.column_names)
    if "messages" not in columns and not {"prompt", "completion"} <= set(columns):
        raise ConfigError(
            f"data.path {at} (split {data.split}) has columns {', '.join(columns) or '(none)'}; tandem trains on a "
            "`messages` column (chat) or on `prompt` and `completion` columns"
        )
    logger.info("data %s: %d rows (split %s, columns %s)", at, len(dataset), data.split, ", ".join(columns))
    return dataset


def _split_of(saved: Any, split: str, at: str) -> Any:
    """One split of what `load_from_disk` read: a DatasetDict's `split`, or a lone Dataset as it is."""
    if not hasattr(saved, "keys"):
        return saved
    if split not in saved:
        raise ConfigError(f"data.split {split!r}: dataset {at} has no such split; it has {', '.join(saved.keys())}")
    return saved[split]


def _listed(text: str) -> str | None:
    """The names in the first `[...]` Python list of a `datasets` message, comma-separated."""
    found = re.search(r"\[[^\]]*\]", text)
    try:
        return ", ".join(map(str, ast.literal_eval(found.group(0)))) if found else None
    except (ValueError, SyntaxError):
        return None


def _dataset_error(error: Exception, config: SftConfig, at: str, *, hub: bool, offline: bool) -> ConfigError:
    """The ConfigError that says what went wrong when `datasets` could not load `data`, and what to do."""
    data = config.data
    text = str(error).strip()
    first_line = text.splitlines()[0] if text else type(error).__name__
    if type(error).__name__ == "DatasetNotFoundError":
        if "gated" in text:
            return ConfigError(
                f"data.path {at} is a gated dataset: accept its terms on huggingface.co, then set HF_TOKEN to a "
                "token that may read it"
            )
        if text.startswith("Revision"):
            return ConfigError(
                f"data.path {at}: the dataset repo has no revision `{data.revision}` (a branch, tag or commit)"
            )
        return ConfigError(
            f"data.path {at}: no such file or directory, and no Hugging Face dataset repo of that id (a private "
            "repo needs HF_TOKEN)"
        )
    if hub and isinstance(error, ConnectionError):
        where = "HF_HUB_OFFLINE is set" if offline else "the Hub cannot be reached"
        return ConfigError(
            f"data.path {at} is not in the Hugging Face datasets cache and {where}: load it once with a network "
            "(any tandem sft run, or `datasets.load_dataset`), or pass a local JSONL file or dataset directory"
        )
    if hub and isinstance(error, FileNotFoundError):
        return ConfigError(f"data.path {at}: no such file or directory, and no Hugging Face dataset id ({first_line})")
    if isinstance(error, ValueError) and text.startswith("Unknown split"):
        return ConfigError(
            f"data.split {data.split!r}: dataset {at} has no such split; it has {_listed(text) or first_line}"
        )
    if isinstance(error, ValueError) and ("Config name is missing" in text or "BuilderConfig" in text):
        what = f"has no subset {data.subset!r}" if data.subset else "has several subsets: set data.subset to one"
        return ConfigError(f"dataset {at} {what}; its subsets are {_listed(text) or first_line}")
    return ConfigError(f"data.path {at}: cannot load the dataset: {type(error).__name__}: {first_line}")
