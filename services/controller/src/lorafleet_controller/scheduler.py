"""The scheduler: claims ready operations and executes them on the owning trainer.

Wake-up is a blocking BLPOP on two Redis lists that the Lua scripts fill (no polling), one
claimer per group (store/keys.py: each group has its own lists, on its own slot):
`ready:ctl` (optim_step, save/load state, publish) is always popped before `ready:data`
(forward, forward_backward), and control operations run as their own tasks, so data never
starves them. Data operations are handed to one worker per trainer replica (claims of
several groups meet there), which waits a short coalescing window, then sends what is ready
for that trainer as one cross-slot ForwardBackward batch, at most `BATCH_PER_TENANT`
operations of each tenant, ordered round-robin across tenants, and only
`BATCH_SHARE_CONTENDED` of each while a light tenant (one stepping a run or two in lockstep)
is about (`FairBatcher`: one tenant's flood waits for later batches rather than slowing
every other tenant's steps); each operation is recorded as soon as the batch returns. Per
registration at most one operation is in flight (the ledger only releases the head), so
seq_id order is execution order.

A claim is durable before dispatch: a controller killed mid-dispatch leaves the operation
CLAIMED, and the next controller re-sends it with the same operation id; the trainer answers
a repeated id with its first result, so nothing runs twice.

Failure means not applied. When contact with the trainer is lost (transport failure after
the client's retries, Redis unreachable while recording), or the trainer no longer holds the
slot, the trainer may have applied the operation: it is never reported failed. It stays
CLAIMED and is asked about again, by sending it again under the same operation id, while its
registration still holds that slot (an applied id answers with its first result, an id in
progress waits behind it on the trainer's one torch thread, and an unknown one runs once). If
the registration lost the slot meanwhile (its trainer was declared lost), recovery.py owns
the operation: it is queued again and runs after the run is rebuilt.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

from lorafleet import errors
from lorafleet.contract import CheckpointKind, TinkerPath
from lorafleet.rpc.errors import exception_from_info
from lorafleet.v1 import controller_pb2, trainer_pb2
from lorafleet_controller import metrics
from lorafleet_controller.catalog import TRAINING, Catalog
from lorafleet_controller.clients import Pool, TrainerClient
from lorafleet_controller.ledger import Claim, Ledger, Outcome
from lorafleet_controller.loops import raise_if_stopped
from lorafleet_controller.recovery import Recovery
from lorafleet_controller.registry import Registry
from lorafleet_controller.settings import ControllerSettings
from lorafleet_controller.store import (
    DATA_KINDS,
    Client,
    Keys,
    OpState,
    RegState,
    StaleEpoch,
    StoreError,
    text,
)
from lorafleet_controller.usage import forward_effects, optim_effects

log = logging.getLogger(__name__)

KIND_NAMES = {
    v.number: v.name.removeprefix("OPERATION_KIND_").lower()
    for v in controller_pb2.OperationKind.DESCRIPTOR.values
}

Effects = list[tuple[str, str, Any]]
CLAIM_BATCH = 64  # ready operations claimed per round trip
# Most data operations of one tenant in one trainer batch (see fair_batch): large enough to
# batch a busy tenant's runs when no light tenant is about.
BATCH_PER_TENANT = 8
# Most data operations of one tenant in one batch while another tenant is light (see
# FairBatcher); a tenant with at most this many claims waiting is light.
BATCH_SHARE_CONTENDED = 2
# How long after its batch returned a light tenant still counts as about: its next step is on
# its way (an SDK client's turnaround, result to next submit, is milliseconds on a LAN).
LIGHT_RECENT_S = 0.05
K = controller_pb2
# Kinds a lost contact leaves in doubt (re-sent under their id, never failed): everything the
# trainer executes by operation id. Publishing also involves rollouts and fails as before.
TRAINER_KINDS = frozenset(
    {
        *DATA_KINDS,
        K.OPERATION_KIND_OPTIM_STEP,
        K.OPERATION_KIND_SAVE_STATE,
        K.OPERATION_KIND_LOAD_STATE,
    }
)
# The trainer does not hold the slot (any more), or is not the process the claim was sent to.
LEASE_REASONS = frozenset({"SLOT_UNBOUND", "LEASE_MISMATCH", "STALE_INCARNATION"})
PublishFn = Callable[
    [Claim, controller_pb2.SaveWeightsForSamplerPayload],
    Awaitable[tuple[controller_pb2.OperationResult, Effects]],
]


class Scheduler:
    def __init__(
        self,
        blocking: Client,
        keys: Keys,
        ledger: Ledger,
        registry: Registry,
        catalog: Catalog,
        pool: Pool,
        settings: ControllerSettings,
        publish: PublishFn,
        recovery: Recovery,
        gate: Callable[[], bool] = lambda: True,
    ) -> None:
        self.blocking = blocking  # its own client: BLPOP holds a connection
        self.keys = keys
        self.gate = gate  # False once this controller may no longer dispatch (lease lost)
        self.ledger = ledger
        self.registry = registry
        self.catalog = catalog
        self.pool = pool
        self.settings = settings
        self.publish = publish
        self.recovery = recovery  # keeps what the trainer applied, for replay
        self._queues: dict[str, asyncio.Queue[Claim]] = {}
        self._workers: dict[str, asyncio.Task[None]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    # --- intake ---------------------------------------------------------------------------
    async def run(self) -> None:
        """Claim in every group until one claimer stops (deposed, or the lease lost): then
        every claimer stops."""
        claimers = [
            asyncio.create_task(self._claim(g), name=f"claim-g{g}") for g in range(self.keys.groups)
        ]
        try:
            done, _ = await asyncio.wait(claimers, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # a claimer's error (or a stop request) ends the scheduler
        finally:
            for task in claimers:
                task.cancel()
            await asyncio.gather(*claimers, return_exceptions=True)

    async def _claim(self, group: int) -> None:
        keys = self.keys.group(group)
        ready = [keys.ready_ctl, keys.ready_data]
        while True:
            raise_if_stopped()
            try:
                popped = await self.blocking.blpop(ready, timeout=1)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis hiccup: the ready lists are durable, retry
                log.warning("scheduler lost Redis (%s); retrying", exc)
                await asyncio.sleep(0.5)
                continue
            if popped is None:
                continue
            if not self.gate():  # hand the id back for the next leader, and stop
                await self.blocking.lpush(popped[0], popped[1])
                return
            # One round trip claims the popped id and whatever else is ready right now.
            try:
                claims = await self.ledger.claim_many(group, [text(popped[1])], CLAIM_BATCH)
            except StaleEpoch as exc:  # deposed: the popped id is re-queued by the new leader
                log.warning("scheduler stops: %s", exc)
                return
            for claim in claims:
                self.dispatch(claim)

    async def recover(self) -> None:
        """Start-up: re-dispatch CLAIMED operations, re-queue every registration's head."""
        for opid in await self.ledger.claimed_ids():
            claim = await self.ledger.load_claim(opid)
            if (
                claim is not None
                and claim.registration_id
                and claim.kind != controller_pb2.OPERATION_KIND_SAMPLE
            ):
                log.info("re-dispatching %s claimed before a restart", opid)
                self.dispatch(claim)
        for rid in await self.registry.all_ids():
            await self.ledger.repush(rid)

    def dispatch(self, claim: Claim) -> None:
        if claim.kind in DATA_KINDS:
            queue = self._queues.get(claim.replica)
            if queue is None:
                queue = self._queues[claim.replica] = asyncio.Queue()
                self._workers[claim.replica] = asyncio.create_task(
                    self._data_worker(claim.replica, queue), name=f"data-{claim.replica}"
                )
            queue.put_nowait(claim)
        else:
            self.spawn(self._run_control(claim))

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        tasks = [*self._workers.values(), *self._tasks]
        self._queues.clear()
        self._workers.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    # --- data operations ------------------------------------------------------------------
    async def _data_worker(self, replica: str, queue: asyncio.Queue[Claim]) -> None:
        # its backlog: claimed, not yet sent
        batcher = FairBatcher(limit=self.settings.max_batch_operations)
        while True:
            if not batcher.backlog:
                batcher.backlog.append(await queue.get())
                if self.settings.coalesce_window_ms > 0:
                    await asyncio.sleep(self.settings.coalesce_window_ms / 1000)
            while not queue.empty():
                batcher.backlog.append(queue.get_nowait())
            batch = batcher.take()
            try:
                await self._run_batch(replica, batch)
            except Exception as exc:  # never lose the worker, nor report what may have run
                log.exception("data batch on %s failed unexpectedly", replica)
                self.doubt(batch, exc)
            finally:
                batcher.finished()
            raise_if_stopped()

    async def _run_batch(self, replica: str, batch: list[Claim]) -> None:
        if not self.gate():  # no longer the leader: the claims stay for the next one
            return
        rep = await self.registry.replica(replica)
        if rep is None:
            await self._fail_all(batch, errors.Unavailable(f"trainer replica {replica} is gone"))
            return
        # A claim may have waited here (behind a batch stuck on a frozen or restarting trainer,
        # or re-dispatched after a doubt) while its trainer was lost and its run rebuilt in the
        # same slot: sent now, under the replica's current incarnation, it would land in the
        # middle of that restore (found by tests/e2e/test_campaign.py: a load_state refused
        # for un-stepped gradients, the run corrupted). replica_lost queued such an operation
        # again, so only claims the ledger and registry still hold go out, each operation once
        # (a stale claim and its re-claim in one call would both run before either is
        # recorded in the trainer's dedup).
        held = await asyncio.gather(*(self._still_holds(claim) for claim in batch))
        batch = list(
            {c.operation_id: c for c, holds in zip(batch, held, strict=True) if holds}.values()
        )
        if not batch:
            return
        items = [  # the payload's bytes as the gateway wrote them: the trainer parses them
            trainer_pb2.ForwardBackwardItem(
                operation_id=claim.operation_id,
                slot=claim.slot,
                registration_id=claim.registration_id,
                payload=claim.payload,
            )
            for claim in batch
        ]
        try:
            resp = await self.pool.trainer(rep.address).forward_backward(
                items, incarnation=rep.incarnation
            )
        except errors.LorafleetError as exc:
            if in_doubt(exc):
                self.doubt(batch, exc)
                return
            await self._fail_all(batch, _server_failure(exc, replica))
            return
        by_id = {r.operation_id: r for r in resp.results}
        done, outcomes, doubted = [], [], []
        for claim in batch:
            out = _outcome(claim, by_id.get(claim.operation_id))
            if out.error is not None and in_doubt(out.error):
                doubted.append(claim)
            else:
                done.append(claim)
                outcomes.append(out)
        if doubted:
            self.doubt(doubted, errors.FailedPrecondition("the trainer lost the slot"))
        await self._keep_applied(
            [c for c, o in zip(done, outcomes, strict=True) if o.state == OpState.SUCCEEDED]
        )
        if done:
            await self._record(done, outcomes)

    async def _fail_all(self, batch: Sequence[Claim], exc: errors.LorafleetError) -> None:
        await self._record(
            batch,
            [Outcome(c.operation_id, OpState.FAILED, error=exc, claim=c.claim) for c in batch],
        )

    async def _record(self, batch: Sequence[Claim], outcomes: list[Outcome]) -> None:
        """Every outcome of a batch in one ledger call."""
        for claim, done in zip(batch, await self.ledger.complete_many(outcomes), strict=True):
            if done:
                _observe(claim)

    # --- control operations ---------------------------------------------------------------
    async def _run_control(self, claim: Claim) -> None:
        if not self.gate():  # no longer the leader: the claim stays for the next one
            return
        try:
            try:
                result, effects = await self._control(claim)
            except errors.LorafleetError as exc:
                if claim.kind in TRAINER_KINDS and in_doubt(exc):
                    self.doubt([claim], exc)
                    return
                if claim.kind == K.OPERATION_KIND_SAVE_WEIGHTS_FOR_SAMPLER and (
                    exc.reason in LEASE_REASONS
                ):  # its trainer lost the slot (re-dispatched after a controller restart to a
                    # trainer that restarted too, the run not rebuilt yet: the fault campaign):
                    # asked again once its run holds a slot; a publish re-run keeps its version
                    self.doubt([claim], exc)
                    return
                if exc.category == "server" and not isinstance(exc, errors.Internal):
                    exc = _server_failure(exc, claim.replica)
                await self._finish(claim, OpState.FAILED, error=exc)
            except StoreError:
                raise
            except Exception as exc:
                log.exception("control operation %s failed", claim.operation_id)
                await self._finish(claim, OpState.FAILED, error=errors.Internal(str(exc)))
            else:
                await self._finish(claim, OpState.SUCCEEDED, result, effects=effects)
        except StaleEpoch:
            raise
        except StoreError as exc:  # the outcome is not recorded: ask again later
            self.doubt([claim], exc)

    async def _control(self, claim: Claim) -> tuple[controller_pb2.OperationResult, Effects]:
        payload = controller_pb2.OperationPayload.FromString(claim.payload)
        rep = await self.registry.replica(claim.replica)
        if rep is None or claim.slot < 0:
            raise errors.Unavailable(f"trainer replica {claim.replica!r} is gone")
        trainer = self.pool.trainer(rep.address)
        kind = claim.kind
        if kind == controller_pb2.OPERATION_KIND_OPTIM_STEP:
            resp = await trainer.optim_step(
                claim.operation_id,
                claim.slot,
                claim.registration_id,
                payload.optim_step,
                incarnation=rep.incarnation,
            )
            out = resp.output
            await self._keep_applied([claim])
            if resp.HasField("snapshot"):
                await self.recovery.record_snapshot(claim.registration_id, resp.snapshot)
            effects: Effects = [("set", "dirty", "0")]
            if out.applied:
                effects.append(("incr", "optim_steps", 1))
            effects += optim_effects(out)
            return controller_pb2.OperationResult(optim_step=out), effects
        saving = kind == controller_pb2.OPERATION_KIND_SAVE_STATE
        loading = kind == controller_pb2.OPERATION_KIND_LOAD_STATE
        if (saving or loading) and claim.dirty:
            name = "save_state" if saving else "load_state"
            raise errors.FailedPrecondition(
                f"{name} is not allowed while gradients are pending: run optim_step first",
                field="kind",
                reason="GRADIENTS_PENDING",
            )
        if saving:
            return await self._save_state(claim, payload.save_state, trainer, rep.incarnation)
        if loading:
            return await self._load_state(claim, payload.load_state, trainer, rep.incarnation)
        if kind == controller_pb2.OPERATION_KIND_SAVE_WEIGHTS_FOR_SAMPLER:
            return await self.publish(claim, payload.save_weights_for_sampler)
        raise errors.InvalidArgument(f"unsupported operation kind {kind}", field="payload")

    async def _save_state(
        self,
        claim: Claim,
        save: controller_pb2.SaveStatePayload,
        trainer: TrainerClient,
        incarnation: str,
    ) -> tuple[controller_pb2.OperationResult, Effects]:
        path = str(TinkerPath(claim.registration_id, CheckpointKind.WEIGHTS, save.name))
        owner = await self.catalog.owner(path)
        if owner is not None and owner != claim.operation_id:
            raise errors.AlreadyExists(
                f"{path} already exists (named states are immutable)", field="name"
            )
        manifest = await trainer.save_state(
            claim.operation_id,
            claim.slot,
            claim.registration_id,
            save.name,
            True,
            incarnation=incarnation,
        )
        reg = await self.registry.get_any(claim.registration_id)
        assert reg is not None
        await self.catalog.add(
            tinker_path=path,
            tenant=claim.tenant,
            type=TRAINING,
            base_model=reg.base_model,
            lora=reg.lora,
            manifest=manifest,
            has_optimizer=True,
            ttl_seconds=save.ttl_seconds,
            user_metadata=dict(save.user_metadata),
            operation_id=claim.operation_id,
        )
        result = controller_pb2.OperationResult(
            save_state=controller_pb2.SaveStateResult(path=path)
        )
        return result, [("set", "last_checkpoint", path)]

    async def _load_state(
        self,
        claim: Claim,
        load: controller_pb2.LoadStatePayload,
        trainer: TrainerClient,
        incarnation: str,
    ) -> tuple[controller_pb2.OperationResult, Effects]:
        ckpt = await self.catalog.get(claim.tenant, load.path)
        if ckpt.type != TRAINING:
            raise errors.InvalidArgument(
                "only tinker://.../weights/<name> checkpoints can be loaded", field="path"
            )
        await trainer.load_state(
            claim.operation_id,
            claim.slot,
            claim.registration_id,
            ckpt.manifest,
            load.with_optimizer,
            incarnation=incarnation,
        )
        await self._keep_applied([claim])
        result = controller_pb2.OperationResult(
            load_state=controller_pb2.LoadStateResult(
                path=load.path, registration_id=claim.registration_id
            )
        )
        return result, [("set", "last_checkpoint", load.path), ("set", "dirty", "0")]

    # --- failure means not applied --------------------------------------------------------
    async def _keep_applied(self, claims: Sequence[Claim]) -> None:
        """Log what the trainer applied for replay, before the outcome is recorded."""
        if claims:
            await self.recovery.log(
                [(c.registration_id, c.seq_id, c.kind, c.payload) for c in claims]
            )

    def doubt(self, claims: Sequence[Claim], cause: BaseException) -> None:
        """Claims whose outcome is unknown: never failed, asked again (see the module doc)."""
        log.warning("%d operation(s) in doubt (%s); asking the trainer again", len(claims), cause)
        self.spawn(self._ask_again(list(claims)))

    async def _ask_again(self, claims: list[Claim]) -> None:
        delay = 0.5
        while claims:
            await asyncio.sleep(delay)
            delay = min(2 * delay, 5.0)
            if not self.gate():  # the next leader re-dispatches what is still CLAIMED
                return
            unsure = []
            for claim in claims:
                try:
                    holds = await self._still_holds(claim)
                except StoreError:
                    unsure.append(claim)
                    continue
                if holds:
                    self.dispatch(claim)  # same operation id: the trainer's dedup answers
            claims = unsure

    async def _still_holds(self, claim: Claim) -> bool:
        """The operation is still CLAIMED by this claim (not re-queued and claimed again) and
        its registration still holds the claim's slot."""
        current = await self.ledger.load_claim(claim.operation_id)
        if current is None or current.claim != claim.claim:
            return False
        if not claim.registration_id:
            return True
        reg = await self.registry.get_any(claim.registration_id)
        return (
            reg is not None
            and reg.state == RegState.READY
            and reg.replica == claim.replica
            and reg.slot == claim.slot
        )

    # --- outcomes -------------------------------------------------------------------------
    async def _finish(
        self,
        claim: Claim,
        state: OpState,
        result: controller_pb2.OperationResult | None = None,
        error: errors.LorafleetError | None = None,
        effects: Sequence[tuple[str, str, Any]] = (),
    ) -> None:
        body = result.SerializeToString() if result is not None else b""
        if await self.ledger.complete(
            claim.operation_id, state, body, error, effects, claim=claim.claim
        ):
            _observe(claim)


