"""Domain records → protobuf messages, and requests → the flows' domain values (the only
place that knows both shapes)."""

from __future__ import annotations

from lorafleet.v1 import common_pb2, controller_pb2, rollout_pb2
from lorafleet_controller.catalog import CheckpointRecord
from lorafleet_controller.fleet import BaseModelView, FleetView
from lorafleet_controller.flows.operations import Submission
from lorafleet_controller.flows.registrations import NewRegistration
from lorafleet_controller.flows.sampling import NewSampler
from lorafleet_controller.ledger import OpRecord
from lorafleet_controller.registry import ROLLOUT, TRAINER, RegRecord, Replica
from lorafleet_controller.samplers import SamplerRecord, SampleSubmission
from lorafleet_controller.store import RegState
from lorafleet_controller.tenancy import Session

CATEGORIES = {
    "user": common_pb2.ERROR_CATEGORY_USER,
    "server": common_pb2.ERROR_CATEGORY_SERVER,
}


def registration(rec: RegRecord) -> controller_pb2.Registration:
    return controller_pb2.Registration(
        registration_id=rec.registration_id,
        tenant=rec.tenant,
        base_model=rec.base_model,
        lora_config=rec.lora,
        state=rec.state.proto,
        trainer_replica=rec.replica if rec.placed else "",
        slot=rec.slot if rec.placed else -1,
        queue_position=rec.queue_position,
        optim_steps=rec.optim_steps,
        published_version=rec.published_version,
        last_checkpoint=rec.last_checkpoint,
        created_at=rec.created_at,
        last_request_time=rec.last_request_time,
        user_metadata=rec.user_metadata,
        unavailable_reason=rec.unavailable_reason if rec.state == RegState.UNAVAILABLE else "",
        optimizer=rec.optimizer,
        corrupted=rec.corrupted,
        failed=rec.failed,
        bound_at=rec.bound_at,
    )


def error_info(err: dict[str, str]) -> common_pb2.ErrorInfo:
    return common_pb2.ErrorInfo(
        category=CATEGORIES.get(err.get("category", ""), common_pb2.ERROR_CATEGORY_UNKNOWN),
        field=err.get("field", ""),
        message=err.get("message", ""),
        reason=err.get("reason", ""),
    )


def operation(rec: OpRecord) -> controller_pb2.Operation:
    op = controller_pb2.Operation(
        operation_id=rec.operation_id,
        registration_id=rec.registration_id,
        seq_id=rec.seq_id,
        kind=controller_pb2.OperationKind.ValueType(rec.kind),
        state=controller_pb2.OperationState.ValueType(rec.state),
        submitted_at=rec.submitted_at,
        finished_at=rec.finished_at,
        waiting_reason=rec.waiting_reason,
        waiting_for=rec.waiting_for,
        result=rec.result,  # the bytes as stored: the reader parses them once
    )
    if rec.error:
        op.error.CopyFrom(error_info(rec.error))
    return op


def checkpoint(rec: CheckpointRecord) -> controller_pb2.Checkpoint:
    return controller_pb2.Checkpoint(
        checkpoint_id=rec.checkpoint_id,
        type=controller_pb2.CheckpointType.ValueType(rec.type),
        training_run_id=rec.training_run_id,
        tinker_path=rec.tinker_path,
        created_at=rec.created_at,
        size_bytes=rec.size_bytes,
        public=rec.public,
        expires_at=rec.expires_at,
        user_metadata=rec.user_metadata,
        base_model=rec.base_model,
        lora_config=rec.lora,
        manifest=rec.manifest,
        has_optimizer=rec.has_optimizer,
    )


def sampler(rec: SamplerRecord) -> controller_pb2.Sampler:
    return controller_pb2.Sampler(
        sampler_id=rec.sampler_id,
        base_model=rec.base_model,
        model_path=rec.model_path,
        adapter=rec.ref,
        inflight=rec.inflight,
    )


def session(rec: Session) -> controller_pb2.SessionInfo:
    return controller_pb2.SessionInfo(
        session_id=rec.session_id,
        training_run_ids=rec.training_run_ids,
        sampler_ids=rec.sampler_ids,
        user_metadata=rec.user_metadata,
        display_name=rec.display_name,
        finished=rec.finished,
        created_at=rec.created_at,
    )


