"""One job as a deterministic sequence of operations on its run.

The loop asks an `Executor` for operations (forward_backward, optim_step, save_state,
load_state); the durable runner submits each at the next seq_id of the run. Every payload is
a pure function of the plan, the parameters and the results before it, so re-running the
loop from a `Cursor` (saved at each pass boundary) submits the same operations at the same
seq_ids: the ledger answers those already admitted with their stored results, and the
loop catches up without running anything twice. That is how a job survives a controller
SIGKILL and ends with the same adapter as an uninterrupted one.

Per pass (juno §11.2-11.5): the training units in a seeded order, `gradient_accumulation`
chunks per optimizer update, sent as one forward_backward. Its datums carry cross-entropy
weight 1 on trained positions and 0 elsewhere, and `group_tokens` (the group's prediction
tokens) makes the trainer accumulate the gradient of the summed loss divided by it: the
token mean over the group (the reported loss is token-weighted the same way). The
optim_step clips the global norm at `max_grad_norm` (the trainer's float64 two-pass clip
with its non-finite veto) and uses the scheduled learning rate. After a pass: validation
loss (forward only, token mean over the held-out units), a snapshot when it is the best so
far, then the stopping rules. On exit the best snapshot is loaded without its optimizer
state (the optimizer reset); the runner then saves the final adapter.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from lorafleet_controller.jobs import stopping
from lorafleet_controller.jobs.params import JobKind, JobParams
from lorafleet_controller.jobs.schedule import learning_rate
from lorafleet_controller.jobs.units import Chunk, Plan, Unit

EVAL_BATCH = 64  # datums per forward-only operation when measuring a loss
PIPELINE_DEPTH = 8  # optimizer updates submitted ahead of their results


class Executor(Protocol):
    """The operations a job needs; `runner.LedgerExecutor` submits them to the ledger."""

    async def forward_backward(
        self, chunks: Sequence[Chunk], group_tokens: int, forward_only: bool
    ) -> Awaitable[float]:
        """Submit; the awaitable gives the chunks' summed loss over their trained tokens
        (`loss:sum`). With forward_only false, the gradient accumulated is that sum /
        `group_tokens`."""

    async def optim_step(self, lr: float, params: JobParams) -> Awaitable[None]:
        """Submit; the awaitable completes with the step."""

    async def save_state(self, name: str) -> str:
        """The saved state's tinker:// path."""

    async def load_state(self, path: str) -> None:
        """Restore weights only: the optimizer starts again from zero moments."""

    async def checkpoint(self, cursor: Cursor) -> None:
        """Make the cursor durable (a pass boundary): a resumed job restarts from here."""

    async def report(self, point: dict[str, Any]) -> None:
        """One optimizer update's point of the loss curve, for watchers."""


@dataclass
class Cursor:
    """Where a job is, saved at pass boundaries. `seq` is the next seq_id to submit."""

    seq: int
    passes: int = 0
    updates: int = 0
    initial_loss: float | None = None
    train_loss: float | None = None
    validation_loss: float | None = None
    stop_reason: str = ""
    best_path: str = ""
    stopper: stopping.Stopper = field(default_factory=stopping.Stopper)
    curve: list[dict[str, Any]] = field(default_factory=list)  # one point per update
    history: list[dict[str, Any]] = field(default_factory=list)  # one summary per pass

    def to_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["stopper"] = self.stopper.to_dict()
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Cursor:
        raw = dict(raw)
        raw["stopper"] = stopping.Stopper(**raw["stopper"])
        return cls(**raw)


def loss_guidance(loss: float | None) -> str:
    """Juno's reading of a Q&A loss."""
    if loss is None:
        return ""
    if loss < 0.5:
        return "reliable recall"
    if loss <= 1.5:
        return "inconsistent recall: train more or lower loss_target"
    return "not learned yet"


async def evaluate(ex: Executor, units: Sequence[Unit]) -> float:
    """Token-mean loss of the units, forward only (no dropout, nothing accumulated)."""
    chunks = [c for u in units for c in u.chunks]
    tokens = sum(c.prediction_tokens for c in chunks)
    pending = [
        await ex.forward_backward(chunks[i : i + EVAL_BATCH], tokens, True)
        for i in range(0, len(chunks), EVAL_BATCH)
    ]
    return sum([await loss for loss in pending]) / tokens


