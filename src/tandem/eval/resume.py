"""`--resume DIR`: continue an earlier eval in its own run directory, if it would compute the same thing.

The run's saved `eval.toml` is the base: what the command line sets explicitly
overrides it, and everything else (the sources, the server, the sampling) is
the run's own, so `tandem eval --resume DIR` alone continues a run. The result
is compared with the saved config, leaving out what only changes how the eval
runs (where, how fast, with which key, how verbose) and not what it measures;
any other difference is refused, naming every key that differs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from tandem.config import ConfigError, load_file
from tandem.config.eval import EvalConfig
from tandem.config.loader import deep_merge
from tandem.config.schema import kebab

IGNORED = (
    "run-name", "output-dir", "resume", "log", "concurrency", "base-url", "api-key", "startup-timeout-s",
    "env.retries",
)  # fmt: skip
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


def _over_saved(saved: EvalConfig, config: EvalConfig, run: Path) -> EvalConfig:
    """The saved config with every value `config` was explicitly given put over it (an empty source list is
    the saved one's: a command line without sources resumes the run's)."""
    given = config.model_dump(exclude_unset=True)
    if not given.get("source"):
        given.pop("source", None)
    try:
        return EvalConfig.model_validate(deep_merge(saved.model_dump(), given))
    except ValidationError as error:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']}" for e in error.errors())
        raise ConfigError(f"--resume {run}: the settings given do not fit the run's config: {problems}") from None


def resumed_config(config: EvalConfig) -> EvalConfig:
    """The run `config.resume`'s saved config under `config`'s explicit values, moved into that run
    directory; a ConfigError if the result computes something else than the run did."""
    assert config.resume is not None
    saved_path = config.resume / "eval.toml"
    if not saved_path.is_file():
        raise ConfigError(f"--resume {config.resume}: not an eval run directory (no eval.toml in it)")
    saved = load_file(EvalConfig, saved_path)
    config = _over_saved(saved, config, config.resume)
    differences = config_differences(saved, config)
    if differences:
        listed = "\n".join(f"  {line}" for line in differences)
        raise ConfigError(
            f"--resume {config.resume}: the config differs from the one that run used:\n{listed}\n"
            "resume with the same settings, or start a new eval"
        )
    return config.model_copy(update={"output_dir": config.resume.parent, "run_name": config.resume.name})