def _observe(claim: Claim) -> None:
    metrics.OPERATION_LATENCY.labels(kind=KIND_NAMES.get(claim.kind, "other")).observe(
        max(0.0, time.time() - claim.submitted_at)
    )


def _outcome(claim: Claim, item: trainer_pb2.ForwardBackwardItemResult | None) -> Outcome:
    """A data operation's outcome from its item of the trainer's batch answer."""
    opid, number = claim.operation_id, claim.claim
    if item is None:
        return Outcome(
            opid, OpState.FAILED, error=errors.Internal("trainer returned no result"), claim=number
        )
    if item.WhichOneof("outcome") != "result":
        return Outcome(opid, OpState.FAILED, error=exception_from_info(item.error), claim=number)
    forward = claim.kind == controller_pb2.OPERATION_KIND_FORWARD
    effects: Effects = [] if forward else [("set", "dirty", "1")]
    effects += forward_effects(claim.kind, item.target_tokens)
    # stored as the trainer serialised it: GetOperation hands these bytes to the gateway
    return Outcome(opid, OpState.SUCCEEDED, item.result, effects=effects, claim=number)


def in_doubt(exc: BaseException) -> bool:
    """Whether a failed trainer call may still have applied the operation: contact was lost
    (after the client's transport retries), or the trainer no longer holds the slot."""
    if isinstance(exc, errors.Unavailable):
        return True
    return isinstance(exc, errors.LorafleetError) and exc.reason in LEASE_REASONS


