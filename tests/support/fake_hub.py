"""A Hugging Face Hub on loopback, for `HF_ENDPOINT`: the public routes `snapshot_download` and
`datasets.load_dataset` use (repo info, the file tree, file resolve) over model and dataset repos held in memory,
with the Hub's error codes for a missing or gated repo and a missing revision. It records every file it was asked
for, so a test can assert what was never downloaded. `use_hub_home`, `set_offline` and `use_endpoint` point both
huggingface_hub and datasets (which read their settings once, at import) at a temporary cache and at this Hub."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import huggingface_hub.constants
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

RepoType = Literal["model", "dataset"]


@dataclass
class FakeRepo:
    files: dict[str, bytes]
    commit: str = "c0ffee" + "0" * 34
    gated: bool = False


@dataclass
class FakeHub:
    repos: dict[tuple[RepoType, str], FakeRepo] = field(default_factory=dict)
    served: list[str] = field(default_factory=list)
    """`repo_id/path` of every file body sent."""

    def add(self, repo_id: str, folder: Path, repo_type: RepoType = "model", **options: object) -> FakeRepo:
        files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
        self.repos[repo_type, repo_id] = FakeRepo(files, **options)  # type: ignore[arg-type]
        return self.repos[repo_type, repo_id]

    def app(self) -> Starlette:
        routes = []
        for api, resolve in (("/api/models", ""), ("/api/datasets", "/datasets")):
            repo = "/{org}/{name}"
            routes += [
                Route(api + repo, self._info),
                Route(api + repo + "/revision/{revision}", self._info),
                Route(api + repo + "/tree/{revision}", self._tree),
                Route(api + repo + "/tree/{revision}/{path:path}", self._tree),
                Route(resolve + repo + "/resolve/{revision}/{path:path}", self._resolve, methods=["GET", "HEAD"]),
            ]
        return Starlette(routes=routes)

    def _repo(self, request: Request) -> tuple[str, FakeRepo] | Response:
        repo_type: RepoType = "dataset" if request.url.path.startswith(("/api/datasets/", "/datasets/")) else "model"
        repo_id = f"{request.path_params['org']}/{request.path_params['name']}"
        repo = self.repos.get((repo_type, repo_id))
        if repo is None:
            return _error(404, "RepoNotFound", f"Repository Not Found for url: {request.url}.")
        if repo.gated and "authorization" not in request.headers:
            return _error(401, "GatedRepo", f"Access to {repo_type} {repo_id} is restricted.")
        if request.path_params.get("revision", "main") not in ("main", repo.commit):
            return _error(404, "RevisionNotFound", f"Invalid rev id: {request.path_params['revision']}")
        return repo_id, repo

    async def _info(self, request: Request) -> Response:
        found = self._repo(request)
        if isinstance(found, Response):
            return found
        repo_id, repo = found
        siblings = [{"rfilename": name} for name in repo.files]
        return JSONResponse({"id": repo_id, "modelId": repo_id, "sha": repo.commit, "siblings": siblings})

    async def _tree(self, request: Request) -> Response:
        """The files (and, like the Hub, the folders) under `path`: every level with `recursive`, else one."""
        found = self._repo(request)
        if isinstance(found, Response):
            return found
        _, repo = found
        prefix = request.path_params.get("path", "").strip("/")
        recursive = request.query_params.get("recursive", "false").lower() == "true"
        entries: dict[str, dict] = {}
        for name, data in repo.files.items():
            if prefix and not name.startswith(prefix + "/"):
                continue
            parts = name.split("/")
            depth = len(prefix.split("/")) if prefix else 0
            for end in range(depth + 1, len(parts)):  # the folders between `path` and the file
                folder = "/".join(parts[:end])
                entries.setdefault(folder, {"type": "directory", "path": folder, "oid": _oid(folder.encode())})
                if not recursive:
                    break
            if recursive or len(parts) == depth + 1:
                entries[name] = {"type": "file", "path": name, "size": len(data), "oid": _oid(data)}
        if prefix and not entries:
            return _error(404, "EntryNotFound", f"{prefix} does not exist")
        return JSONResponse(list(entries.values()))

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
    return JSONResponse(
        {"error": message}, status_code=status, headers={"X-Error-Code": code, "X-Error-Message": message}
    )


def use_hub_home(home: Path, monkeypatch: pytest.MonkeyPatch, *, offline: bool = True) -> Path:
    """Make `home` the Hugging Face home of this process and every child it starts (`HF_HOME`, its `hub` cache,
    its `datasets` cache; offline or not): huggingface_hub and datasets read these once, at import, so their
    constants are set too. Returns the Hub cache."""
    cache = home / "hub"
    cache.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(home / "datasets"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    set_offline(offline, monkeypatch)
    if (datasets_config := _datasets_config()) is not None:
        downloads = home / "datasets" / "downloads"
        monkeypatch.setattr(datasets_config, "HF_DATASETS_CACHE", home / "datasets")
        monkeypatch.setattr(datasets_config, "DOWNLOADED_DATASETS_PATH", str(downloads))
        monkeypatch.setattr(datasets_config, "EXTRACTED_DATASETS_PATH", str(downloads / "extracted"))
    return cache


def set_offline(offline: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """`HF_HUB_OFFLINE` on or off, for this process (both libraries' constants) and its children."""
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", offline)
    if (datasets_config := _datasets_config()) is not None:
        monkeypatch.setattr(datasets_config, "HF_HUB_OFFLINE", offline)
        monkeypatch.setattr(datasets_config, "HF_DATASETS_OFFLINE", offline)


def use_endpoint(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Point huggingface_hub and datasets of this process at the Hub at `url` (`HF_ENDPOINT`, read at import)."""
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", url)
    monkeypatch.setattr(
        huggingface_hub.constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}"
    )
    if (datasets_config := _datasets_config()) is not None:
        monkeypatch.setattr(datasets_config, "HF_ENDPOINT", url)
        monkeypatch.setattr(datasets_config, "HUB_DATASETS_URL", url + "/datasets/{repo_id}/resolve/{revision}/{path}")


def _datasets_config():
    try:
        import datasets.config
    except ImportError:
        return None
    return datasets.config
