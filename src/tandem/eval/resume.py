"""`--resume DIR`: continue an earlier eval in its own run directory, if it would compute the same thing.

The saved `eval.toml` of the run is compared with the current config, leaving
out what only changes how the eval runs (where, how fast, with which key, how
verbose) and not what it measures; any other difference is refused, naming
every key that differs.
"""

from __future__ import annotations

from typing import Any

from tandem.config import ConfigError, load_file
from tandem.config.eval import EvalConfig
from tandem.config.schema import kebab

IGNORED = ("run-name", "output-dir", "resume", "log", "concurrency", "api-key", "startup-timeout-s", "env.retries")
"""Keys (and the sections below them) that may change between a run and its resumption."""

_MISSING = object()


def _show(value: Any) -> str:
    return "unset" if value is _MISSING else repr(value)


def _ignored(key: str) -> bool:
    return any(key == prefix or key.startswith(f"{prefix}.") for prefix in IGNORED)


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> dict[str, Any]:
    if isinstance(value, dict):
        for key, item in value.items():
            _flatten(item, f"{prefix}.{kebab(key)}" if prefix else kebab(key), out)
    elif isinstance(value, list) and any(isinstance(item, dict) for item in value):
        for index, item in enumerate(value):
            _flatten(item, f"{prefix}[{index}]", out)
    else:
        out[prefix] = value
    return out


def config_differences(saved: EvalConfig, current: EvalConfig) -> list[str]:
    """`key: <saved> in the run, <current> now` for every compared key that differs."""
    flat = [_flatten(config.model_dump(mode="json"), "", {}) for config in (saved, current)]
    keys = sorted(key for key in flat[0].keys() | flat[1].keys() if not _ignored(key))
    pairs = [(key, flat[0].get(key, _MISSING), flat[1].get(key, _MISSING)) for key in keys]
    return [f"{key}: {_show(old)} in the run, {_show(new)} now" for key, old, new in pairs if old != new]


def resumed_config(config: EvalConfig) -> EvalConfig:
    """`config` moved into the run directory `config.resume`; a ConfigError if that run's config differs."""
    assert config.resume is not None
    saved_path = config.resume / "eval.toml"
    if not saved_path.is_file():
        raise ConfigError(f"--resume {config.resume}: not an eval run directory (no eval.toml in it)")
    differences = config_differences(load_file(EvalConfig, saved_path), config)
    if differences:
        listed = "\n".join(f"  {line}" for line in differences)
        raise ConfigError(
            f"--resume {config.resume}: the config differs from the one that run used:\n{listed}\n"
            "resume with the same settings, or start a new eval"
        )
    return config.model_copy(update={"output_dir": config.resume.parent, "run_name": config.resume.name})
