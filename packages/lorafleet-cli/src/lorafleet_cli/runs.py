"""Run folders and the pointer to the current one, so `down`/`status` find what `up` started."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from lorafleet.settings import TLS_PREFIX, SettingsError, TlsSettings, load_settings
from lorafleet.tls import TlsIdentity, identity_from_settings
from lorafleet_cli.fleet import FleetError


def home() -> Path:
    """LORAFLEET_HOME (default ~/.lorafleet): run folders and the pointer to the current one."""
    return Path(os.environ.get("LORAFLEET_HOME", Path.home() / ".lorafleet"))


def new_run_dir() -> Path:
    path = home() / "runs" / time.strftime("%Y%m%d-%H%M%S")
    suffix = 0
    while path.exists():
        suffix += 1
        path = path.with_name(f"{path.name.split('.')[0]}.{suffix}")
    path.mkdir(parents=True)
    return path


def _pointer() -> Path:
    return home() / "current"


def set_current(run_dir: Path) -> None:
    _pointer().parent.mkdir(parents=True, exist_ok=True)
    _pointer().write_text(str(run_dir.resolve()))


def current() -> Path | None:
    try:
        return Path(_pointer().read_text().strip())
    except FileNotFoundError:
        return None


def clear_current(run_dir: Path) -> None:
    if current() == run_dir.resolve():
        _pointer().unlink(missing_ok=True)


def read_state(run_dir: Path | None) -> dict[str, Any] | None:
    if run_dir is None:
        return None
    try:
        state: dict[str, Any] = json.loads((run_dir / "fleet.json").read_text())  # we wrote it
        return state
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def is_ours(pid: int) -> bool:
    """Guard against PID reuse: only signal processes that look like ours."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return False
    return b"lorafleet" in cmdline or b"redis-server" in cmdline


def admin_identity(state: dict[str, Any]) -> TlsIdentity | None:
    """The run's admin certificate (fleet.json names its files), for the CLI's calls."""
    files = state.get("admin_tls") or {}
    if not files:
        return None
    try:
        return identity_from_settings(load_settings(TlsSettings, TLS_PREFIX, env=files))
    except SettingsError as exc:
        raise FleetError(f"the run's admin certificate is unusable: {exc}") from None
