"""On-disk formats: saved states (adapter + optimizer) and HF PEFT adapter folders.

A saved state is a folder `<storage_root>/<registration_id>/<name>/` holding a PEFT adapter
(adapter_config.json + adapter_model.safetensors with PEFT key names), optionally
optimizer.safetensors (AdamW moments keyed by the PEFT name), trainer_state.json (spec,
targets, step count, applied operation ids) and manifest.json with the SHA-256 and size of
every other file. It is written into a temporary folder and renamed into place, so a
reader sees all of it or nothing; a load re-hashes every file, so a torn or edited state is
refused instead of silently training on garbage. Names are immutable.
"""

from __future__ import annotations

import errno
import json
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from lorafleet import durable, manifests, names
from lorafleet.digests import FileDigest, sha256_file
from lorafleet.errors import AlreadyExists, FailedPrecondition, InvalidArgument, ResourceExhausted
from lorafleet.manifests import MANIFEST, STATE_FORMAT
from lorafleet_trainer.domain import StateRef

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
TRAINER_STATE = "trainer_state.json"


def peft_key(module: str, which: str) -> str:
    """PEFT's saved key, e.g. base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight."""
    return f"base_model.model.{module}.lora_{which}.weight"


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, default=sorted) + "\n")


def write_adapter(folder: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """An HF PEFT adapter folder: PeftModel.from_pretrained(base, folder) loads it."""
    folder.mkdir(parents=True, exist_ok=True)
    _write_json(folder / ADAPTER_CONFIG, config)
    save_file(
        {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()},
        str(folder / ADAPTER_WEIGHTS),
        metadata={"format": "pt"},
    )


def read_adapter(folder: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    cfg_path, weights_path = folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS
    for p in (cfg_path, weights_path):
        if not p.is_file():
            raise InvalidArgument(f"the adapter has no {p.name}", field="adapter")
    try:
        config = json.loads(cfg_path.read_text())
        tensors = load_file(str(weights_path))
    except (ValueError, OSError) as exc:
        raise InvalidArgument(f"unreadable adapter: {exc}", field="adapter") from None
    return config, tensors


def state_dir(root: Path, registration_id: str, name: str) -> Path:
    """`<root>/<registration_id>/<name>`: the run id must be one path part, and the folder
    must resolve inside the run's own folder under the root (the second wall behind the
    name rule every layer checks first: a name that got through anyway cannot escape)."""
    names.check_run_id(registration_id, "registration_id")
    run = names.resolve_under(root, registration_id, field="registration_id")
    return names.resolve_under(run, name, field="name")


def save_state(
    final: Path,
    *,
    adapter_config: dict[str, Any],
    adapter: dict[str, torch.Tensor],
    optimizer: dict[str, torch.Tensor] | None,
    trainer_state: dict[str, Any],
) -> StateRef:
    """Write a state folder atomically; refuses an existing name (AlreadyExists). A full
    disk is ResourceExhausted naming the folder and the space left, and leaves nothing."""
    if final.exists():
        raise AlreadyExists(f"a state named {final.name!r} already exists", field="name")
    tmp = final.parent / f".tmp-{final.name}-{uuid.uuid4().hex}"
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        write_adapter(tmp, adapter_config, adapter)
        if optimizer is not None:
            save_file(
                {k: v.detach().to("cpu").contiguous() for k, v in optimizer.items()},
                str(tmp / OPTIMIZER_FILE),
                metadata={"format": "pt"},
            )
        _write_json(tmp / TRAINER_STATE, {"format": STATE_FORMAT, **trainer_state})
        files = {p.name: FileDigest(sha256_file(p), p.stat().st_size) for p in tmp.iterdir()}
        _write_json(tmp / MANIFEST, manifests.render(files))
        durable.commit_folder(tmp, final)
    except (OSError, SafetensorError) as exc:
        if not out_of_space(exc):
            raise
        full = True
    else:
        full = False
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    if full:  # reported once the partial folder is gone: the space a retry would have
        raise disk_full(final)
    return _ref(final)


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def out_of_space(exc: Exception) -> bool:
    """ENOSPC or EDQUOT, raised by Python (OSError) or by safetensors' Rust writer, which
    reports it as a SafetensorError carrying "os error <errno>"."""
    if isinstance(exc, OSError):
        return exc.errno in _NO_SPACE
    return any(f"(os error {code})" in str(exc) for code in _NO_SPACE)


def disk_full(path: Path) -> ResourceExhausted:
    """ENOSPC/EDQUOT as the client should see it: which folder, how much space is left.
    Nothing was written (the temporary folder is removed), so the run and its earlier
    states are intact and the save can be retried once space is freed."""
    try:
        free = shutil.disk_usage(_existing(path)).free
    except OSError:
        free = -1
    left = f"{free} bytes free" if free >= 0 else "free space unknown"
    return ResourceExhausted(
        f"no space left to write {path} ({left} on its filesystem)",
        field="storage_root",
        reason="DISK_FULL",
        retry_after=60.0,
    )


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _ref(final: Path) -> StateRef:
    manifest = final / MANIFEST
    size = sum(p.stat().st_size for p in final.iterdir())
    return StateRef(uri=final.resolve().as_uri(), sha256=sha256_file(manifest), size_bytes=size)


def saved_by(final: Path, operation_id: str) -> StateRef | None:
    """The state at `final` when `operation_id` wrote it, else None.

    A save whose trainer died before answering runs again on the process that rebuilt the
    run (by replay, to the same weights): it must answer with the state already written,
    not refuse the name as taken. A folder only appears by an atomic rename, complete.
    """
    try:
        state = json.loads((final / TRAINER_STATE).read_text())
    except (OSError, ValueError):
        return None
    return _ref(final) if state.get("saved_by") == operation_id else None


@dataclass
class LoadedState:
    adapter_config: dict[str, Any]
    adapter: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor] | None
    trainer_state: dict[str, Any]


def _torn(message: str) -> FailedPrecondition:
    return FailedPrecondition(message, field="manifest", reason="TORN_STATE")


def resolve_uri(root: Path, uri: str) -> Path:
    """The state folder a BlobRef names; it must lie inside the storage root."""
    parsed = urlparse(uri)
    raw = unquote(parsed.path) if parsed.scheme == "file" else uri
    if parsed.scheme not in ("", "file") or not raw:
        raise InvalidArgument("expected a file:// URI of a saved state", field="manifest.uri")
    path = Path(raw).resolve()
    if not path.is_relative_to(root.resolve()):
        raise InvalidArgument("not inside this trainer's storage root", field="manifest.uri")
    return path


def open_state(root: Path, ref: StateRef) -> LoadedState:
    """Read and verify a state folder: manifest digest, every file's hash and size."""
    folder = resolve_uri(root, ref.uri)
    manifest_path = folder / MANIFEST
    if not folder.is_dir():
        raise FailedPrecondition(
            "no saved state at this URI", field="manifest.uri", reason="STATE_NOT_FOUND"
        )
    if not manifest_path.is_file():
        raise _torn("the state has no manifest.json (torn save)")
    if ref.sha256 and sha256_file(manifest_path) != ref.sha256:
        raise _torn("manifest.json does not match the expected SHA-256")
    try:
        manifest = manifests.parse(manifest_path.read_bytes())
    except ValueError as exc:
        raise _torn(str(exc)) from None
    if manifest.format != STATE_FORMAT:
        raise FailedPrecondition(
            f"unknown state format {manifest.format!r}",
            field="manifest",
            reason="STATE_FORMAT",
        )
    files = manifest.files
    for name, meta in files.items():
        p = folder / name
        if not p.is_file() or p.stat().st_size != meta.size or sha256_file(p) != meta.sha256:
            raise _torn(f"{name} is missing or does not match the manifest (torn save)")
    for required in (ADAPTER_CONFIG, ADAPTER_WEIGHTS, TRAINER_STATE):
        if required not in files:
            raise _torn(f"the manifest lists no {required}")
    config, adapter = read_adapter(folder)
    optimizer = load_file(str(folder / OPTIMIZER_FILE)) if OPTIMIZER_FILE in files else None
    trainer_state = json.loads((folder / TRAINER_STATE).read_text())
    return LoadedState(config, adapter, optimizer, trainer_state)
