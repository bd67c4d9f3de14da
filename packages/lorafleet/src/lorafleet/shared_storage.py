"""The shared adapter root: storage the trainer writes and the controller and rollouts read.

Where every replica mounts the same folder at the same path (one machine, or a ReadWriteMany
volume), a published adapter travels by reference: the trainer writes the PEFT folder at
`<root>/adapters/<registration_id>/<version>/` and answers a file:// URI, SHA-256 and size per
file; the controller forwards those references; each rollout reads the files itself and
checks every digest before serving. The bytes never pass through the controller, whose memory
and network would otherwise carry every version to every replica. A version's folder is
written once (temporary folder, then rename): a repeated publish of the same version answers
what is already there, never a mix.

Torch- and gRPC-free: the three services share these rules.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from lorafleet import durable
from lorafleet.digests import sha256_file
from lorafleet.errors import FailedPrecondition, InvalidArgument
from lorafleet.settings import SettingsError

ADAPTERS = "adapters"
_REGISTRATION = re.compile(r"[A-Za-z0-9._:-]{1,200}")


@dataclass(frozen=True)
class FileRef:
    """One file of an adapter on shared storage (the BlobRef of the wire)."""

    uri: str
    sha256: str
    size_bytes: int


def check_root(root: Path, variable: str) -> Path:
    """Start-up check of a shared adapter root: absolute (every replica must name the same
    place) and a writable folder (created when missing). Raises SettingsError naming
    `variable`, so a bad deployment fails at once."""
    if not root.is_absolute():
        raise SettingsError(
            f"{variable}={root}: must be an absolute path (the same on every replica)"
        )
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".probe-{uuid.uuid4().hex}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise SettingsError(f"{variable}={root}: not a writable folder ({exc})") from None
    return root.resolve()


def adapter_folder(root: Path, registration_id: str, version: int) -> Path:
    if not _REGISTRATION.fullmatch(registration_id) or registration_id in (".", ".."):
        raise InvalidArgument("not usable as a folder name", field="registration_id")
    if version < 1:
        raise InvalidArgument(f"version {version} must be >= 1", field="version")
    return root / ADAPTERS / registration_id / str(version)


def describe(folder: Path) -> dict[str, FileRef]:
    """Blocking: name -> reference of every file of a written adapter folder."""
    return {
        p.name: FileRef(p.as_uri(), sha256_file(p), p.stat().st_size)
        for p in sorted(folder.iterdir())
        if p.is_file()
    }


def publish_folder(staged: Path, final: Path) -> dict[str, FileRef]:
    """Blocking: move a fully written folder to `final` unless a previous attempt already put
    one there (then `staged` is dropped and the existing files are described)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        durable.commit_folder(staged, final)
    except OSError:
        if not final.is_dir():
            raise
    return describe(final)


def resolve(root: Path, uri: str, field: str) -> Path:
    """The file a reference names; it must be a file:// URI inside `root`, so a header can
    never make a replica read anything else."""
    parsed = urlparse(uri)
    if parsed.scheme != "file" or not parsed.path:
        raise InvalidArgument(f"expected a file:// URI, got {uri!r}", field=field)
    path = Path(unquote(parsed.path)).resolve()
    if not path.is_relative_to(root):
        raise FailedPrecondition(
            f"{uri} is not inside this replica's shared adapter root {root}",
            field=field,
            reason="NOT_SHARED",
        )
    return path


def common_folder(root: Path, refs: dict[str, FileRef], field: str) -> Path:
    """The one folder every reference of an adapter lies in (the version's folder)."""
    folders = {resolve(root, ref.uri, f"{field}[{name}].uri").parent for name, ref in refs.items()}
    if len(folders) != 1:
        raise InvalidArgument(f"the files must lie in one folder, got {len(folders)}", field=field)
    return folders.pop()
