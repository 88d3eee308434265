"""Signed, expiring download URLs for the files of a checkpoint, for any protocol.

A hosted training API hands out one signed URL per file of an exported checkpoint
(Tinker's ``external_weights_urls``) and its clients fetch each with a plain HTTP GET,
no API key. A local service does the same on its own address: `SignedDownloads.sign`
lists the files under a checkpoint directory and signs each one's path with an expiry
(HMAC-SHA256 under a secret of this process, so URLs end with the process and a
restarted service signs new ones), and `add_download_route` serves them, refusing a
bad or expired signature (403) and any path outside the data directory (404).

Only a caller that passed the protocol's ownership checks gets a signature, so a
tenant can download only its own checkpoints.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import attrs

from nexrl_service.errors import Forbidden, NotFound

__all__ = ["DOWNLOAD_ROUTE", "SignedDownloads", "SignedUrls", "add_download_route"]

DOWNLOAD_ROUTE = "/api/v1/nexrl_downloads"
"""Path prefix of signed download URLs; the file's path below the data directory follows."""


@attrs.frozen(kw_only=True)
class SignedUrls:
    """One signed URL per file of a directory."""

    urls: dict[str, str]
    """File path relative to the directory (``/``-separated) → URL."""
    expires_at: float
    """Unix time after which every URL is refused."""


class SignedDownloads:
    """Signs and checks download URLs for files under ``root`` (the checkpoint tree)."""

    def __init__(self, root: Path, ttl_s: float, secret: bytes | None = None) -> None:
        self.root = Path(root).resolve()
        self.ttl_s = ttl_s
        self._secret = secret if secret is not None else secrets.token_bytes(32)

    def _signature(self, relative: str, expires: int) -> str:
        message = f"{relative}\n{expires}".encode()
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def sign(self, directory: str | Path, base_url: str, now: float | None = None) -> SignedUrls:
        """URLs for every file under ``directory`` (which must lie under ``root``),
        valid for ``ttl_s`` seconds, on the service reached at ``base_url``."""
        directory = Path(directory).resolve()
        if not directory.is_relative_to(self.root):
            raise ValueError(f"{directory} is outside the data directory {self.root}")
        expires = int((time.time() if now is None else now) + self.ttl_s)
        urls = {}
        for path in sorted(p for p in directory.rglob("*") if p.is_file()):
            below_root = path.relative_to(self.root).as_posix()
            query = urlencode({"expires": expires, "signature": self._signature(below_root, expires)})
            urls[path.relative_to(directory).as_posix()] = f"{base_url.rstrip('/')}{DOWNLOAD_ROUTE}/{quote(below_root)}?{query}"
        return SignedUrls(urls=urls, expires_at=float(expires))

    def resolve(self, relative: str, expires: int, signature: str, now: float | None = None) -> Path:
        """The file a signed URL names.

        :raises Forbidden: for a signature that does not match, or an expired URL.
        :raises NotFound: for a file that no longer exists (its checkpoint was deleted).
        """
        # Compared as bytes: compare_digest refuses a str with non-ASCII characters.
        if not hmac.compare_digest(self._signature(relative, expires).encode(), signature.encode("utf-8", "surrogatepass")):
            raise Forbidden("invalid download signature: ask the service for new URLs")
        if (time.time() if now is None else now) > expires:
            raise Forbidden(f"this download URL expired at unix time {expires}: ask the service for new URLs")
        path = (self.root / relative).resolve()
        if not path.is_relative_to(self.root) or not path.is_file():
            raise NotFound(f"no file {relative!r} (its checkpoint may have been deleted)")
        return path


def add_download_route(app: Any, downloads: SignedDownloads) -> None:
    """Serve ``GET DOWNLOAD_ROUTE/<path>?expires=..&signature=..`` on a FastAPI ``app``
    (its handler for `ApiError` turns refusals into 4xx)."""
    from fastapi import Query
    from fastapi.responses import FileResponse

    # The response class is named in the decorator, not in a return annotation: this
    # module's annotations are strings, and FastAPI resolves them in the module's globals
    # when it builds the OpenAPI schema, where a name imported here is not.
    @app.get(
        DOWNLOAD_ROUTE + "/{relative:path}",
        response_class=FileResponse,
        responses={200: {"content": {"application/octet-stream": {}}, "description": "the file"}},
    )
    async def download(relative: str, expires: int = Query(...), signature: str = Query(...)) -> Any:
        return FileResponse(downloads.resolve(relative, expires, signature), media_type="application/octet-stream")
