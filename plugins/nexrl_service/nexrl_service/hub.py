"""The served model's tokenizer and config under its Hugging Face-style names, for clients anywhere.

The tinker SDK (``TrainingClient.get_tokenizer()`` by ``get_info``'s ``tokenizer_id``,
``SamplingClient.get_tokenizer()`` by the base model's name) and tinker-cookbook
(``tokenizer_utils.get_tokenizer``, ``hyperparam_utils.get_lr``) load by name with
``AutoTokenizer.from_pretrained`` / ``AutoConfig.from_pretrained``, which read a local
directory, the Hugging Face cache, or the Hub at ``HF_ENDPOINT``, nothing else. A path on
the server resolves on the server's machine only, so instead the service plays the Hub for
its one model:

* `add_hub_routes` answers the part of the Hub's protocol those loaders use (file
  downloads, the model's info and file tree) under ``/hf``, for the model's names: a
  client on any machine sets ``HF_ENDPOINT=<service URL>/hf`` and loads by name, with no
  Hub reachable. With ``--api-key``, the key goes in ``HF_TOKEN`` (sent as a bearer token).
* `seed_cache` puts the same files into this machine's Hugging Face cache under the
  tokenizer's name when the service starts, so that clients here load it with no setting
  at all, offline too. It never replaces another copy of that name there.

Only config and tokenizer files are served (`HubRepo.of`), never weights. The files of
one model form one "commit" whose id hashes their contents, so a client's cache keeps
them until they change. (No ``from __future__ import annotations``: FastAPI reads the
routes' ``Request`` annotations, imported inside `add_hub_routes`, at definition time.)
"""

import hashlib
import hmac
import logging
import re
import shutil
from pathlib import Path
from typing import Any

import attrs

__all__ = ["HUB_PREFIX", "HubRepo", "add_hub_routes", "hub_name_problem", "seed_cache"]

log = logging.getLogger("nexrl_service")

HUB_PREFIX = "/hf"
"""Where the Hub's protocol is answered: clients set ``HF_ENDPOINT=<service URL>/hf``."""

SERVED_SUFFIXES = (".json", ".jinja", ".txt", ".model", ".tiktoken")
"""Config, tokenizer and chat-template files (``tokenizer.model`` is SentencePiece's);
weights have other suffixes and are never served."""
TEMPLATES_DIR = "additional_chat_templates"
"""A subfolder transformers lists and reads chat templates from."""

_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def hub_name_problem(name: str) -> str | None:
    """Why ``name`` is not a Hugging Face-style ``Org/Name`` (the form the cookbook's
    lookups and the Hub's protocol take), or None when it is one."""
    if not _REPO_ID.match(name) or "--" in name or ".." in name or name.endswith((".", "-", ".git")) or len(name) > 96:
        return (
            f"{name!r} is not a Hugging Face-style name Org/Name (letters, digits, '.', '_', '-', one '/', "
            "at most 96 characters, no '--' or '..'), which tinker-cookbook's lookups and tokenizer downloads need"
        )
    return None


@attrs.frozen
class HubFile:
    """One served file, with what the Hub's answers say of it."""

    path: Path
    size: int
    sha256: str


@attrs.frozen
class HubRepo:
    """The files served under the model's names, as one Hub "commit"."""

    names: tuple[str, ...]
    """Served model name and tokenizer id, those of them that are Hugging Face-style names."""
    files: dict[str, HubFile]
    """Path in the repository (``/``-separated) → the file."""
    commit: str
    """40 hex digits hashing every file's path and contents."""

    @classmethod
    def of(cls, names: tuple[str, ...], directory: Path) -> "HubRepo":
        candidates = [p for p in sorted(directory.iterdir()) if p.is_file()]
        templates = directory / TEMPLATES_DIR
        if templates.is_dir():
            candidates += [p for p in sorted(templates.iterdir()) if p.is_file()]
        files = {}
        for path in candidates:
            if path.suffix in SERVED_SUFFIXES:
                data = path.read_bytes()
                files[path.relative_to(directory).as_posix()] = HubFile(path, len(data), hashlib.sha256(data).hexdigest())
        listing = "\n".join(f"{name} {file.sha256}" for name, file in files.items())
        served = tuple(dict.fromkeys(name for name in names if hub_name_problem(name) is None))
        return cls(served, files, hashlib.sha1(listing.encode()).hexdigest())

    def info(self, name: str) -> dict[str, Any]:
        """The Hub's ``/api/models/{name}`` answer."""
        return {
            "id": name,
            "modelId": name,
            "sha": self.commit,
            "private": False,
            "tags": [],
            "library_name": "transformers",
            "siblings": [{"rfilename": path} for path in self.files],
        }

    def tree(self, folder: str) -> list[dict[str, Any]] | None:
        """The Hub's file tree under ``folder`` (not recursive); None for no such folder."""
        prefix = f"{folder.strip('/')}/" if folder.strip("/") else ""
        if prefix and not any(path.startswith(prefix) for path in self.files):
            return None
        entries: dict[str, dict[str, Any]] = {}
        for path, file in self.files.items():
            if not path.startswith(prefix):
                continue
            head, sep, _ = path[len(prefix) :].partition("/")
            if sep:
                entries.setdefault(prefix + head, {"type": "directory", "path": prefix + head, "oid": self.commit})
            else:
                entries[path] = {"type": "file", "path": path, "size": file.size, "oid": file.sha256}
        return list(entries.values())


