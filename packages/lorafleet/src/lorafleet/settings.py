"""Settings from environment variables, validated at start-up.

Each service declares a frozen dataclass whose fields carry their documentation and limits
in `metadata` ({"doc", "min", "max", "choices"}). `load_settings(cls, "LORAFLEET_X_")` reads
`LORAFLEET_X_<FIELD>` for every field, converts and checks it, and raises `SettingsError`
with one line naming the variable and what is wrong, so a bad deployment fails at once with
a message an operator can act on instead of a stack trace minutes later.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")


class SettingsError(ValueError):
    """A setting is missing or malformed; the message names the environment variable."""


def setting(default: Any = dataclasses.MISSING, *, doc: str, **limits: Any) -> Any:
    """A dataclass field with documentation and limits (min, max, choices)."""
    meta = {"doc": doc, **limits}
    if isinstance(default, (list, dict, set)):
        raise TypeError("use a tuple for sequence defaults")
    return dataclasses.field(default=default, metadata=meta)


def _convert(var: str, raw: str, kind: Any) -> Any:
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        if raw == "":
            return None
        return _convert(var, raw, args[0])
    if kind is bool:
        low = raw.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise SettingsError(f"{var}={raw!r}: expected true/false")
    if kind is int:
        try:
            return int(raw)
        except ValueError:
            raise SettingsError(f"{var}={raw!r}: expected an integer") from None
    if kind is float:
        try:
            value = float(raw)
        except ValueError:
            raise SettingsError(f"{var}={raw!r}: expected a number") from None
        if not math.isfinite(value):
            raise SettingsError(f"{var}={raw!r}: expected a finite number")
        return value
    if kind is Path:
        if not raw:
            raise SettingsError(f"{var}: expected a path, got an empty value")
        return Path(raw)
    if origin is tuple:
        return tuple(part.strip() for part in raw.split(",") if part.strip())
    if kind is str:
        return raw
    raise TypeError(f"unsupported settings type {kind!r} for {var}")


def _check(var: str, value: Any, meta: Mapping[str, Any]) -> None:
    if value is None:
        return
    if "min" in meta and value < meta["min"]:
        raise SettingsError(f"{var}={value!r}: must be >= {meta['min']}")
    if "max" in meta and value > meta["max"]:
        raise SettingsError(f"{var}={value!r}: must be <= {meta['max']}")
    if "choices" in meta and value not in meta["choices"]:
        choices = ", ".join(map(str, meta["choices"]))
        raise SettingsError(f"{var}={value!r}: must be one of {choices}")


def load_settings(cls: type[T], prefix: str, env: Mapping[str, str] | None = None) -> T:
    """Build `cls` from `prefix + FIELD` environment variables, validating every field."""
    env = os.environ if env is None else env
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        var = prefix + f.name.upper()
        if var in env:
            value = _convert(var, env[var], hints[f.name])
        elif f.default is not dataclasses.MISSING:
            value = f.default
        else:
            raise SettingsError(f"{var} is required: {f.metadata.get('doc', f.name)}")
        _check(var, value, f.metadata)
        values[f.name] = value
    return cls(**values)


def describe(cls: type, prefix: str) -> str:
    """One line per variable with its default and doc, for `--help` output."""
    lines = []
    for f in dataclasses.fields(cls):
        default = "(required)" if f.default is dataclasses.MISSING else repr(f.default)
        lines.append(f"  {prefix}{f.name.upper()} = {default}\n      {f.metadata.get('doc', '')}")
    return "\n".join(lines)


def load_or_exit(cls: type[T], prefix: str) -> T:
    """For `__main__`: print the one-line error and exit 2 on bad settings."""
    if len(sys.argv) > 1 and sys.argv[1] in ("-h", "--help"):
        print(f"Settings (environment variables):\n{describe(cls, prefix)}")
        raise SystemExit(0)
    try:
        return load_settings(cls, prefix)
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    """What every gRPC service needs to listen, report and stop."""

    host: str = setting("127.0.0.1", doc="Interface to listen on (0.0.0.0 in a cluster).")
    port: int = setting(50051, doc="gRPC port; 0 picks a free one.", min=0, max=65535)
    metrics_port: int = setting(
        0, doc="Prometheus /metrics port; 0 disables the endpoint.", min=0, max=65535
    )
    health_port: int = setting(
        0,
        doc="Plaintext port serving only grpc.health.v1.Health, for probes that cannot present "
        "a client certificate when internal TLS is on; 0 disables it.",
        min=0,
        max=65535,
    )
    grace_seconds: float = setting(
        10.0, doc="How long in-flight RPCs may finish after SIGTERM.", min=0.0, max=600.0
    )
    max_message_bytes: int = setting(
        64 * 1024 * 1024,
        doc="gRPC message-size limit, shared by servers and channels (adapters are streamed).",
        min=4 * 1024 * 1024,
        max=1024 * 1024 * 1024,
    )
    log_level: str = setting(
        "INFO", doc="Log level.", choices=("DEBUG", "INFO", "WARNING", "ERROR")
    )


TLS_PREFIX = "LORAFLEET_TLS_"


@dataclasses.dataclass(frozen=True)
class TlsSettings:
    """Mutual TLS between services, shared by every process of a fleet (LORAFLEET_TLS_*).

    With the three files set, every gRPC server requires a client certificate signed by the
    CA and every channel presents this process's certificate, so a caller without one is
    refused during the handshake. Unset, internal gRPC is plaintext and unauthenticated
    (development only: the services log a warning). `lorafleet up` makes a private CA per run;
    on Kubernetes cert-manager or a Secret provides the files.
    """

    ca_file: Path | None = setting(
        None, doc="PEM CA bundle that signs every fleet certificate (peers are checked with it)."
    )
    cert_file: Path | None = setting(
        None, doc="PEM certificate this process presents, as a server and as a client."
    )
    key_file: Path | None = setting(None, doc="PEM private key of cert_file (mode 0600).")
    server_name: str = setting(
        "",
        doc="Name every server certificate carries, checked instead of the dialed host (for "
        "peers reached by pod IP); empty checks the dialed host.",
    )
    admin_names: tuple[str, ...] = setting(
        ("lorafleet-admin",),
        doc="Certificate common names allowed to call admin RPCs (API keys, fleet status).",
    )
