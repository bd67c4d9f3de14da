"""An operation's admission to its run's queue (with the page-in it may start)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from lorafleet import errors
from lorafleet.v1 import common_pb2, controller_pb2
from lorafleet_controller import validate
from lorafleet_controller.flows import Background
from lorafleet_controller.ledger import Admission, Ledger
from lorafleet_controller.registry import Placer
from lorafleet_controller.storage_quota import StorageQuota


@dataclass(frozen=True)
class Submission:
    """One operation of a run, as SubmitOperation (or a managed job) submits it."""

    tenant: str
    registration_id: str
    seq_id: int
    payload: bytes
    """A serialized OperationPayload, as its writer serialised it (validate.admit)."""


class Operations:
    def __init__(self, ledger: Ledger, placer: Placer, background: Background, quota: StorageQuota):
        self.ledger = ledger
        self.placer = placer
        self.background = background
        self.quota = quota

    async def submit(self, sub: Submission) -> Admission:
        """Admit an operation (refused as FAILED(user) when its payload is invalid, or a save
        over the tenant's storage quota). The payload's bytes are stored and forwarded as
        they came (validate.admit)."""
        checked = validate.admit(sub.payload)
        rejection = checked.rejection or await self.quota.refusal(
            sub.tenant, checked.kind, sub.payload
        )
        admission = await self.ledger.submit(
            sub.tenant,
            sub.registration_id,
            sub.seq_id,
            checked.kind,
            sub.payload,
            checked.digest,
            rejection,
        )
        if admission.page_in:  # a paged run has work again: give it a free slot if one is
            await self.placer.queue_page_in(sub.registration_id, admission.page_in)
            self.background(self.placer.fill(admission.page_in))
        return admission

    async def reject(
        self, sub: Submission, info: common_pb2.ErrorInfo, rejected: errors.LorafleetError
    ) -> Admission:
        """The gateway refused the operation's payload at the edge (`info`, as `rejected`):
        the seq_id is spent as a FAILED(user) record with that error and nothing runs."""
        digest = (
            "rejected:" + hashlib.sha256(info.SerializeToString(deterministic=True)).hexdigest()
        )
        unspecified = controller_pb2.OPERATION_KIND_UNSPECIFIED
        return await self.ledger.submit(
            sub.tenant, sub.registration_id, sub.seq_id, unspecified, b"", digest, rejected
        )