def fair_batch(backlog: list[Claim], cap: Callable[[str], int], limit: int = 0) -> list[Claim]:
    """Take the next trainer batch out of `backlog` (claims in arrival order, changed in
    place): at most `cap(tenant)` claims of each tenant, interleaved tenant by tenant, each
    tenant's claims in arrival order, and at most `limit` in all (0: no limit); what is left
    stays in the backlog, in order, for the next batch.

    Why a cap and not just an order: a batch costs the trainer time per operation, and every
    operation in it waits for the whole batch. Uncapped, a tenant that floods (many runs
    with never-retrieved forward calls) fills every batch, so another tenant's one step
    pays for the flood twice: behind the flood's batch in flight, then inside a batch made
    mostly of flood. Capped, a new tenant's claim joins the very next batch whatever the
    flood's backlog (bench/fairness.py).
    The backlog holds at most one claim per registration (the ledger only releases a
    registration's head), so deferring a claim never reorders a run's operations; claims
    left here stay CLAIMED in the ledger, so a controller that dies with a backlog leaves
    them to the next leader's `recover` like any other claim."""
    taken: OrderedDict[str, list[Claim]] = OrderedDict()
    for claim in backlog:
        lane = taken.setdefault(claim.tenant, [])
        if len(lane) < cap(claim.tenant):
            lane.append(claim)
    out: list[Claim] = []
    for i in range(max(map(len, taken.values()), default=0)):
        out += [lane[i] for lane in taken.values() if i < len(lane)]
    if limit > 0:
        out = out[:limit]
    chosen = {id(claim) for claim in out}  # by identity: a stale claim and its re-claim
    backlog[:] = [claim for claim in backlog if id(claim) not in chosen]
    return out