def base_model(view: BaseModelView) -> controller_pb2.BaseModelInfo:
    return controller_pb2.BaseModelInfo(
        name=view.name,
        tokenizer_id=view.tokenizer_id,
        arch=view.arch,
        max_context_length=view.max_context_length,
        trainable=view.trainable,
        sampleable=view.sampleable,
        max_rank=view.max_rank,
        loss_fns=view.loss_fns,
        modules=view.modules,
        max_num_samples=view.max_num_samples,
        quantization=view.quantization,
        vocab_size=view.vocab_size,
    )


def fleet_status(view: FleetView) -> controller_pb2.GetFleetStatusResponse:
    resp = controller_pb2.GetFleetStatusResponse(ledger_depth=view.ledger_depth)
    for rv in view.replicas:
        rep = rv.replica
        trainer = rep.kind == TRAINER
        resp.replicas.append(
            controller_pb2.ReplicaStatus(
                kind=controller_pb2.REPLICA_KIND_TRAINER
                if trainer
                else controller_pb2.REPLICA_KIND_ROLLOUT,
                replica_id=rep.replica_id,
                address=rep.address,
                base_model=rep.base_model,
                healthy=rep.healthy,
                last_seen=rep.last_seen,
                num_slots=rep.num_slots,
                slots=[registration(r) for r in rv.slots],
                adapters=rv.adapters,
                failed=rep.failed,
                adapters_loaded=rv.loaded,
                homes=rv.homes,
            )
        )
    resp.queued_registrations.extend(registration(r) for r in view.queued)
    resp.attention.extend(registration(r) for r in view.attention)
    resp.attention_total = view.attention_total
    return resp


# --- requests → domain values -----------------------------------------------------------------
def new_registration(req: controller_pb2.CreateRegistrationRequest) -> NewRegistration:
    return NewRegistration(
        tenant=req.tenant,
        session_id=req.session_id,
        model_seq_id=req.model_seq_id,
        base_model=req.base_model,
        lora=req.lora_config,
        user_metadata=dict(req.user_metadata),
        optimizer=req.optimizer,
        initial_checkpoint=req.initial_checkpoint,
        initial_with_optimizer=req.initial_with_optimizer,
    )


def submission(req: controller_pb2.SubmitOperationRequest) -> Submission:
    return Submission(
        tenant=req.tenant,
        registration_id=req.registration_id,
        seq_id=req.seq_id,
        payload=req.payload,
    )


def sample_submission(req: controller_pb2.SubmitSampleRequest) -> SampleSubmission:
    """The sample as the rollout will receive it, serialised here once (deterministically,
    so a retry hashes alike); the request's rules are lorafleet.validate_msgs.check_sample,
    run by the gateway and the rollout."""
    n = req.num_samples or 1
    body = rollout_pb2.SampleRequest(
        prompt_tokens=req.prompt_tokens,
        params=req.params,
        num_samples=n,
        prompt_logprobs=req.prompt_logprobs,
        topk_prompt_logprobs=req.topk_prompt_logprobs,
    ).SerializeToString(deterministic=True)
    return SampleSubmission(req.tenant, req.sampler_id, req.seq_id, n, body)


def new_sampler(req: controller_pb2.CreateSamplerRequest) -> NewSampler:
    return NewSampler(
        tenant=req.tenant,
        session_id=req.session_id,
        sampling_session_seq_id=req.sampling_session_seq_id,
        model_path=req.model_path,
        base_model=req.base_model,
    )


REPLICA_KINDS = {
    controller_pb2.REPLICA_KIND_TRAINER: TRAINER,
    controller_pb2.REPLICA_KIND_ROLLOUT: ROLLOUT,
}


def replica(req: controller_pb2.RegisterReplicaRequest) -> Replica:
    """The replica as it reports itself (an unknown kind is ""): `Replicas.register` checks it."""
    return Replica(
        kind=REPLICA_KINDS.get(req.kind, ""),
        replica_id=req.replica_id,
        address=req.address,
        base_model=req.base_model,
        num_slots=req.num_slots,
        incarnation=req.incarnation,
        last_seen=0,
        healthy=True,
        tokenizer_id=req.tokenizer_id,
        max_rank=req.max_rank,
        max_context_length=req.max_context_length,
        arch=req.arch,
        max_num_samples=req.max_num_samples,
        quantization=req.quantization,
    )
