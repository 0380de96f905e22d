"""The dashboard's Starlette app: three static pages and a read-only JSON API over the outputs directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from tandem.dashboard.evals import eval_samples, eval_summary
from tandem.dashboard.runs import downsample, list_runs, orchestrator_records, run_dir, run_kind, training_records

STATIC = Path(__file__).parent / "static"
DEFAULT_POINTS = 400


class _NotFound(Exception):
    """A run name that is not a run directly under the outputs directory."""


def _staleness_mean(record: dict[str, Any]) -> dict[str, Any]:
    """The record with `staleness_mean`, the mean version lag of its `staleness` {lag: count} histogram."""
    staleness = record.get("staleness")
    if isinstance(staleness, dict) and staleness:
        total = sum(staleness.values())
        if total:
            return {**record, "staleness_mean": sum(int(lag) * n for lag, n in staleness.items()) / total}
    return record


def _float(value: str | None) -> float | None:
    return float(value) if value not in (None, "") else None


def create_app(outputs: Path) -> Starlette:
    """The app serving the runs under `outputs`; every handler only reads files."""

    def page(name: str):
        async def handler(request: Request) -> Response:
            return FileResponse(STATIC / name)

        return handler

    def resolve(request: Request) -> Path:
        path = run_dir(outputs, request.path_params["name"])
        if path is None or run_kind(path) is None:
            raise _NotFound
        return path

    async def runs(request: Request) -> Response:
        return JSONResponse({"outputs": str(outputs), "runs": list_runs(outputs)})

    async def metrics(request: Request) -> Response:
        path = resolve(request)
        max_points = max(2, min(int(request.query_params.get("max_points", DEFAULT_POINTS)), 5000))
        trainer = training_records(path)
        orchestrator, evals = orchestrator_records(path)
        return JSONResponse(
            {
                "name": path.name,
                "kind": run_kind(path),
                "steps": {"trainer": len(trainer), "orchestrator": len(orchestrator)},
                "trainer": downsample(trainer, max_points),
                "orchestrator": [_staleness_mean(r) for r in downsample(orchestrator, max_points)],
                "evals": downsample(evals, max_points),
            }
        )

    async def summary(request: Request) -> Response:
        return JSONResponse(eval_summary(resolve(request)))

    async def samples(request: Request) -> Response:
        query = request.query_params
        try:
            result = eval_samples(
                resolve(request),
                outcome=query.get("outcome") or None,
                source=query.get("source") or None,
                min_reward=_float(query.get("min_reward")),
                max_reward=_float(query.get("max_reward")),
                offset=max(0, int(query.get("offset", 0))),
                limit=max(1, min(int(query.get("limit", 50)), 500)),
            )
        except ValueError as error:
            return JSONResponse({"error": str(error)}, status_code=400)
        return JSONResponse(result)

    async def not_found(request: Request, exc: Exception) -> Response:
        return JSONResponse({"error": "no such run"}, status_code=404)

    routes = [
        Route("/", page("index.html")),
        Route("/run/{name}", page("run.html")),
        Route("/eval/{name}", page("eval.html")),
        Route("/api/runs", runs),
        Route("/api/runs/{name}/metrics", metrics),
        Route("/api/evals/{name}/summary", summary),
        Route("/api/evals/{name}/samples", samples),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]
    return Starlette(routes=routes, exception_handlers={_NotFound: not_found})
