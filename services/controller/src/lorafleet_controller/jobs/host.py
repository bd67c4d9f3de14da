"""What managed jobs need from the controller, as a Protocol: the runner never imports it.

`Controller` satisfies `JobHost` structurally (mypy checks it where controller.py builds the
runner), so `jobs/` depends on the parts and flows (`flows/`) it names here and on nothing
else of the controller: no import back, hence no import circle (`tests/test_import_graph.py`).

The parts are the ones a job reads and writes through (the ledger it submits to and waits
on, the registry of its runs and trainers, the catalog of saved states, the sessions it
heartbeats, the trainers' clients for the tokenizer, the store of its records). The flows
span several parts (admission with its page-in, a run's creation and retirement, a session's
end), so a job takes exactly the path an SDK client's request does.
"""

from __future__ import annotations

from typing import Protocol

from lorafleet_controller.catalog import Catalog
from lorafleet_controller.clients import Pool
from lorafleet_controller.flows.operations import Operations
from lorafleet_controller.flows.registrations import Registrations
from lorafleet_controller.flows.sessions import Sessions
from lorafleet_controller.ledger import Ledger
from lorafleet_controller.notify import Notifier
from lorafleet_controller.registry import Registry
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
    operations: Operations  # admits a run's operations, as SubmitOperation does for a client
    registrations: Registrations  # creates a run (placed when a slot is free) and retires it
    sessions: Sessions  # finishes a session, giving its runs' slots back

    @property
    def leading(self) -> bool:
        """This controller runs the dispatch loops (job workers run on the leader only)."""
        ...
