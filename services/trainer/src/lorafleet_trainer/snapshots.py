"""Automatic slot snapshots: the restore points of exactly-once replay after a trainer loss.

After an optim_step, a slot whose last snapshot is `every_steps` optimizer steps or
`every_seconds` old is captured on the torch thread: a copy of its adapter, moments, step
count and applied operation ids. Nothing else runs on that thread meanwhile, so the copy is
exactly the state after that optim_step, with no gradients pending. A background thread
writes it to the storage root as an ordinary saved state (so LoadState restores it), off
the critical path; the copy is the only cost the step pays.

The controller learns of a snapshot from the next OptimStep answer of the slot once its files
are complete, records it before it records that step's outcome, and from then on keeps only
the operations after it for replay. So a snapshot may be deleted once the controller cannot
still depend on it. At most one snapshot per binding is being written at a time (a capture
waits until the previous one is complete), which means the step that captures snapshot i+1
already reports snapshot i; the step that captures i+2 is only dispatched after that answer
was recorded. Hence when snapshot i+3 is complete, the controller's record is at least i+1,
and snapshot i (and anything older) is deleted: `KEEP = 3` complete snapshots per binding.
Snapshots the log has moved past are deleted by `prune` (PruneSnapshots), which the
controller calls when the run cannot record a newer one: in a page-out, right after recording
the page-out's save as the run's snapshot (those of the binding being paged out are older, and
it takes no more steps), and when the run is retired. It also deletes page-out saves
(paging.py's SaveState under `<run>#page@...`) other than the one the log points to, and never
a state saved under any other operation id (a user's checkpoint, an import).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lorafleet import names
from lorafleet_trainer import checkpoint
from lorafleet_trainer.checkpoint import TRAINER_STATE, resolve_uri
from lorafleet_trainer.domain import StateRef
from lorafleet_trainer.slots import Binding

log = logging.getLogger(__name__)

KEEP = 3
PREFIX = ".snapshot-"  # never a user's name: those cannot start with '.'
PAGE_MARK = "#page@"  # in the operation id of a page-out's save: `<run>#page@<seq>:<nonce>`


@dataclass
class _SlotSnapshots:
    """The snapshots of one binding (one registration's life in one slot)."""

    binding: Binding
    steps_since: int = 0
    last_capture: float = 0.0
    writing: bool = False
    done: list[tuple[str, StateRef]] = field(default_factory=list)  # (operation id, ref)


class Snapshotter:
    """Captures due slots after optim_step (torch thread) and writes them in the background.

    `engine` is the TrainerEngine; only its read-only state helpers are used.
    """

    def __init__(
        self,
        engine: Any,
        every_steps: int,
        every_seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.clock = clock
        self._slots: dict[int, _SlotSnapshots] = {}
        self._lock = threading.Lock()
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapshot")

    @property
    def enabled(self) -> bool:
        return self.every_steps > 0 or self.every_seconds > 0

    def _state(self, slot: int, binding: Binding) -> _SlotSnapshots:
        st = self._slots.get(slot)
        if st is None or st.binding is not binding:  # a new binding starts its own series
            st = self._slots[slot] = _SlotSnapshots(binding, last_capture=self.clock())
        return st

    def after_step(self, slot: int, binding: Binding, operation_id: str) -> None:
        """Call on the torch thread right after `operation_id` (an optim_step) applied."""
        if not self.enabled:
            return
        with self._lock:
            st = self._state(slot, binding)
            st.steps_since += 1
            now = self.clock()
            due = (self.every_steps > 0 and st.steps_since >= self.every_steps) or (
                self.every_seconds > 0 and now - st.last_capture >= self.every_seconds
            )
            if not due or st.writing:  # a capture waits for the previous write (see above)
                return
            st.writing, st.steps_since, st.last_capture = True, 0, now
        state = capture(self.engine, binding)
        self._writer.submit(self._write, st, operation_id, state)

    def _write(self, st: _SlotSnapshots, operation_id: str, state: dict[str, Any]) -> None:
        rid = st.binding.registration_id
        name = f"{PREFIX}{state['trainer_state']['optim_steps']}-{uuid.uuid4().hex[:12]}"
        try:
            ref = checkpoint.save_state(
                checkpoint.state_dir(self.engine.storage_root, rid, name), **state
            )
        except Exception:  # a failed write only delays recovery's restore point
            log.exception("snapshot of %s after %s failed", rid, operation_id)
            with self._lock:
                st.writing = False
            return
        with self._lock:
            st.done.append((operation_id, ref))
            st.writing = False
            old, st.done = st.done[:-KEEP], st.done[-KEEP:]
        for _, stale in old:
            shutil.rmtree(resolve_uri(self.engine.storage_root, stale.uri), ignore_errors=True)

    def latest(self, slot: int, registration_id: str) -> tuple[str, StateRef] | None:
        """The newest complete snapshot of the slot's current binding, if any."""
        with self._lock:
            st = self._slots.get(slot)
            if st is None or st.binding.registration_id != registration_id or not st.done:
                return None
            return st.done[-1]

    def drain(self) -> None:
        """Wait until every write submitted so far is complete (the writer is one thread)."""
        self._writer.submit(lambda: None).result()

    def close(self) -> None:
        """Finish the writes in progress (shutdown)."""
        self._writer.shutdown(wait=True)


def capture(engine: Any, binding: Binding) -> dict[str, Any]:
    """A detached copy of a binding's full state, in `checkpoint.save_state`'s arguments."""
    keys = engine.layout.param_keys(binding)
    optimizer: dict[str, torch.Tensor] = {}
    for i, (m, v) in binding.optimizer.moments().items():
        optimizer[keys[i] + ".exp_avg"] = m.detach().clone()
        optimizer[keys[i] + ".exp_avg_sq"] = v.detach().clone()
    spec = dataclasses.asdict(binding.spec)
    return {
        "adapter_config": engine.layout.config(binding),
        "adapter": {k: v.clone() for k, v in engine.layout.tensors(binding).items()},
        "optimizer": optimizer,
        "trainer_state": {
            "registration_id": binding.registration_id,
            "base_model": engine.base_model,
            "spec": {k: list(v) if isinstance(v, tuple) else v for k, v in spec.items()},
            "targets": list(binding.targets),
            "optim_steps": binding.optimizer.steps,
            "has_optimizer": True,
            "applied_ops": binding.ops.ids(),
        },
    }


def prune(root: Path, registration_id: str, keep: set[Path]) -> list[Path]:
    """Delete the run's automatic snapshots and page-out saves but `keep`; returns the
    folders deleted. Only sound while the run can record no newer snapshot (the caller's
    promise, PruneSnapshots), with the writes submitted before drained (Snapshotter.drain)."""
    names.check_run_id(registration_id, "registration_id")
    run = names.resolve_under(root, registration_id, field="registration_id")
    if not run.is_dir():
        return []
    removed = []
    for folder in sorted(run.iterdir()):
        if not folder.is_dir() or folder in keep:
            continue
        if folder.name.startswith(PREFIX) or _page_save(folder, registration_id):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _page_save(folder: Path, registration_id: str) -> bool:
    """Whether a page-out wrote this state (its saved_by operation id says so)."""
    try:
        state = json.loads((folder / TRAINER_STATE).read_text())
    except (OSError, ValueError):
        return False
    by = state.get("saved_by") if isinstance(state, dict) else None
    return isinstance(by, str) and by.startswith(registration_id + PAGE_MARK)
