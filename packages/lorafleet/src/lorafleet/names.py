"""The one rule for names that become path parts: checkpoint, sampler and job names.

A name ends up as a folder under a storage root (`<root>/<run>/<name>`), in a
`tinker://<run>/<kind>/<name>` path and in a download's file name, so it must be exactly one
harmless path part. The gateway checks it to answer 400 naming the field; the controller
checks it again on every operation payload and job parameter; the trainer resolves every path
under its root as a second wall (`resolve_under`). Nothing else spells these rules.
"""

from __future__ import annotations

import re
from pathlib import Path

from lorafleet.errors import InvalidArgument

MAX_NAME_LENGTH = 128
MAX_RUN_ID_LENGTH = 256
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
# A run id (`session-<hex>:train:<n>`) is also one path part; it may hold ':'.
_RUN_ID = re.compile(r"[A-Za-z0-9_.:\-]+")
_SHOWN = 40  # characters of a refused value echoed back (a 10 KB name is not)


def _shown(value: str) -> str:
    return repr(value if len(value) <= _SHOWN else value[:_SHOWN] + "...")


def check_name(name: str, field: str = "name") -> str:
    """A checkpoint, sampler or job name: 1-128 of letters, digits, '_', '.', '-', not
    starting with '.' (which refuses '.' and '..', and keeps the trainer's own hidden
    temporary folders out of reach). Returns the name; InvalidArgument naming `field`."""
    if len(name) > MAX_NAME_LENGTH:
        raise InvalidArgument(
            f"name is {len(name)} characters long (at most {MAX_NAME_LENGTH})", field=field
        )
    if not _NAME.fullmatch(name) or name.startswith("."):
        raise InvalidArgument(
            f"{_shown(name)} is not a valid name: 1-{MAX_NAME_LENGTH} of letters, digits, "
            "'_', '.', '-', not starting with '.' (no separators or control characters)",
            field=field,
        )
    return name


def check_run_id(run_id: str, field: str = "run_id") -> str:
    """A training run id as it appears in a path: one part, no separators, not '.'/'..'."""
    if len(run_id) > MAX_RUN_ID_LENGTH or not _RUN_ID.fullmatch(run_id) or run_id.startswith("."):
        raise InvalidArgument(f"{_shown(run_id)} is not a training run id", field=field)
    return run_id


def resolve_under(root: Path, *parts: str, field: str = "path") -> Path:
    """`root / parts...`, resolved, refused (InvalidArgument naming `field`) unless it lies
    strictly inside `root`: the second wall behind `check_name`, for every path a service
    builds from a name it was sent."""
    base = root.resolve()
    target = base.joinpath(*parts).resolve()
    if target == base or not target.is_relative_to(base):
        raise InvalidArgument(
            f"{_shown('/'.join(parts))} lies outside the storage root", field=field
        )
    return target