async def train_pass(
    number: int, plan: Plan, p: JobParams, ex: Executor, cur: Cursor, total_updates: int
) -> float:
    """One full pass; its token-weighted training loss. Up to PIPELINE_DEPTH updates are
    submitted ahead of their results: nothing in a pass depends on its losses, and the
    trainer then always has the next operation queued."""
    weighted, tokens = 0.0, 0
    inflight: deque[tuple[int, dict[str, Any], Awaitable[float], Awaitable[None]]] = deque()

    async def settle() -> None:
        nonlocal weighted, tokens
        n, point, loss, step = inflight.popleft()
        point["loss"] = await loss / n
        await step
        weighted, tokens = weighted + point["loss"] * n, tokens + n
        cur.curve.append(point)
        await ex.report(point)

    for group in plan.pass_groups(number, p.seed, p.gradient_accumulation):
        n = sum(c.prediction_tokens for c in group)
        loss = await ex.forward_backward(group, n, False)
        lr = learning_rate(
            p.schedule, p.learning_rate, cur.updates + 1, total_updates, p.warmup_steps, p.min_lr
        )
        step = await ex.optim_step(lr, p)
        cur.updates += 1
        inflight.append((n, {"pass": number, "update": cur.updates, "lr": lr}, loss, step))
        if len(inflight) >= PIPELINE_DEPTH:
            await settle()
    while inflight:
        await settle()
    return weighted / tokens


async def run(job_id: str, plan: Plan, p: JobParams, ex: Executor, cur: Cursor) -> Cursor:
    """Train until a stopping rule holds; returns the final cursor (stop_reason set)."""
    total_updates = p.max_iters * plan.updates_per_pass(p.gradient_accumulation)
    if cur.passes == 0 and cur.initial_loss is None and not cur.stop_reason:
        cur.initial_loss = await evaluate(ex, plan.validation or plan.train)
        if p.loss_target > 0 and cur.initial_loss <= p.loss_target:
            cur.stop_reason = stopping.TARGET  # already there: no update is made
        await ex.checkpoint(cur)
    while not cur.stop_reason:
        number = cur.passes + 1
        cur.train_loss = await train_pass(number, plan, p, ex, cur, total_updates)
        cur.validation_loss = None
        if plan.validation:
            cur.validation_loss = await evaluate(ex, plan.validation)
            if cur.stopper.observe(number, cur.validation_loss, p.min_delta):
                cur.best_path = await ex.save_state(f"{job_id}-best-{number}")
        cur.passes = number
        cur.stop_reason = cur.stopper.decide(p, number, cur.train_loss, cur.validation_loss)
        cur.history.append(
            {"pass": number, "train_loss": cur.train_loss, "validation_loss": cur.validation_loss}
        )
        await ex.checkpoint(cur)
    if cur.best_path:
        await ex.load_state(cur.best_path)
    return cur


def result(kind: JobKind, plan: Plan, cur: Cursor, final_path: str) -> dict[str, Any]:
    """The job's result (`JobResult` fields; the gateway names them in juno's camelCase)."""
    loss = cur.train_loss if cur.train_loss is not None else cur.initial_loss
    if cur.best_path:  # the adapter is the restored best pass's: report that pass's loss
        loss = next(h["train_loss"] for h in cur.history if h["pass"] == cur.stopper.best_pass)
    watched = cur.stopper.best if plan.validation else loss
    out: dict[str, Any] = {
        "unit_count": plan.unit_count,
        "train_unit_count": len(plan.train),
        "validation_unit_count": len(plan.validation),
        "final_train_loss": loss,
        "initial_loss": cur.initial_loss,
        "pass_count": cur.passes,
        "optimizer_update_count": cur.updates,
        "stop_reason": cur.stop_reason,
        "target_reached": cur.stop_reason == stopping.TARGET,
        "checkpoint": final_path,
        "chat_template": plan.chat_template,
    }
    if plan.validation:
        out["best_validation_loss"] = cur.stopper.best
        out["best_pass"] = cur.stopper.best_pass
        out["restored_checkpoint"] = cur.best_path
    if kind == JobKind.QA:
        out["pair_count"] = plan.group_count
        out["loss_guidance"] = loss_guidance(watched)
    else:
        out["document_count"] = plan.group_count
        out["chunk_count"] = plan.chunk_count()
        out["dropped_chunks"] = plan.dropped_chunks
    return out
