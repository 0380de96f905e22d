"""`tandem eval`: load the sources, find or start a server, run the rollouts still missing, summarise.

Exit codes: 0 when the eval ran (whatever the scores), 1 when a source had
only errors or the server could not be reached, 2 for config mistakes.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console

from tandem.client import OpenAIClient, RequestError
from tandem.config import ConfigError
from tandem.config.eval import EvalConfig
from tandem.envs.sandbox import start_sandbox
from tandem.eval.concurrency import AdaptiveLimiter, AimdController
from tandem.eval.local_server import ServerStartError, local_server
from tandem.eval.lock import run_lock
from tandem.eval.progress import EvalProgress
from tandem.eval.resume import resumed_config
from tandem.eval.runner import EvalSource, load_source, pending_rollouts, run_rollouts, serving
from tandem.eval.summary import render_table, summarize_source
from tandem.eval.traces import read_traces
from tandem.files import atomic_write_text
from tandem.jsonl import JsonlWriter
from tandem.run import RunError, prepare_run_dir, setup_logging

logger = logging.getLogger(__name__)

TRACES = "traces.jsonl"
SUMMARY = "summary.json"


def run_eval(config: EvalConfig) -> int:
    """Check the config, the sources and a given server, take the run directory's lock, run what is missing,
    summarise. Every check that can refuse the eval runs before its directory is created, so a refused eval
    leaves nothing behind (no run that looks failed)."""
    config = resumed_config(config) if config.resume is not None else config
    _check_runnable(config)
    start_sandbox(config.sandbox, config.run_dir)
    sources = [load_source(source) for source in config.source]
    if config.base_url is not None:
        setup_logging(config.log.level)  # on the console only: the run directory does not exist yet
        model = _served_model(config)
    else:
        model = None
    with run_lock(config.run_dir):
        if config.resume is None and (config.run_dir / TRACES).exists():
            raise ConfigError(
                f"{config.run_dir} already holds an eval: continue it with --resume {config.run_dir}, "
                "or pick another --run-name"
            )
        run_dir = prepare_run_dir(config)
        traces = run_dir / TRACES
        try:
            with _server(config, run_dir) as base_url:
                records = asyncio.run(_evaluate(config, base_url, model, sources, traces))
        except (ServerStartError, RequestError) as error:
            logger.error("%s", error)
            return 1
        except KeyboardInterrupt:
            total = sum(source.expected for source in sources)
            logger.warning(
                "interrupted: %d of %d rollouts are saved in %s; continue with `tandem eval --resume %s`",
                len(read_traces(traces)), total, traces, run_dir,
            )  # fmt: skip
            raise
        return _summarize(run_dir, sources, records)


def _served_model(config: EvalConfig) -> str:
    """The model to request from the server at `base_url`, checked before anything is created: a server that
    cannot be reached, or that does not serve `--model`, refuses the eval in one line."""

    async def check() -> str:
        async with OpenAIClient(config.base_url, api_key=config.api_key, timeout_s=config.env.request_timeout_s,
                                retries=config.env.retries) as client:  # fmt: skip
            return await _model_id(client, config)

    try:
        return asyncio.run(check())
    except RequestError as error:
        raise RunError(f"the server at {config.base_url} cannot be evaluated: {error}") from None


def _check_runnable(config: EvalConfig) -> None:
    """Something to evaluate and a server to evaluate it on, before anything is created."""
    if not config.source:
        raise ConfigError(
            "nothing to evaluate: name an environment (`tandem eval gsm8k`), set --env.id, or add [[source]] blocks"
        )
    if config.base_url is None and not config.model.name:
        raise ConfigError("no server to evaluate: give --model DIR (starts the built-in server) or --base-url URL")


@contextmanager
def _server(config: EvalConfig, run_dir: Path) -> Iterator[str]:
    """The server to evaluate against: `base_url`, or the built-in one started for `model.name`."""
    if config.base_url is not None:
        yield config.base_url
        return
    with local_server(
        config.model,
        run_dir=run_dir,
        seq_len=config.seq_len,
        log_level=config.log.level,
        startup_timeout_s=config.startup_timeout_s,
        served_model_name=config.served_model_name,
    ) as url:
        yield url


async def _model_id(client: OpenAIClient, config: EvalConfig) -> str:
    """The model to request: `model.name` for a server given by URL, checked against the ids it serves (a
    name it does not serve would fail every rollout); otherwise (or when unset) the first id it lists."""
    name = config.model.name if config.base_url is not None else ""
    try:
        served = await client.models()
    except RequestError as error:
        if not name or error.kind != "status":
            raise
        logger.warning("cannot check --model %r against the server's models: %s", name, error)
        return name
    if name and name not in served:
        raise ConfigError(
            f"--model {name!r}: {config.base_url} does not serve it; "
            f"it serves {', '.join(map(repr, served)) or 'no model'} (GET /v1/models)"
        )
    if not served:
        raise RequestError("protocol", "GET /v1/models lists no model to evaluate")
    return name or served[0]


async def _evaluate(
    config: EvalConfig, base_url: str, model: str | None, sources: list[EvalSource], traces: Path
) -> list[dict[str, Any]]:
    """Run the rollouts `traces` does not hold yet against `model` (None: the first the server lists); every
    record of the eval back, earlier ones first."""
    records = read_traces(traces)
    todo = pending_rollouts(sources, {record["key"] for record in records})
    total = sum(source.expected for source in sources)
    if config.resume is not None:
        logger.info(
            "resuming %s: %d of %d rollouts done, %d to run", traces.parent, total - len(todo), total, len(todo)
        )
    else:
        logger.info("%d rollouts to run", len(todo))
    if not todo:
        return records
    limiter = AdaptiveLimiter(AimdController(config.concurrency))
    client = OpenAIClient(
        base_url,
        api_key=config.api_key,
        timeout_s=config.env.request_timeout_s,
        retries=config.env.retries,
        on_feedback=limiter.record,
    )
    async with client:
        model = model or await _model_id(client, config)
        totals = {source.name: source.expected for source in sources}
        with JsonlWriter(traces) as writer, EvalProgress(totals, records, limiter) as progress:
            async with serving(sources):
                await run_rollouts(todo, client, model, limiter, writer, lambda r: _keep(r, records, progress))
    return records


def _keep(record: dict[str, Any], records: list[dict[str, Any]], progress: EvalProgress) -> None:
    records.append(record)
    progress.add(record)


def _summarize(run_dir: Path, sources: list[EvalSource], records: list[dict[str, Any]]) -> int:
    by_source: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for record in records:
        by_source[record["source"]].append(record)
    summaries = {
        source.name: summarize_source(
            by_source[source.name],
            expected=source.expected,
            rollouts_per_task=source.config.rollouts_per_task,
            pass_threshold=source.config.pass_threshold,
        )
        for source in sources
    }
    render_table(summaries, Console())
    atomic_write_text(run_dir / SUMMARY, json.dumps({"sources": summaries}, indent=2) + "\n")
    logger.info("summary: %s", run_dir / SUMMARY)
    failed = [name for name, s in summaries.items() if s["rollouts"] and s["outcomes"]["error"] == s["rollouts"]]
    if failed:
        logger.error(
            "every rollout of %s failed; the `error` field of %s says why", ", ".join(failed), run_dir / TRACES
        )
        return 1
    return 0
