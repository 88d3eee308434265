"""Signed download URLs: a URL opens exactly its file, until it expires, and nothing else."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

import pytest

from nexrl_service.downloads import DOWNLOAD_ROUTE, SignedDownloads
from nexrl_service.errors import Forbidden, NotFound

NOW = 1_000_000.0


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    checkpoint = tmp_path / "runs" / "model-1" / "external" / "final.ab12"
    (checkpoint / "adapter").mkdir(parents=True)
    (checkpoint / "config.json").write_text("{}")
    (checkpoint / "adapter" / "adapter_config.json").write_text('{"r": 4}')
    (tmp_path / "runs" / "model-2").mkdir()
    (tmp_path / "runs" / "model-2" / "secret.bin").write_bytes(b"other tenant")
    (tmp_path / "outside.txt").write_text("not served")
    return checkpoint


def parts(url: str) -> tuple[str, int, str]:
    split = urlsplit(url)
    query = parse_qs(split.query)
    assert split.path.startswith(DOWNLOAD_ROUTE + "/")
    return unquote(split.path[len(DOWNLOAD_ROUTE) + 1 :]), int(query["expires"][0]), query["signature"][0]


def test_each_file_gets_a_url_that_opens_it(tree: Path) -> None:
    downloads = SignedDownloads(tree.parents[2], ttl_s=60)
    signed = downloads.sign(tree, "http://127.0.0.1:5/", now=NOW)
    assert sorted(signed.urls) == ["adapter/adapter_config.json", "config.json"]
    assert signed.expires_at == NOW + 60
    for name, url in signed.urls.items():
        assert url.startswith(f"http://127.0.0.1:5{DOWNLOAD_ROUTE}/")
        assert downloads.resolve(*parts(url), now=NOW + 59) == (tree / name).resolve()


def test_expired_tampered_or_foreign_urls_are_refused(tree: Path) -> None:
    downloads = SignedDownloads(tree.parents[2], ttl_s=60)
    relative, expires, signature = parts(downloads.sign(tree, "http://h", now=NOW).urls["config.json"])
    with pytest.raises(Forbidden, match="expired"):
        downloads.resolve(relative, expires, signature, now=NOW + 61)
    with pytest.raises(Forbidden, match="invalid download signature"):
        downloads.resolve(relative, expires + 3600, signature, now=NOW)
    with pytest.raises(Forbidden, match="invalid download signature"):
        downloads.resolve("model-2/secret.bin", expires, signature, now=NOW)
    with pytest.raises(Forbidden, match="invalid download signature"):  # another process's secret
        SignedDownloads(tree.parents[2], ttl_s=60).resolve(relative, expires, signature, now=NOW)


def test_a_signature_never_reaches_outside_the_tree(tree: Path) -> None:
    root = tree.parents[2]
    downloads = SignedDownloads(root, ttl_s=60, secret=b"k")
    with pytest.raises(ValueError, match="outside the data directory"):
        downloads.sign(root.parent, "http://h", now=NOW)
    forged = SignedDownloads(root, ttl_s=60, secret=b"k")._signature("../outside.txt", int(NOW + 60))
    with pytest.raises(NotFound):
        downloads.resolve("../outside.txt", int(NOW + 60), forged, now=NOW)


def test_a_deleted_file_is_not_found(tree: Path) -> None:
    downloads = SignedDownloads(tree.parents[2], ttl_s=60)
    url = downloads.sign(tree, "http://h", now=NOW).urls["config.json"]
    (tree / "config.json").unlink()
    with pytest.raises(NotFound, match="no file"):
        downloads.resolve(*parts(url), now=NOW)
