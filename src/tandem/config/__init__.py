"""One config mechanism for every command: pydantic models, TOML files, dotted kebab-case flags."""

from tandem.config.base import Section
from tandem.config.common import LoadedModelConfig, LogConfig, ModelConfig, OptimConfig, RunConfig, SchedulerConfig
from tandem.config.errors import ConfigError
from tandem.config.loader import load_config, load_file
from tandem.config.toml_io import dump_toml


def to_toml(config: Section) -> str:
    """The fully resolved config as TOML; loading it back gives an equal config."""
    return dump_toml(config.model_dump(mode="json"))


__all__ = [
    "ConfigError",
    "LoadedModelConfig",
    "LogConfig",
    "ModelConfig",
    "OptimConfig",
    "RunConfig",
    "SchedulerConfig",
    "Section",
    "dump_toml",
    "load_config",
    "load_file",
    "to_toml",
]
