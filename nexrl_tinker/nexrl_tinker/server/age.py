"""age encryption of exported weights (``save_weights_external(age_encryption_recipients=...)``).

Hosted Tinker encrypts every file of an export to the caller's age recipients and stores
it with a ``.age`` suffix; tinker-cookbook's ``weights.download`` of a training
checkpoint relies on that (it exports to a key it generated, then decrypts). This
service does the same with `pyrage`, the library the cookbook decrypts with, so the
plaintext of an encrypted export never stays on the service's disk.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import pyrage

from nexrl_service.runtime import BadRequest

__all__ = ["AGE_SUFFIX", "MAX_RECIPIENTS", "AgeRecipients"]

AGE_SUFFIX = ".age"
MAX_RECIPIENTS = 10
"""The SDK documents at most 10 recipients."""

_pyrage: Any = pyrage  # the extension module ships no type information


def _parse_one(index: int, text: object) -> Any:
    if not isinstance(text, str) or not text.strip():
        raise BadRequest(f"age_encryption_recipients[{index}] must be a non-empty string (an age1... key or an SSH public key)")
    text = text.strip()
    parser = _pyrage.ssh.Recipient if text.startswith(("ssh-", "ecdsa-", "sk-")) else _pyrage.x25519.Recipient
    try:
        return parser.from_str(text)
    except _pyrage.RecipientError as error:
        raise BadRequest(
            f"age_encryption_recipients[{index}] {text[:80]!r} is not an age recipient ({error}); pass an "
            f"'age1...' public key (age-keygen -y) or an SSH public key ('ssh-ed25519 ...', 'ssh-rsa ...')"
        ) from None


@attrs.frozen
class AgeRecipients:
    """Parsed recipients; `encrypt_directory` applies them to an export."""

    recipients: tuple[Any, ...]

    @classmethod
    def parse(cls, texts: Sequence[object]) -> AgeRecipients:
        """Every recipient checked before any work starts.

        :raises BadRequest: naming the recipient that is not an age or SSH public key,
            or when there are more than `MAX_RECIPIENTS`.
        """
        if len(texts) > MAX_RECIPIENTS:
            raise BadRequest(f"age_encryption_recipients has {len(texts)} entries; at most {MAX_RECIPIENTS} are allowed")
        return cls(tuple(_parse_one(index, text) for index, text in enumerate(texts)))

    def encrypt_directory(self, directory: Path) -> None:
        """Replace every file under ``directory`` by ``<name>.age``, encrypted to all recipients."""
        for path in sorted(p for p in directory.rglob("*") if p.is_file()):
            _pyrage.encrypt_file(str(path), str(path.with_name(path.name + AGE_SUFFIX)), list(self.recipients))
            path.unlink()
