"""The dashboard's Starlette app: three static pages and a read-only JSON API over the outputs directory.

Every query value is checked here (`query_int`, `query_number`): a malformed or out-of-range one is a 400
naming it. Every response is strict JSON (`StrictJSONResponse`): a NaN or infinity read from a file becomes
null, since browsers reject the bare `NaN` Python's json module writes. Handlers are plain functions, which
Starlette runs in a thread pool, so reading a large file never stalls the event loop.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.datastructures import QueryParams
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from tandem.dashboard.evals import eval_summary
from tandem.dashboard.listing import list_runs
from tandem.dashboard.runs import STORED_POINTS, Outputs, Run, downsample
from tandem.dashboard.samples import SampleFilter, sample_page

STATIC = Path(__file__).parent / "static"
DEFAULT_POINTS = 400
MAX_SAMPLES_PER_PAGE = 500
MAX_OFFSET = 10**9
MAX_DEPTH = 32
"""Deeper JSON values are sent as null: no record can exhaust the encoder's stack."""


class NotFound(Exception):
    """A run name that is not a run directly under the outputs directory."""


class BadQuery(ValueError):
    """A query value that is malformed or out of range."""


def json_safe(value: Any, depth: int = 0) -> Any:
    """`value` with NaN and infinities as None, and containers nested deeper than `MAX_DEPTH` as None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict | list) and depth >= MAX_DEPTH:
        return None
    if isinstance(value, dict):
        return {str(key): json_safe(item, depth + 1) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(item, depth + 1) for item in value]
    return value


class StrictJSONResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        return json.dumps(json_safe(content), ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def query_int(query: QueryParams, name: str, low: int, high: int, default: int | None = None) -> int | None:
    raw = query.get(name, "")
    if raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise BadQuery(f"{name}: {raw[:40]!r} is not an integer") from None
    if not low <= value <= high:
        raise BadQuery(f"{name}: {value} is outside [{low}, {high}]")
    return value


def query_number(query: QueryParams, name: str) -> float | None:
    raw = query.get(name, "")
    if raw == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        raise BadQuery(f"{name}: {raw[:40]!r} is not a number") from None
    if not math.isfinite(value):
        raise BadQuery(f"{name}: must be a finite number, not {raw[:40]!r}")
    return value


def sample_filter(query: QueryParams) -> SampleFilter:
    return SampleFilter(
        step=query_int(query, "step", 0, MAX_OFFSET),
        source=query.get("source") or None,
        outcome=query.get("outcome") or None,
        min_reward=query_number(query, "min_reward"),
        max_reward=query_number(query, "max_reward"),
    )


def metrics_payload(outputs: Outputs, run: Run, max_points: int) -> dict[str, Any]:
    """A run's trainer, orchestrator, online eval and inference heartbeat records, each at most `max_points`, and
    `resumes`: the steps the trainer resumed from (the charts mark each), in order."""
    with outputs.lock:
        trainer = outputs.metrics(run, "metrics.jsonl")
        orchestrator = outputs.metrics(run, "orchestrator_metrics.jsonl")
        inference = outputs.metrics(run, "inference_metrics.jsonl")
        groups = {"trainer": trainer, "orchestrator": orchestrator, "inference": inference}
        payload: dict[str, Any] = {
            "name": run.name,
            "kind": run.kind,
            "steps": {name: log.steps.count if log else 0 for name, log in groups.items()},
        }
        for name, log in groups.items():
            payload[name] = downsample(log.steps.items(), max_points) if log else []
        payload["evals"] = downsample(orchestrator.evals.items(), max_points) if orchestrator else []
        payload["resumes"] = sorted(trainer.resumes) if trainer else []
    return payload


def create_app(outputs_dir: Path) -> Starlette:
    """The app serving the runs under `outputs_dir`; every handler only reads files."""
    outputs = Outputs(outputs_dir)

    def page(name: str):
        def handler(request: Request) -> Response:
            return FileResponse(STATIC / name)

        return handler

    def resolve(request: Request, kind: str | None = None) -> Run:
        run = outputs.run(request.path_params["name"])
        if run is None or (kind is not None and run.kind != kind):
            raise NotFound
        return run

    def runs(request: Request) -> Response:
        return StrictJSONResponse({"outputs": str(outputs.root), "runs": list_runs(outputs)})

    def metrics(request: Request) -> Response:
        run = resolve(request)
        max_points = query_int(request.query_params, "max_points", 2, STORED_POINTS, DEFAULT_POINTS)
        return StrictJSONResponse(metrics_payload(outputs, run, max_points))

    def summary(request: Request) -> Response:
        run = resolve(request, "eval")
        with outputs.lock:
            return StrictJSONResponse(eval_summary(outputs, run))

    def samples(file: str, kind: str | None):
        def handler(request: Request) -> Response:
            run = resolve(request, kind)
            query = request.query_params
            where = sample_filter(query)
            offset = query_int(query, "offset", 0, MAX_OFFSET, 0)
            limit = query_int(query, "limit", 1, MAX_SAMPLES_PER_PAGE, 50)
            return StrictJSONResponse(sample_page(run.file(file), where, offset=offset, limit=limit))

        return handler

    def not_found(request: Request, exc: Exception) -> Response:
        return StrictJSONResponse({"error": "no such run"}, status_code=404)

    def bad_query(request: Request, exc: Exception) -> Response:
        return StrictJSONResponse({"error": str(exc)}, status_code=400)

    routes = [
        Route("/", page("index.html")),
        Route("/run/{name}", page("run.html")),
        Route("/eval/{name}", page("eval.html")),
        Route("/api/runs", runs),
        Route("/api/runs/{name}/metrics", metrics),
        Route("/api/runs/{name}/samples", samples("rollouts.jsonl", None)),
        Route("/api/evals/{name}/summary", summary),
        Route("/api/evals/{name}/samples", samples("traces.jsonl", "eval")),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]
    return Starlette(routes=routes, exception_handlers={NotFound: not_found, BadQuery: bad_query})
