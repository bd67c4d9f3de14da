"""Signed, expiring download tokens for checkpoint files.

Download URLs are fetched by tools that send no API key (the 0.24.1 CLI's archive download,
0.38's external_weights_urls), so the URL itself carries the authorisation: the tenant, the
checkpoint path and an expiry, HMAC-SHA256-signed with the gateway's download secret.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time

from lorafleet import errors


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class Signer:
    def __init__(self, secret: bytes) -> None:
        self.secret = secret

    def _mac(self, payload: str) -> str:
        return _b64(
            hmac.new(self.secret, payload.encode("utf-8", "replace"), hashlib.sha256).digest()
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
