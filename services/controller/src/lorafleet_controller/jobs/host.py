"""What managed jobs need from the controller, as a Protocol: the runner never imports it.

`Controller` satisfies `JobHost` structurally (mypy checks it where controller.py builds the
runner), so `jobs/` depends on the parts and flows it names here and on nothing else of the
controller: no import back, hence no import circle (`tests/test_import_graph.py`).

The parts are the ones a job reads and writes through (the ledger it submits to and waits
on, the registry of its runs and trainers, the catalog of saved states, the sessions it
heartbeats, the trainers' clients for the tokenizer, the store of its records). The flows are
the controller's own, which span several parts (admission with its page-in, a run's creation
and retirement, a session's end), so a job takes exactly the path an SDK client's request does.
"""

from __future__ import annotations

from typing import Protocol

from lorafleet.v1 import controller_pb2
from lorafleet_controller.catalog import Catalog
from lorafleet_controller.clients import Pool
from lorafleet_controller.ledger import Admission, Ledger
from lorafleet_controller.notify import Notifier
from lorafleet_controller.registry import Registry, RegRecord
from lorafleet_controller.store import Store
from lorafleet_controller.tenancy import Tenancy


class JobHost(Protocol):
    store: Store
    notifier: Notifier
    ledger: Ledger
    registry: Registry
    catalog: Catalog
    tenancy: Tenancy
    pool: Pool

    @property
    def leading(self) -> bool:
        """This controller runs the dispatch loops (job workers run on the leader only)."""
        ...

    async def submit_operation(self, req: controller_pb2.SubmitOperationRequest) -> Admission:
        """Admit one operation of a run, as SubmitOperation does for an SDK client."""
        ...

    async def create_registration(
        self, req: controller_pb2.CreateRegistrationRequest
    ) -> tuple[RegRecord, str]:
        """Create a training run (placed on a slot when one is free)."""
        ...

    async def delete_registration(self, tenant: str, rid: str) -> None:
        """Retire a run and free its slot."""
        ...

    async def finish_session(self, tenant: str, session_id: str, reason: str) -> None:
        """Finish a session, giving its runs' slots back."""
        ...
