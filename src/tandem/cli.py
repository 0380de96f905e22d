"""The `tandem` command: one entry point, one config mechanism, a subcommand per process."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import BaseModel

from tandem import __version__
from tandem.config import load_config, to_toml
from tandem.config.help import render_help
from tandem.hub import hub_models, resolve_models
from tandem.run import exit_code, setup_logging


@dataclass(frozen=True)
class Command:
    name: str
    summary: str
    config: str
    """`module:Class` of the command's root config."""
    runner: str
    """`module:function` taking the resolved config and returning an exit code."""
    positional: str | None = None
    """Dotted key a leading positional argument sets: `tandem eval gsm8k` is `tandem eval --env.id gsm8k`."""
    check: str | None = None
    """`module:function` raising ConfigError for a config the command would refuse before starting anything (its
    runner calls it too): `--dry-run` runs it, so a config it prints is one the command accepts."""

    def config_class(self) -> type[BaseModel]:
        return _resolve(self.config)

    def runner_function(self) -> Callable[[BaseModel], int | None]:
        return _resolve(self.runner)


def _resolve(path: str):
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


COMMANDS = {
    command.name: command
    for command in [
        Command(
            "rl",
            "Run inference, orchestrator and trainer together: asynchronous RL on one machine.",
            "tandem.config.rl:RlConfig",
            "tandem.launch:run_rl",
            check="tandem.launch:check_rl",
        ),
        Command("sft", "Supervised fine-tuning on FSDP2.", "tandem.config.sft:SftConfig", "tandem.trainer.sft:launch"),
        Command(
            "eval",
            "Evaluate environments (`tandem eval ENV` or `@ sources.toml`) against an OpenAI-compatible server.",
            "tandem.config.eval:EvalConfig",
            "tandem.eval.main:run_eval",
            positional="env.id",
        ),
        Command(
            "inference",
            "Serve a model over the OpenAI HTTP API plus token-in generation and admin routes.",
            "tandem.config.inference:InferenceConfig",
            "tandem.inference.main:run",
        ),
        Command(
            "orchestrator",
            "Schedule rollouts, score them, and write training batches.",
            "tandem.config.orchestrator:OrchestratorConfig",
            "tandem.orchestrator.main:run",
            check="tandem.orchestrator.tasks:check_sources",
        ),
        Command(
            "trainer",
            "The RL trainer process (run it under torchrun for several devices).",
            "tandem.config.trainer:TrainerConfig",
            "tandem.trainer.rl:train",
        ),
        Command(
            "merge-lora",
            "Fold a PEFT LoRA adapter into its base model and write a full Hugging Face checkpoint.",
            "tandem.config.merge:MergeLoraConfig",
            "tandem.merge:run",
        ),
        Command(
            "verifiers-wheels",
            "Download the wheels verifiers' harness programs install from, for runs with no package index.",
            "tandem.config.verifiers:VerifiersWheelsConfig",
            "tandem.envs.verifiers:build_wheelhouse",
        ),
        Command(
            "dashboard",
            "A local web page over every run and eval.",
            "tandem.config.dashboard:DashboardConfig",
            "tandem.dashboard.main:run",
        ),
    ]
}


def overview() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = [
        f"tandem {__version__}: post-train language models with asynchronous RL, SFT and evals.",
        "",
        "usage: tandem <command> [@ FILE.toml ...] [--KEY VALUE ...] [--dry-run] [--help]",
        "",
        "commands:",
        *(f"  {name.ljust(width)}  {command.summary}" for name, command in COMMANDS.items()),
        "",
        "`tandem <command> --help` lists every config field of that command.",
    ]
    return "\n".join(lines) + "\n"


def run_command(command: Command, argv: list[str]) -> int:
    config_class = command.config_class()
    if command.positional and argv and not argv[0].startswith(("-", "@")):
        argv = [f"--{command.positional}", *argv]
    config, command_line = load_config(config_class, argv)
    if command_line.help:
        sys.stdout.write(render_help(command.name, command.summary, config_class))
        return 0
    if command_line.dry_run:
        if command.check is not None:
            _resolve(command.check)(config)
        sys.stdout.write(to_toml(config))
        return 0
    serves_by_name = command.name == "eval" and getattr(config, "base_url", None)  # `model`: a name the server serves
    if not serves_by_name and hub_models(config):
        log = getattr(config, "log", None)
        setup_logging(log.level if log is not None else "info")  # a Hub fetch logs before the run directory exists
        resolve_models(config, weights=command.name != "orchestrator" and not getattr(config, "random_init", False))
    return int(command.runner_function()(config) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        sys.stdout.write(overview())
        return 0
    if argv[0] in ("--version", "-V"):
        sys.stdout.write(f"tandem {__version__}\n")
        return 0
    name, rest = argv[0], argv[1:]
    command = COMMANDS.get(name)
    if command is None:
        from tandem.config.schema import suggest

        sys.stderr.write(f"tandem: unknown command {name!r}{suggest(name, COMMANDS)}; see `tandem --help`\n")
        return 2
    return exit_code(name, lambda: run_command(command, rest))


if __name__ == "__main__":
    sys.exit(main())
