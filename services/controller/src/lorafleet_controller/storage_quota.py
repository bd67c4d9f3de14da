"""Per-tenant storage quota: a named save is refused once the tenant's checkpoints hold
`max_stored_bytes_per_tenant` bytes (0 = no cap).

Counted is what the tenant's `stored_bytes` shows (usage.py): the sizes the catalog records
for its checkpoints now, so a delete frees room at once (its files leave the disk later,
reclaim.py). The check runs at admission and the quota is soft by one save: the save that
crosses the cap is admitted, the next is refused. A refused save is still admitted as a
FAILED(user) operation (the seq_id is spent, so the run's later operations do not wait for
it) with a 400 `STORAGE_QUOTA` naming the field `storage`: retrying does not help, deleting
checkpoints does. A retry of a save admitted before the cap was reached finds that save.
Ephemeral sampler exports (no name) are not checkpoints and are not refused.
"""

from __future__ import annotations

from lorafleet import errors
from lorafleet.v1 import controller_pb2
from lorafleet_controller.store import Store
from lorafleet_controller.store.catalog import CatalogRepo

K = controller_pb2
STORAGE_QUOTA = "STORAGE_QUOTA"


class StorageQuota:
    def __init__(self, store: Store, max_stored_bytes_per_tenant: int) -> None:
        self.repo = CatalogRepo(store)
        self.limit = max_stored_bytes_per_tenant

    async def refusal(
        self, tenant: str, kind: int, payload: bytes
    ) -> errors.FailedPrecondition | None:
        """Why a new operation of `kind` must be refused for the quota, or None."""
        if not self.limit or kind not in (
            K.OPERATION_KIND_SAVE_STATE,
            K.OPERATION_KIND_SAVE_WEIGHTS_FOR_SAMPLER,
        ):
            return None
        parsed = K.OperationPayload.FromString(payload)
        if kind == K.OPERATION_KIND_SAVE_WEIGHTS_FOR_SAMPLER and not (
            parsed.save_weights_for_sampler.name
        ):
            return None
        stored = await self.repo.stored_bytes(tenant)
        if stored < self.limit:
            return None
        return errors.FailedPrecondition(
            f"tenant {tenant!r} stores {stored} bytes of checkpoints, at its quota of "
            f"{self.limit}; delete checkpoints to save more",
            field="storage",
            reason=STORAGE_QUOTA,
        )
