"""Signed, expiring download tokens for checkpoint files, and the key that signs them.

Download URLs are fetched by tools that send no API key (the 0.24.1 CLI's archive download,
0.38's external_weights_urls), so the URL itself carries the authorisation: the tenant, the
checkpoint path and an expiry, HMAC-SHA256-signed with the gateway's download secret. A URL
must work on whichever replica the load balancer picks and after a gateway restart, so the
secret is never per process: it comes from settings or from a key file (`load_secret`).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
import time
from pathlib import Path

from lorafleet import errors
from lorafleet.settings import SettingsError

MIN_SECRET_CHARS = 16


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def load_secret(secret: str, secret_file: str, env_prefix: str) -> bytes:
    """The signing key: `secret` when set, else the content of `secret_file`, which is
    created (0600, exclusive, so racing replicas agree) with a random key when missing."""
    if secret:
        if len(secret) < MIN_SECRET_CHARS:
            raise SettingsError(
                f"{env_prefix}DOWNLOAD_SECRET: must be at least {MIN_SECRET_CHARS} characters"
            )
        return secret.encode()
    path = Path(secret_file).expanduser()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass
        else:
            with os.fdopen(fd, "w") as out:
                out.write(secrets.token_urlsafe(48))
        key = path.read_text().strip()
    except OSError as exc:
        raise SettingsError(
            f"{env_prefix}DOWNLOAD_SECRET_FILE={secret_file}: {exc.strerror or exc}; "
            f"set {env_prefix}DOWNLOAD_SECRET instead"
        ) from None
    if len(key) < MIN_SECRET_CHARS:
        raise SettingsError(
            f"{env_prefix}DOWNLOAD_SECRET_FILE={secret_file}: holds fewer than "
            f"{MIN_SECRET_CHARS} characters"
        )
    return key.encode()


class Signer:
    def __init__(self, secret: bytes) -> None:
        self._secret = secret

    def _mac(self, payload: str) -> str:
        return _b64(
            hmac.new(self._secret, payload.encode("utf-8", "replace"), hashlib.sha256).digest()
        )

    def sign(self, tenant: str, tinker_path: str, expires: float) -> str:
        payload = _b64(json.dumps([tenant, tinker_path, int(expires)]).encode())
        return f"{payload}.{self._mac(payload)}"

    def verify(self, token: str) -> tuple[str, str]:
        """(tenant, tinker_path) of a valid token; 401 if forged, 410 if expired."""
        payload, _, mac = token.partition(".")
        # Bytes, not str: compare_digest refuses non-ASCII strings, and tokens come from URLs.
        expected = self._mac(payload).encode()
        if not mac or not hmac.compare_digest(mac.encode("utf-8", "replace"), expected):
            raise errors.PermissionDenied("invalid download token", field="token")
        tenant, path, expires = json.loads(_unb64(payload))
        if expires < time.time():
            raise errors.Expired("download link expired; request a new one", field="token")
        return tenant, path
