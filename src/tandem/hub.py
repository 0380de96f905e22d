"""Hugging Face Hub ids wherever tandem takes a model: each resolved once, before anything loads, to a local
snapshot directory that every process then reads.

A `model.name` that is an existing path is used as it is. Any other name shaped like a Hub id (`org/name`, or a
bare `name`) is fetched by `huggingface_hub.snapshot_download` into the standard cache, so `HF_HOME`,
`HF_HUB_CACHE`, `HF_TOKEN` (gated and private repos) and `HF_ENDPOINT` mean what they mean to every other
Hugging Face tool, its progress bars show on a first download, and a cached snapshot costs one small request
(none at all under `HF_HUB_OFFLINE=1`). Only safetensors weights, configs and tokenizer files are fetched: a
`.bin`/`.pt` checkpoint is a pickle, and tandem never unpickles what it downloads.

`tandem rl` resolves in the launcher and writes the snapshot path into every child's config, so the trainer,
the servers and the orchestrator read one revision even if the repo moves on while they start.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from tandem.config import ConfigError
from tandem.config.base import Section
from tandem.config.common import LoadedModelConfig

logger = logging.getLogger(__name__)

CONFIG_FILES = ["config.json", "generation_config.json"]
TOKENIZER_FILES = [
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
    "vocab.txt", "merges.txt", "tokenizer.model", "*.tiktoken", "chat_template.jinja", "chat_template.json",
]  # fmt: skip
WEIGHT_FILES = ["*.safetensors", "*.safetensors.index.json"]

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


REPO_ID_RULES = (
    "`name` or `org/name`, each part 1 to 96 letters, digits, `-`, `_` or `.`, neither starting nor ending with `-` "
    "or `.`, without `--` or `..`, not ending in `.git`"
)
"""The Hub's rules for a repo id (`huggingface_hub.utils.validate_repo_id` applies them), as an error states them."""


def is_hub_id(name: str) -> bool:
    """A name that is no existing path and is shaped like a Hub repo id (`org/name` or `name`). Being shaped like
    one is not being valid: `check_repo_id` applies the Hub's own rules before anything is fetched."""
    return bool(name) and _HUB_ID.fullmatch(name) is not None and ".." not in name and not _exists(name)


def _exists(name: str) -> bool:
    try:
        return Path(name).expanduser().exists()
    except OSError:  # a name longer than a path may be (ENAMETOOLONG) names no file
        return False


def check_repo_id(repo_id: str) -> None:
    """A one-line ConfigError for an id the Hub's rules refuse, checked by huggingface_hub's own validator, so
    tandem accepts exactly the ids every Hugging Face tool accepts."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        shown = repr(repo_id) if len(repo_id) <= 120 else f"{repo_id[:60]!r}... ({len(repo_id)} characters)"
        raise ConfigError(
            f"model {shown}: no such directory, and not a valid Hugging Face repo id ({REPO_ID_RULES})"
        ) from None


def fetch(repo_id: str, revision: str = "", *, weights: bool = True, cache_dir: Path | None = None) -> Path:
    """The local snapshot directory of `repo_id` at `revision` (default: the main branch), downloaded into the
    Hugging Face cache if it is not there; ConfigError, saying what to do, for every way that can fail."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    check_repo_id(repo_id)
    offline = constants.HF_HUB_OFFLINE  # HF_HUB_OFFLINE, as huggingface_hub read it
    at = f"{repo_id}@{revision}" if revision else repo_id
    patterns = CONFIG_FILES + TOKENIZER_FILES + (WEIGHT_FILES if weights else [])
    if not offline:
        logger.info("model %s: fetching %s from the Hugging Face Hub (cached after the first time)",
                    at, "weights, config and tokenizer" if weights else "config and tokenizer")  # fmt: skip
    try:
        path = Path(snapshot_download(repo_id, revision=revision or None, allow_patterns=patterns,
                                      cache_dir=cache_dir, local_files_only=offline))  # fmt: skip
    except GatedRepoError:
        raise ConfigError(
            f"model {at} is a gated repo: accept its terms on huggingface.co, then set HF_TOKEN to a token that "
            "may read it"
        ) from None
    except RepositoryNotFoundError:
        raise ConfigError(
            f"model {at}: no such directory, and no Hugging Face repo of that id (a private repo needs HF_TOKEN)"
        ) from None
    except RevisionNotFoundError:
        raise ConfigError(f"model {at}: the repo has no revision `{revision}` (a branch, tag or commit)") from None
    except LocalEntryNotFoundError:
        where = "HF_HUB_OFFLINE is set" if offline else "the Hub cannot be reached"
        raise ConfigError(
            f"model {at} is not in the Hugging Face cache and {where}: download it once with a network "
            "(any tandem command, or `hf download`), or pass a local directory"
        ) from None
    except HfHubHTTPError as error:
        raise ConfigError(f"model {at}: the Hub answered {str(error).splitlines()[0]}") from None
    _check_snapshot(path, at, weights)
    logger.info("model %s: %s", at, path)
    return path


def _check_snapshot(path: Path, at: str, weights: bool) -> None:
    if not (path / "config.json").is_file():
        raise ConfigError(f"model {at} has no config.json: is it a transformers model repo?")
    if weights and not any(path.glob("*.safetensors")):
        raise ConfigError(
            f"model {at} holds no *.safetensors weights; tandem loads only safetensors (a pytorch_model.bin is a "
            "pickle, never loaded): convert it once with transformers' save_pretrained(safe_serialization=True)"
        )


def resolve_models(config: Section, *, weights: bool = True) -> None:
    """Replace every `model.name` in `config` that is a Hub id with its local snapshot directory, fetching each
    (id, revision) once. A section that serves the model under a name (`served_model_name`) and has none set
    takes the Hub id, so clients request `Qwen/Qwen3-0.6B` and not a cache path."""
    resolved: dict[tuple[str, str], Path] = {}
    for section, model in hub_models(config):
        key = (model.name, model.revision)
        if key not in resolved:
            resolved[key] = fetch(model.name, model.revision, weights=weights)
        if getattr(section, "served_model_name", None) == "":
            section.served_model_name = model.name
        model.name = str(resolved[key])


def hub_models(config: Section) -> list[tuple[Section, LoadedModelConfig]]:
    """Every (section, its `model`) in `config` whose `model.name` is a Hub id."""
    found = []
    for section in _sections(config):
        model = getattr(section, "model", None)
        if isinstance(model, LoadedModelConfig) and is_hub_id(model.name):
            found.append((section, model))
    return found


def _sections(section: Section) -> list[Section]:
    """`section` and every section below it, depth first."""
    found = [section]
    for name in type(section).model_fields:
        value: Any = getattr(section, name)
        for child in value if isinstance(value, list | tuple) else [value]:
            if isinstance(child, Section):
                found += _sections(child)
    return found
