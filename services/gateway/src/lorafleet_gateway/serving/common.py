"""What several areas share: admitting operations into the ledger, and base-model names."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from lorafleet import errors, validate_msgs
from lorafleet.contract import FutureId, FutureKind
from lorafleet.rpc.errors import error_info
from lorafleet.v1 import controller_pb2 as cpb
from lorafleet_gateway import views
from lorafleet_gateway.controller import ControllerClient
from lorafleet_gateway.protocol import SEQ_ID_LIMIT, UntypedAPIFuture


class Ledger:
    """Operations at the client's (model_id, seq_id): the controller's ledger orders them,
    deduplicates retries (same payload → the original operation) and refuses conflicts (422)
    and overload (429)."""

    def __init__(self, controller: ControllerClient) -> None:
        self._controller = controller

    async def admit(
        self,
        tenant: str,
        model_id: str,
        seq_id: int,
        build: Callable[[], cpb.OperationPayload],
    ) -> UntypedAPIFuture:
        """Build the payload (validation happens there) and submit it. A payload refused
        here still spends its seq_id, as the SDK already has (see `spend`)."""
        try:
            views.session_of(model_id)
            payload = build()
        except errors.InvalidArgument as exc:
            await self.spend(tenant, model_id, seq_id, exc)
            raise
        # Serialised here once: the controller stores and forwards these bytes as they are
        # and the trainer parses them (lorafleet_controller.validate.admit).
        request = cpb.SubmitOperationRequest(
            tenant=tenant,
            registration_id=model_id,
            seq_id=seq_id,
            payload=payload.SerializeToString(deterministic=True),
        )
        reply = await self._controller.submit_operation(request)
        return future(FutureId(FutureKind.OPERATION, reply.operation_id), model_id)

    async def spend(
        self, tenant: str, model_id: str, seq_id: int, exc: errors.LorafleetError
    ) -> None:
        """The gateway refused this request: still spend its seq_id in the ledger.

        The SDK has already used that seq_id and sends its next request with the next one; an
        unspent seq_id would hold the run's queue until the gap timeout seals it. Best effort:
        if the ledger refuses too (unknown run, another tenant), the client's 4xx stands alone.
        """
        if not 0 < seq_id < SEQ_ID_LIMIT or not model_id:  # no SDK sends one out of range
            return
        request = cpb.SubmitOperationRequest(
            tenant=tenant, registration_id=model_id, seq_id=seq_id, rejection=error_info(exc)
        )
        with contextlib.suppress(errors.LorafleetError):
            await self._controller.submit_operation(request)

    async def spend_named(self, tenant: str, body: object, exc: errors.LorafleetError) -> None:
        """Spend the seq_id a refused JSON body names, if it names a run and a seq_id (a
        request refused by its schema has no typed model to read them from)."""
        if not isinstance(body, dict):
            return
        model_id, seq_id = body.get("model_id"), body.get("seq_id")
        if isinstance(model_id, str) and type(seq_id) is int:
            await self.spend(tenant, model_id, seq_id, exc)


def future(
    future_id: FutureId, model_id: str | None = None, sample_sequence_ids: list[str] | None = None
) -> UntypedAPIFuture:
    return UntypedAPIFuture(
        request_id=str(future_id), model_id=model_id, sample_sequence_ids=sample_sequence_ids
    )


async def resolve_base_model(
    controller: ControllerClient, name: str, need: str = "trainable"
) -> cpb.BaseModelInfo | None:
    """The served model called `name` that is `need` ("trainable" or "sampleable"), or None.
    Its tokenizer id is accepted as an alias, because the cookbook sends base_model =
    model_name = the tokenizer (tinker-api.md §11)."""
    models = [m for m in await controller.capabilities() if getattr(m, need)]
    exact = next((m for m in models if m.name == name), None)
    return exact or next((m for m in models if m.tokenizer_id and m.tokenizer_id == name), None)


async def model_limits(controller: ControllerClient, base_model: str) -> validate_msgs.Limits:
    """What a served base model accepts (vocabulary, context length, num_samples), from
    capabilities, for `lorafleet.validate_msgs`; not served: no limits known here."""
    model = next((m for m in await controller.capabilities() if m.name == base_model), None)
    if model is None:
        return validate_msgs.UNKNOWN
    return validate_msgs.Limits(
        vocab_size=model.vocab_size,
        max_context_length=model.max_context_length,
        max_num_samples=model.max_num_samples,
    )


async def base_model_name(controller: ControllerClient, name: str, need: str = "trainable") -> str:
    """`name` resolved to the served model's own name (unknown names pass through, and the
    controller answers them with the list of what it serves)."""
    model = await resolve_base_model(controller, name, need)
    return model.name if model else name
