"""The fleet's TLS identity: which CA to trust, which certificate to present, who is admin.

Read once per process from LORAFLEET_TLS_* (`TlsSettings`) and checked at start-up: either
all three files are given and readable, or none (plaintext, development only). The gRPC
credentials built from it live in `lorafleet.rpc.auth`; this module stays free of grpc.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from lorafleet.settings import TLS_PREFIX, SettingsError, TlsSettings, load_settings

FILES = ("ca_file", "cert_file", "key_file")


@dataclass(frozen=True)
class TlsIdentity:
    """PEM bytes of the CA bundle, this process's certificate and its key."""

    ca: bytes
    cert: bytes
    key: bytes
    server_name: str = ""
    admin_names: tuple[str, ...] = ("lorafleet-admin",)


def identity_from_settings(settings: TlsSettings) -> TlsIdentity | None:
    """The identity the settings name, or None when TLS is off; SettingsError names the
    variable when only some files are set or one cannot be read."""
    given = {name: getattr(settings, name) for name in FILES}
    missing = [TLS_PREFIX + n.upper() for n, path in given.items() if path is None]
    if len(missing) == len(FILES):
        return None
    if missing:
        raise SettingsError(
            f"{', '.join(missing)} must be set too: TLS needs all of CA, certificate and key"
        )
    data = {}
    for name, path in given.items():
        try:
            data[name] = Path(path).read_bytes()
        except OSError as exc:
            raise SettingsError(f"{TLS_PREFIX}{name.upper()}={path}: {exc.strerror}") from None
        if b"-----BEGIN " not in data[name]:
            raise SettingsError(f"{TLS_PREFIX}{name.upper()}={path}: not a PEM file")
    return TlsIdentity(
        ca=data["ca_file"],
        cert=data["cert_file"],
        key=data["key_file"],
        server_name=settings.server_name,
        admin_names=settings.admin_names,
    )


@functools.cache
def identity_from_env() -> TlsIdentity | None:
    """This process's identity from LORAFLEET_TLS_* (read once: servers and channels agree)."""
    return identity_from_settings(load_settings(TlsSettings, TLS_PREFIX))
