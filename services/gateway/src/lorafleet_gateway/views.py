"""Controller records → Tinker's REST shapes (Checkpoint, TrainingRun, cursors), and the
Tinker ids the contract does not own.

Tinker ids are structural: a model id is "<session>:train:<n>", a sampler id
"<session>:sample:<n>", a checkpoint path `lorafleet.contract.TinkerPath`.
"""

from __future__ import annotations

import datetime as dt
from typing import Literal

from lorafleet.contract import CheckpointKind, RunId, SamplerId, TinkerPath
from lorafleet.v1 import controller_pb2 as cpb
from lorafleet_gateway.protocol import CheckpointView, Cursor, TrainingRun

EXTERNAL_PREFIX = "external."
_TYPES: dict[int, Literal["training", "sampler", "external"]] = {
    cpb.CHECKPOINT_TYPE_TRAINING: "training",
    cpb.CHECKPOINT_TYPE_SAMPLER: "sampler",
    cpb.CHECKPOINT_TYPE_EXTERNAL: "external",
}
# Epoch 0 is "unknown"; Tinker's time fields are required, so it shows as the epoch.
_EPOCH = 0.001


def iso(epoch: float) -> str | None:
    if not epoch:
        return None
    return dt.datetime.fromtimestamp(epoch, dt.UTC).isoformat().replace("+00:00", "Z")


def session_of(model_id: str, field: str = "model_id") -> str:
    """The session part of "<session>:train:<n>" (400 for anything else)."""
    return RunId.parse(model_id, field).session_id


def sampler_id(session_id: str, seq: int) -> str:
    return str(SamplerId(session_id, seq))


def controller_path(path: TinkerPath) -> str:
    """tinker://<run>/external_weights/<name> is stored as the training checkpoint
    weights/external.<name> (see serving/weights.py); other paths are unchanged."""
    if path.kind is CheckpointKind.EXTERNAL_WEIGHTS:
        path = TinkerPath(path.run_id, CheckpointKind.WEIGHTS, EXTERNAL_PREFIX + path.name)
    return str(path)


def checkpoint(cp: cpb.Checkpoint) -> CheckpointView:
    return CheckpointView(
        checkpoint_id=cp.checkpoint_id,
        checkpoint_type=_TYPES.get(cp.type, "training"),
        time=iso(cp.created_at) or iso(_EPOCH) or "",
        tinker_path=cp.tinker_path,
        training_run_id=cp.training_run_id,
        size_bytes=cp.size_bytes or None,
        public=cp.public,
        expires_at=iso(cp.expires_at),
        user_metadata=dict(cp.user_metadata) or None,
    )


def cursor(offset: int, limit: int, total: int) -> Cursor:
    return Cursor(offset=offset, limit=limit, total_count=total)


def training_run(reg: cpb.Registration) -> TrainingRun:
    return TrainingRun(
        training_run_id=reg.registration_id,
        base_model=reg.base_model,
        model_owner=reg.tenant,
        lora_rank=reg.lora_config.rank,
        corrupted=bool(reg.corrupted),
        last_request_time=iso(reg.last_request_time or reg.created_at) or iso(_EPOCH) or "",
        user_metadata=dict(reg.user_metadata) or None,
    )
