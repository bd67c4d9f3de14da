"""Served base-model names that resolve: every model the fleet serves is in the local
Hugging Face hub cache under its name, so `AutoTokenizer.from_pretrained(name)` works offline.

Tinker clients (the SDK's `SamplingClient.get_tokenizer()`, tinker-cookbook's `model_name`)
load the tokenizer by the served base-model name. On the hosted service that name is a hub
id; here models come from local folders, so each folder is installed into the hub cache the
way a download would have put it (`models--org--name/{blobs,snapshots/<rev>,refs/main}`),
under the id the folder records (`lorafleet.json` → `hub_id`: SmolLM2 keeps
`HuggingFaceTB/SmolLM2-135M-Instruct`, locally built models get `lorafleet/<name>`), or
`local/<folder name>` for a folder that records none. An operator may override the name
(`BASE_MODEL_NAME`, chart value `model.name`); a cluster serving `Qwen/Qwen3-8B` from mounted
weights then resolves for clients that can reach the real hub, and on the fleet's own
machines from the cache. Torch-free.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from lorafleet.digests import sha256_file

RECORD = "lorafleet.json"
LOCAL_ORG = "local"
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9][A-Za-z0-9_.\-]*$")
# Folder contents that are not part of the model a download would bring.
_SKIP = frozenset({RECORD})


def hub_cache() -> Path:
    """The hub cache transformers reads (HF_HUB_CACHE / HF_HOME aware)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def check_hub_id(name: str, field: str = "BASE_MODEL_NAME") -> str:
    if not _ID_RE.match(name):
        raise ValueError(f"{field}={name!r}: a served name must be a hub id 'org/name'")
    return name


def record_hub_id(model_dir: Path, hub_id: str) -> None:
    """Write the folder's own hub id (model builders call this)."""
    check_hub_id(hub_id, "hub_id")
    (Path(model_dir) / RECORD).write_text(json.dumps({"hub_id": hub_id}) + "\n")


def served_name(model_dir: Path, override: str = "") -> str:
    """The name the fleet serves `model_dir` under (see the module docstring)."""
    if override:
        return check_hub_id(override)
    record = Path(model_dir) / RECORD
    if record.is_file():
        return check_hub_id(json.loads(record.read_text())["hub_id"], str(record))
    name = re.sub(r"[^A-Za-z0-9_.\-]", "-", Path(model_dir).resolve().name)
    return f"{LOCAL_ORG}/{name}"


def install(model_dir: Path, hub_id: str, cache: Path | None = None) -> Path:
    """Install `model_dir` into the hub cache as `hub_id`; returns the snapshot folder.

    Idempotent and safe to run from several processes at once: blobs are content-addressed
    (sha256) and written by rename; the revision is a digest of the file list, so the same
    folder always lands in the same snapshot. Blobs are hard links when the cache is on the
    same filesystem (no copy of the weights), else copies.
    """
    check_hub_id(hub_id, "hub_id")
    model_dir = Path(model_dir)
    repo = (cache or hub_cache()) / f"models--{hub_id.replace('/', '--')}"
    files = sorted(p for p in model_dir.rglob("*") if p.is_file() and p.name not in _SKIP)
    digests = {p.relative_to(model_dir).as_posix(): sha256_file(p) for p in files}
    revision = hashlib.sha1(json.dumps(digests, sort_keys=True).encode()).hexdigest()
    snapshot = repo / "snapshots" / revision
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for rel, digest in digests.items():
        blob = repo / "blobs" / digest
        if not blob.exists():
            fd, tmp = tempfile.mkstemp(dir=blob.parent, prefix=".incoming-")
            os.close(fd)
            os.unlink(tmp)
            try:
                os.link(model_dir / rel, tmp)
            except OSError:
                shutil.copyfile(model_dir / rel, tmp)
            os.replace(tmp, blob)
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            target = os.path.relpath(blob, link.parent)
            tmp_link = link.with_name(f".{link.name}.incoming-{os.getpid()}")
            os.symlink(target, tmp_link)
            os.replace(tmp_link, link)
    (repo / "refs").mkdir(exist_ok=True)
    ref = repo / "refs" / "main"
    if not ref.is_file() or ref.read_text() != revision:
        tmp_ref = ref.with_name(f".main.incoming-{os.getpid()}")
        tmp_ref.write_text(revision)
        os.replace(tmp_ref, ref)
    return snapshot
