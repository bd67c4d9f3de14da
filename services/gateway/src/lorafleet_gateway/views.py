"""Controller records → Tinker's REST JSON shapes (Checkpoint, TrainingRun, cursors, ids).

Tinker ids are structural: a model id is "<session>:train:<n>", a sampler id
"<session>:sample:<n>", a checkpoint path "tinker://<run>/<kind>/<name>" whose checkpoint_id
"<kind>/<name>" contains a slash. The helpers here build and check them in one place.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from lorafleet.errors import InvalidArgument
from lorafleet.v1 import common_pb2
from lorafleet.v1 import controller_pb2 as cpb

TINKER = "tinker://"
CHECKPOINT_KINDS = ("weights", "sampler_weights", "external_weights")
EXTERNAL_PREFIX = "external."
_TYPES = {
    cpb.CHECKPOINT_TYPE_TRAINING: "training",
    cpb.CHECKPOINT_TYPE_SAMPLER: "sampler",
    cpb.CHECKPOINT_TYPE_EXTERNAL: "external",
}


def iso(epoch: float) -> str | None:
    if not epoch:
        return None
    return dt.datetime.fromtimestamp(epoch, dt.UTC).isoformat().replace("+00:00", "Z")


def session_of(model_id: str, field: str = "model_id") -> str:
    """The session part of "<session>:train:<n>" (400 for anything else)."""
    session, sep, seq = model_id.rpartition(":train:")
    if not sep or not session or not seq.isdigit():
        raise InvalidArgument(f"{model_id!r} is not a training run id", field=field)
    return session


def sampler_id(session_id: str, seq: int) -> str:
    return f"{session_id}:sample:{seq}"


def checkpoint_path(run_id: str, checkpoint_id: str, field: str = "checkpoint_id") -> str:
    kind, _, name = checkpoint_id.partition("/")
    if kind not in CHECKPOINT_KINDS or not name or "/" in name:
        raise InvalidArgument(
            f"{checkpoint_id!r} is not '<weights|sampler_weights|external_weights>/<name>'",
            field=field,
        )
    return f"{TINKER}{run_id}/{checkpoint_id}"


def check_tinker_path(path: str, field: str = "path") -> str:
    """tinker://<run>/<kind>/<name>, exactly three parts (as the SDK parses it)."""
    parts = path.removeprefix(TINKER).split("/") if path.startswith(TINKER) else []
    if len(parts) != 3 or not all(parts) or parts[1] not in CHECKPOINT_KINDS:
        raise InvalidArgument(f"{path!r} is not a tinker://<run>/<kind>/<name> path", field=field)
    return path


def controller_path(path: str) -> str:
    """tinker://<run>/external_weights/<name> is stored as the training checkpoint
    weights/external.<name> (see routers/weights.py); other paths are unchanged."""
    head, sep, name = path.rpartition("/external_weights/")
    return f"{head}/weights/{EXTERNAL_PREFIX}{name}" if sep else path


def checkpoint(cp: cpb.Checkpoint) -> dict[str, Any]:
    return {
        "checkpoint_id": cp.checkpoint_id,
        "checkpoint_type": _TYPES.get(cp.type, "training"),
        "time": iso(cp.created_at) or iso(0.001),
        "tinker_path": cp.tinker_path,
        "training_run_id": cp.training_run_id,
        "size_bytes": cp.size_bytes or None,
        "public": cp.public,
        "expires_at": iso(cp.expires_at),
        "user_metadata": dict(cp.user_metadata) or None,
    }


def cursor(offset: int, limit: int, total: int) -> dict[str, int]:
    return {"offset": offset, "limit": limit, "total_count": total}


def training_run(reg: cpb.Registration) -> dict[str, Any]:
    return {
        "training_run_id": reg.registration_id,
        "base_model": reg.base_model,
        "model_owner": reg.tenant,
        "is_lora": True,
        "corrupted": False,
        "lora_rank": reg.lora_config.rank,
        "last_request_time": iso(reg.last_request_time or reg.created_at) or iso(0.001),
        "last_checkpoint": None,
        "last_sampler_checkpoint": None,
        "user_metadata": dict(reg.user_metadata) or None,
    }


def lora_fields(lora: common_pb2.LoraConfig) -> dict[str, Any]:
    return {
        "lora_rank": lora.rank,
        "train_unembed": lora.train_unembed,
        "train_mlp": lora.train_mlp,
        "train_attn": lora.train_attn,
    }
