"""A Hugging Face Hub on loopback, for `HF_ENDPOINT`: the public routes `snapshot_download` uses (repo info, the
file tree, file resolve) over repos held in memory, with the Hub's error codes for a missing or gated repo.
It records every file it was asked for, so a test can assert what was never downloaded."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route


@dataclass
class FakeRepo:
    files: dict[str, bytes]
    commit: str = "c0ffee" + "0" * 34
    gated: bool = False


@dataclass
class FakeHub:
    repos: dict[str, FakeRepo] = field(default_factory=dict)
    served: list[str] = field(default_factory=list)
    """`repo_id/path` of every file body sent."""

    def add(self, repo_id: str, folder: Path, **options: object) -> FakeRepo:
        files = {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
        self.repos[repo_id] = FakeRepo(files, **options)  # type: ignore[arg-type]
        return self.repos[repo_id]

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/api/models/{org}/{name}/revision/{revision}", self._info),
                Route("/api/models/{org}/{name}/tree/{revision}", self._tree),
                Route("/api/models/{org}/{name}/tree/{revision}/{path:path}", self._tree),
                Route("/{org}/{name}/resolve/{revision}/{path:path}", self._resolve, methods=["GET", "HEAD"]),
            ]
        )

    def _repo(self, request: Request) -> tuple[str, FakeRepo] | Response:
        repo_id = f"{request.path_params['org']}/{request.path_params['name']}"
        repo = self.repos.get(repo_id)
        if repo is None:
            return _error(404, "RepoNotFound", f"Repository Not Found for url: {request.url}.")
        if repo.gated and "authorization" not in request.headers:
            return _error(401, "GatedRepo", f"Access to model {repo_id} is restricted.")
        return repo_id, repo

    async def _info(self, request: Request) -> Response:
        found = self._repo(request)
        if isinstance(found, Response):
            return found
        repo_id, repo = found
        siblings = [{"rfilename": name} for name in repo.files]
        return JSONResponse({"id": repo_id, "modelId": repo_id, "sha": repo.commit, "siblings": siblings})

    async def _tree(self, request: Request) -> Response:
        found = self._repo(request)
        if isinstance(found, Response):
            return found
        _, repo = found
        entries = [{"type": "file", "path": name, "size": len(data), "oid": _oid(data)} for name, data in repo.files.items()]
        return JSONResponse(entries)

    async def _resolve(self, request: Request) -> Response:
        found = self._repo(request)
        if isinstance(found, Response):
            return found
        repo_id, repo = found
        data = repo.files.get(request.path_params["path"])
        if data is None:
            return _error(404, "EntryNotFound", "Entry not found")
        headers = {"X-Repo-Commit": repo.commit, "ETag": f'"{_oid(data)}"', "Content-Length": str(len(data))}
        if request.method == "HEAD":
            return Response(status_code=200, headers=headers)
        self.served.append(f"{repo_id}/{request.path_params['path']}")
        return Response(data, headers=headers, media_type="application/octet-stream")


def _oid(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()


def _error(status: int, code: str, message: str) -> Response:
    return JSONResponse({"error": message}, status_code=status, headers={"X-Error-Code": code, "X-Error-Message": message})