def seed_cache(repo: HubRepo, name: str, cache_dir: Path | None = None) -> bool:
    """Put ``repo``'s files into the Hugging Face cache (``HF_HUB_CACHE``) as repository
    ``name`` at its ``main`` revision, laid out as a download would leave them; False, with
    a warning, when the cache already holds another ``main`` of that name (another model's
    files, never overwritten)."""
    from huggingface_hub import constants

    org, _, model = name.partition("/")
    root = Path(cache_dir or constants.HF_HUB_CACHE) / f"models--{org}--{model}"
    ref = root / "refs" / "main"
    if ref.is_file() and ref.read_text().strip() != repo.commit:
        log.warning(
            "the Hugging Face cache holds other files as %s (%s): clients on this machine that load %s by name get "
            "those; HF_ENDPOINT=<service URL>%s gets the served ones",
            name, root, name, HUB_PREFIX,
        )  # fmt: skip
        return False
    snapshot = root / "snapshots" / repo.commit
    for path, file in repo.files.items():
        blob = root / "blobs" / file.sha256
        if not blob.is_file():
            blob.parent.mkdir(parents=True, exist_ok=True)
            partial = blob.with_suffix(".incomplete")
            shutil.copyfile(file.path, partial)
            partial.replace(blob)
        link = snapshot / path
        if not link.exists():
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(Path(*[".."] * (len(Path(path).parts) + 1), "blobs", file.sha256))
    ref.parent.mkdir(parents=True, exist_ok=True)
    ref.write_text(repo.commit)
    return True


def add_hub_routes(app: Any, repo: HubRepo, api_key: str | None) -> None:
    """Answer the Hub's protocol for ``repo`` under `HUB_PREFIX` (see the module docstring).

    Errors carry the Hub's ``X-Error-Code`` header, which huggingface_hub turns into its own
    exceptions (a missing optional file is ``EntryNotFound``, which loaders skip)."""
    from fastapi import Request
    from fastapi.responses import FileResponse, JSONResponse, Response

    expected = api_key.encode("utf-8") if api_key else None

    def refusal(request: Request, name: str, revision: str = "main") -> Response | None:
        if expected is not None:
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode("utf-8"), expected):
                message = "this service was started with --api-key: set HF_TOKEN to that key"
                return JSONResponse({"error": message}, status_code=401, headers={"X-Error-Message": message})
        if name not in repo.names:
            served = ", ".join(repo.names) or "none (start the service with --model-name Org/Name)"
            message = f"repository {name!r} is not served here; served: {served}"
            return JSONResponse({"error": message}, status_code=404, headers={"X-Error-Code": "RepoNotFound", "X-Error-Message": message})
        if revision not in ("main", repo.commit):
            message = f"revision {revision!r} of {name!r} is not served here; served: main ({repo.commit})"
            return JSONResponse(
                {"error": message}, status_code=404, headers={"X-Error-Code": "RevisionNotFound", "X-Error-Message": message}
            )
        return None

    def missing(path: str) -> Response:
        message = f"{path!r} is not served here"
        headers = {"X-Error-Code": "EntryNotFound", "X-Error-Message": message, "X-Repo-Commit": repo.commit}
        return JSONResponse({"error": message}, status_code=404, headers=headers)

    @app.api_route(HUB_PREFIX + "/{org}/{model}/resolve/{revision}/{path:path}", methods=["GET", "HEAD"])
    def resolve(org: str, model: str, revision: str, path: str, request: Request) -> Response:
        refused = refusal(request, f"{org}/{model}", revision)
        if refused is not None:
            return refused
        file = repo.files.get(path)
        if file is None:
            return missing(path)
        headers = {"X-Repo-Commit": repo.commit, "ETag": f'"{file.sha256}"'}
        if request.method == "HEAD":
            return Response(headers={**headers, "Content-Length": str(file.size)})
        return FileResponse(file.path, headers=headers)

    @app.get(HUB_PREFIX + "/api/models/{org}/{model}")
    @app.get(HUB_PREFIX + "/api/models/{org}/{model}/revision/{revision}")
    def model_info(org: str, model: str, request: Request, revision: str = "main") -> Response:
        return refusal(request, f"{org}/{model}", revision) or JSONResponse(repo.info(f"{org}/{model}"))

    @app.get(HUB_PREFIX + "/api/models/{org}/{model}/tree/{revision}")
    @app.get(HUB_PREFIX + "/api/models/{org}/{model}/tree/{revision}/{folder:path}")
    def tree(org: str, model: str, revision: str, request: Request, folder: str = "") -> Response:
        refused = refusal(request, f"{org}/{model}", revision)
        if refused is not None:
            return refused
        entries = repo.tree(folder)
        return missing(folder) if entries is None else JSONResponse(entries)
