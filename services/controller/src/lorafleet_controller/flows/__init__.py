"""The controller's flows: what spans several parts (a run's creation and end, a session's
end, an admission with its page-in, a replica joining or leaving, the sweep).

Each flow takes the parts it uses and domain values (records, ids, errors), never a request
message nor the Controller: the servicer converts requests at the edge (`convert.py`), and
`controller.py` builds the parts and hands them to the flows (`tests/test_flows_signatures.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

# Runs a flow's follow-up as a task of the leader (a standby drops it: the leader re-derives it).
Background = Callable[[Coroutine[Any, Any, None]], None]
