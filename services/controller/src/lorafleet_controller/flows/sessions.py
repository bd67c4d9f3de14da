"""A session's end (finished by its client, timed out, or its API key revoked)."""

from __future__ import annotations

from lorafleet import errors
from lorafleet_controller.flows.runs import Runs
from lorafleet_controller.registry import Registry
from lorafleet_controller.store import RegState
from lorafleet_controller.tenancy import Tenancy


class Sessions:
    def __init__(self, tenancy: Tenancy, registry: Registry, runs: Runs):
        self.tenancy = tenancy
        self.registry = registry
        self.runs = runs

    async def finish(self, tenant: str, session_id: str, reason: str) -> None:
        """Finish a session and give its training runs' trainer slots back.

        A finished session's client is closed (0.38 `close()`), so its runs can take no more
        operations: their queues are fenced and their slots freed for queued registrations.
        What they published stays: samplers keep serving, and saved states can be resumed
        from another session (`create_training_client_from_state`). The runs are retired
        before the session is marked finished, so a controller killed in between leaves the
        session live and silent, and the next sweep finishes the job (retiring is idempotent).
        """
        await self.tenancy.check_session(tenant, session_id)
        finished = errors.FailedPrecondition(
            f"session {session_id} finished before the operation ran",
            field="model_id",
            reason="SESSION_FINISHED",
        )
        for rid in await self.tenancy.training_runs(session_id):
            rec = await self.registry.get(tenant, rid)
            if rec.state == RegState.RETIRED:
                continue
            await self.runs.retire(rid, finished)
        await self.tenancy.finish(tenant, session_id, reason)

    async def revoke_api_key(self, key_id: str) -> None:
        """Revoke a key and finish the live sessions it opened: their clients can no longer
        heartbeat or submit, so their runs' slots go back now rather than after the timeout."""
        await self.tenancy.revoke_key(key_id)
        for tenant, session_id in await self.tenancy.sessions_of_key(key_id):
            await self.finish(tenant, session_id, "API key revoked")