class FairBatcher:
    """One trainer's backlog of claims and the batches taken from it (`fair_batch`): each
    tenant at most `per_tenant` per batch, and only `contended` while another tenant is light.

    A light tenant has at most `contended` claims waiting (a run or two stepping in
    lockstep, as SDK clients do); with none waiting, it stays "about" for `recent_s` after
    its batch returned, while its next step is on its way. Why the smaller share: a capped
    flood still costs a light tenant two batches of up to `per_tenant` of the flood's
    operations, the one already on the trainer when its step arrives and the one its step
    joins, and they made its tail (bench/fairness.py: 7 ms in each of its slowest steps at a
    share of 8). While a light tenant is about, both hold at most `contended` of each other
    tenant. Busy tenants alone (each with more waiting) still share batches of `per_tenant`
    each, so batching throughput only yields to a light tenant's step. A light tenant's
    claims fit its share, so they are never split over batches; the backlog holds at most
    one claim per registration, so no share reorders a run's operations."""

    def __init__(
        self,
        per_tenant: int = BATCH_PER_TENANT,
        contended: int = BATCH_SHARE_CONTENDED,
        recent_s: float = LIGHT_RECENT_S,
        clock: Callable[[], float] = time.monotonic,
        limit: int = 0,
    ) -> None:
        self.backlog: list[Claim] = []  # claimed, not yet taken, in arrival order
        self.limit = limit  # operations per batch in all (0: only the tenants' caps)
        self.per_tenant = per_tenant
        self.contended = contended
        self.recent_s = recent_s
        self.clock = clock
        self._about: dict[str, float] = {}  # light tenant -> when its last batch returned
        self._serving: set[str] = set()  # light tenants of the batch taken last

    def take(self) -> list[Claim]:
        """The next batch; call `finished` when it returned."""
        now = self.clock()
        self._about = {t: at for t, at in self._about.items() if now - at <= self.recent_s}
        waiting = Counter(claim.tenant for claim in self.backlog)
        self._serving = {t for t, n in waiting.items() if n <= self.contended}
        # one that was light but has more waiting now is busy, whatever its past
        light = self._serving | (self._about.keys() - waiting.keys())

        def cap(tenant: str) -> int:
            return self.contended if light - {tenant} else self.per_tenant

        return fair_batch(self.backlog, cap, self.limit)

    def finished(self) -> None:
        """The batch taken last returned: its light tenants' next steps are on their way."""
        now = self.clock()
        for tenant in self._serving:
            self._about[tenant] = now
        self._serving = set()


def _server_failure(exc: errors.LorafleetError, replica: str) -> errors.LorafleetError:
    """Name the trainer when it could not be reached; a rollout that refused a publish
    (PUBLISH_INCOMPLETE) is already named by the error and is not the trainer's fault."""
    if isinstance(exc, errors.Unavailable) and exc.reason != "PUBLISH_INCOMPLETE":
        return errors.Unavailable(
            f"trainer replica {replica} could not be reached: {exc.message}",
            reason="TRAINER_UNREACHABLE",
        )
    return exc
