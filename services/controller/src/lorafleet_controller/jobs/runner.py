"""The durable job runner: jobs as ledger operations on their run, resumed by the leader.

`JobRunner.create` validates a request whole (parameters, data, run, chat template, units)
before it writes anything, then records the job and queues it on its run. The leader runs
one worker per run with unfinished jobs, one job at a time (they share the run's seq_ids).
A job starts at the run's next seq_id (stored in its cursor) and submits every operation
through the controller's admission flow (`flows.operations`, named by `jobs.host.JobHost`,
so nothing here imports the controller), exactly as the gateway does for an SDK client, then
waits on the ledger for its result.

Durability: the cursor is written at every pass boundary (`loop.Cursor`), and results are
acknowledged only after the cursor that no longer needs them is durable. A controller that
dies mid-pass is replaced by a leader that re-runs the pass from its cursor: every
operation it submits again is a duplicate the ledger answers with the stored result
(or waits for, if it had not run yet), so nothing runs twice and the adapter ends as it
would have without the crash.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import time
import uuid
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from lorafleet import contract, errors
from lorafleet.v1 import common_pb2, controller_pb2
from lorafleet_controller.flows.operations import Submission
from lorafleet_controller.flows.registrations import NewRegistration
from lorafleet_controller.jobs import data, loop, params, tokenizer, units
from lorafleet_controller.jobs.host import JobHost
from lorafleet_controller.jobs.params import JobKind, JobParams
from lorafleet_controller.jobs.records import JobRecord, JobState, Records
from lorafleet_controller.registry import TRAINER, RegRecord
from lorafleet_controller.store import OpState, RegState, StaleEpoch

log = logging.getLogger(__name__)
pb = controller_pb2
# A job waits on its operations in slices of this length and checks for a cancel between
# them: cancel is seen within about a second at every wait, on whichever controller took it.
WAIT_SECONDS = 1.0
HEARTBEAT_SECONDS = 60.0
JOBS_TAG = "lorafleet-jobs"
T = TypeVar("T")


class JobCancelled(Exception):
    """Raised between two operations of a job whose cancellation was requested."""


def job_error(exc: errors.LorafleetError) -> dict[str, str]:
    return {
        "category": exc.category,
        "field": exc.field,
        "message": exc.message,
        "reason": exc.reason or type(exc).__name__,
    }


def _tensor(
    fmt: str, dtype: common_pb2.DType.ValueType, values: Sequence[float]
) -> common_pb2.Tensor:
    return common_pb2.Tensor(
        dtype=dtype, shape=[len(values)], data=struct.pack(f"<{len(values)}{fmt}", *values)
    )


def datum(chunk: units.Chunk) -> common_pb2.Datum:
    """A chunk as a cross-entropy datum: weight 1 on trained targets, 0 elsewhere; a
    window's document context travels as `Datum.context` (truncated BPTT in the trainer)."""
    return common_pb2.Datum(
        tokens=chunk.tokens,
        context=chunk.context,
        window=chunk.window,
        loss_fn_inputs={
            "target_tokens": _tensor("q", common_pb2.DTYPE_INT64, chunk.targets),
            "weights": _tensor("f", common_pb2.DTYPE_FLOAT32, [float(m) for m in chunk.mask]),
        },
    )


def stored_params(kind: JobKind, p: JobParams) -> dict[str, str]:
    """The parameters a job stores: every one its kind accepts, defaults filled in."""
    return {k: v for k, v in p.to_text().items() if k in params.ACCEPTED[kind] and v != ""}


class LedgerExecutor:
    """`loop.Executor` over the ledger: operation k of the job is seq_id `seq + k`."""

    def __init__(self, runner: JobRunner, rec: JobRecord, seq: int) -> None:
        self.runner = runner
        self.host = runner.host
        self.rec = rec
        self.seq = seq
        self.unacked: list[str] = []
        self.live: list[dict[str, Any]] = []  # curve points since the last pass boundary
        self.tasks: set[asyncio.Task[Any]] = set()  # results still awaited
        self._beat = 0.0

    async def _submit(self, payload: pb.OperationPayload) -> str:
        """Admit the job's next operation (retrying backpressure); its operation id."""
        sub = Submission(
            tenant=self.rec.tenant,
            registration_id=self.rec.registration_id,
            seq_id=self.seq,
            payload=payload.SerializeToString(deterministic=True),
        )
        while True:
            await self._check_cancel()
            try:
                adm = await self.host.operations.submit(sub)
                break
            except errors.ResourceExhausted as exc:  # backpressure: nothing was admitted
                await asyncio.sleep(min(exc.retry_after or 1.0, WAIT_SECONDS))
        self.seq += 1
        self.unacked.append(adm.operation_id)
        return adm.operation_id

    async def _result(self, opid: str) -> pb.OperationResult:
        """Wait for an operation of the job; its result, or the failure it ended with."""
        while True:
            op = await self.host.ledger.wait(self.rec.tenant, opid, WAIT_SECONDS)
            await self._heartbeat()
            if op.terminal:
                break
            await self._check_cancel()
        if op.state != OpState.SUCCEEDED:
            err = op.error or {}
            raise errors.FailedPrecondition(
                f"operation {opid} ended {op.state.label}: {err.get('message', 'no result')}",
                field=err.get("field", ""),
                reason=err.get("reason", "OPERATION_FAILED"),
            )
        return pb.OperationResult.FromString(op.result)

    async def _check_cancel(self) -> None:
        if await self.runner.records.cancel_requested(self.rec.job_id):
            raise JobCancelled

    async def _op(self, payload: pb.OperationPayload) -> pb.OperationResult:
        return await self._result(await self._submit(payload))

    def _later(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def abandon(self) -> None:
        """Stop waiting for results still outstanding (the job failed or was cancelled)."""
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _heartbeat(self) -> None:
        """Keep the run's session alive while its job runs (sessions time out when silent)."""
        now = time.monotonic()
        if now - self._beat < HEARTBEAT_SECONDS:
            return
        self._beat = now
        session = contract.RunId.parse(self.rec.registration_id).session_id
        with contextlib.suppress(errors.LorafleetError):
            await self.host.tenancy.heartbeat(self.rec.tenant, session)

    async def forward_backward(
        self, chunks: Sequence[units.Chunk], group_tokens: int, forward_only: bool
    ) -> asyncio.Task[float]:
        fb = common_pb2.ForwardBackwardInput(
            data=[datum(c) for c in chunks],
            loss_fn="cross_entropy",
            forward_only=forward_only,
            group_tokens=0 if forward_only else group_tokens,
        )
        payload = (
            pb.OperationPayload(forward=fb)
            if forward_only
            else pb.OperationPayload(forward_backward=fb)
        )
        opid = await self._submit(payload)

        async def loss() -> float:
            return float((await self._result(opid)).forward_backward.metrics["loss:sum"])

        return self._later(loss())

    async def optim_step(self, lr: float, p: JobParams) -> asyncio.Task[None]:
        adam = common_pb2.AdamParams(
            learning_rate=lr,
            beta1=contract.ADAM_DEFAULTS["beta1"],
            beta2=contract.ADAM_DEFAULTS["beta2"],
            eps=contract.ADAM_DEFAULTS["eps"],
            weight_decay=p.weight_decay,
            # explicit, so 0 means no clipping even on a run with max_grad_norm_default;
            # decay on A only, whoever created the run (juno's definition)
            grad_clip_norm=p.max_grad_norm,
            a_only_weight_decay=True,
        )
        opid = await self._submit(pb.OperationPayload(optim_step=adam))

        async def applied() -> None:
            await self._result(opid)

        return self._later(applied())

    async def save_state(self, name: str) -> str:
        out = await self._op(pb.OperationPayload(save_state=pb.SaveStatePayload(name=name)))
        return out.save_state.path

    async def load_state(self, path: str) -> None:
        await self._op(pb.OperationPayload(load_state=pb.LoadStatePayload(path=path)))

    async def checkpoint(self, cursor: loop.Cursor) -> None:
        cursor.seq = self.seq
        self.live = []
        await self.runner.records.update(self.rec.job_id, cursor=cursor.to_dict(), live=[])
        await self.ack()

    async def ack(self) -> None:
        """Release results the durable cursor no longer needs."""
        for opid in self.unacked:
            with contextlib.suppress(errors.LorafleetError):
                await self.host.ledger.ack(self.rec.tenant, opid)
        self.unacked = []

    async def report(self, point: dict[str, Any]) -> None:
        self.live.append(point)
        await self.runner.records.update(self.rec.job_id, live=self.live)


class JobRunner:
    """Creates, runs, resumes and cancels jobs; `resume`/`stop` follow the leadership."""

    def __init__(self, host: JobHost) -> None:
        self.host = host
        self.records = Records(host.store, host.notifier)
        self._workers: dict[str, asyncio.Task[None]] = {}
        self._tenant_locks: dict[str, asyncio.Lock] = {}
        # base model -> ((replica id, incarnation) it came from, its tokenizer)
        self._codecs: dict[str, tuple[tuple[str, str], tokenizer.HfCodec]] = {}
        self._running = False

    # --- requests ---------------------------------------------------------------------------
    async def create(
        self,
        tenant: str,
        kind: JobKind,
        rid: str,
        base_model: str,
        raw: dict[str, str],
        pairs: Sequence[data.Pair],
        documents: Sequence[str],
    ) -> JobRecord:
        """Validate the whole request, then record and queue the job. Requests on a
        tenant's default run are serialised, so concurrent first jobs share one run."""
        if rid:
            return await self._create(tenant, kind, rid, base_model, raw, pairs, documents)
        lock = self._tenant_locks.setdefault(tenant, asyncio.Lock())
        async with lock:
            return await self._create(tenant, kind, rid, base_model, raw, pairs, documents)

    async def _create(
        self,
        tenant: str,
        kind: JobKind,
        rid: str,
        base_model: str,
        raw: dict[str, str],
        pairs: Sequence[data.Pair],
        documents: Sequence[str],
    ) -> JobRecord:
        p = params.parse(kind, raw)
        if kind == JobKind.QA:
            data.check_pairs(pairs)
        elif kind == JobKind.TEXT:
            data.check_documents(documents)
        reg: RegRecord | None = None
        if rid:
            reg = await self.host.registry.get(tenant, rid)
            if reg.state == RegState.RETIRED:
                raise errors.FailedPrecondition(
                    f"run {rid} was retired", field="registration_id", reason="RETIRED"
                )
            if base_model and base_model != reg.base_model:
                raise errors.InvalidArgument(
                    f"run {rid} trains {reg.base_model!r}", field="base_model"
                )
            self._check_shape(rid, reg.lora, p, raw)
        else:
            reg = await self._live_default(tenant)
            if reg is not None:
                self._check_shape(reg.registration_id, reg.lora, p, raw)
            elif resumed := (await self.records.default_run(tenant)).get("checkpoint", ""):
                # the default run gave its slot back; the next one resumes this state
                ckpt = await self.host.catalog.get(tenant, resumed)
                self._check_shape(resumed, ckpt.lora, p, raw)
        base = reg.base_model if reg is not None else await self._default_base(base_model)
        await self._check_adapter(base, p)
        stored = {"pairs": [[x.question, x.answer] for x in pairs], "documents": list(documents)}
        plan = await self._plan(kind, base, p, stored)
        # Everything is valid: from here on, things are written.
        if reg is None:
            reg = await self._create_default(tenant, base, p)
        job_id = f"job-{uuid.uuid4().hex[:20]}"
        max_updates = (
            0 if plan is None else p.max_iters * plan.updates_per_pass(p.gradient_accumulation)
        )
        rec = await self.records.create(
            job_id,
            tenant,
            kind.value,
            reg.registration_id,
            reg.base_model,
            stored_params(kind, p),
            stored,
            max_updates,
        )
        self._kick(reg.registration_id)
        return rec

    async def cancel(self, tenant: str, job_id: str) -> JobRecord:
        rec = await self.records.get(tenant, job_id)
        if not rec.finished:
            await self.records.request_cancel(job_id)
        return await self.records.get(tenant, job_id)

    async def reset_default(self, tenant: str) -> str:
        """Retire the tenant's default run; the next job without a run starts afresh."""
        async with self._tenant_locks.setdefault(tenant, asyncio.Lock()):
            rid = (await self.records.default_run(tenant)).get("rid", "")
            if rid:
                with contextlib.suppress(errors.NotFound):
                    await self.host.registrations.delete(tenant, rid)
            await self.records.clear_default_run(tenant)
            return rid

    # --- validation helpers ---------------------------------------------------------------
    @staticmethod
    def _check_shape(
        run: str, lora: common_pb2.LoraConfig, p: JobParams, raw: dict[str, str]
    ) -> None:
        """A job on an existing run (or the state the default run resumes) may not ask for a
        different adapter shape."""
        have = {
            "rank": lora.rank,
            "alpha": contract.effective_alpha(lora.alpha),
            "dropout": round(lora.dropout, 6),
            "lora_plus_ratio": contract.b_lr_ratio(lora.lora_plus_ratio),
            "targets": tuple(lora.target_modules),
        }
        want = {
            "rank": p.rank,
            "alpha": p.alpha,
            "dropout": round(p.dropout, 6),
            "lora_plus_ratio": p.lora_plus_ratio,
            "targets": tuple(p.lora_targets),
        }
        for name in params.LORA_SHAPE:
            if name in raw and have[name] is not None and have[name] != want[name]:
                raise errors.InvalidArgument(
                    f"run {run} has {name} {have[name]!r}; a job cannot "
                    "change an existing adapter's shape (POST /v1/lora/reset for a new one)",
                    field=name,
                )

    async def _check_adapter(self, base_model: str, p: JobParams) -> None:
        """Rank and targets against what the base model's trainers report (capabilities), so
        a typo fails the request now instead of the run at bind time."""
        trainers = await self.host.registry.replicas(TRAINER, base_model)
        contract.check_rank(p.rank, max((r.max_rank for r in trainers), default=0), "rank")
        modules = sorted({m for r in trainers for m in r.modules})
        if modules:  # none reported yet: the trainer checks at bind
            contract.check_target_names(p.lora_targets, modules, "targets")

    async def _live_default(self, tenant: str) -> RegRecord | None:
        rid = (await self.records.default_run(tenant)).get("rid", "")
        if not rid:
            return None
        reg = await self.host.registry.get_any(rid)
        return None if reg is None or reg.state == RegState.RETIRED else reg

    async def _default_base(self, requested: str) -> str:
        served = sorted({r.base_model for r in await self.host.registry.replicas(TRAINER)})
        if requested:
            if requested not in served:
                raise errors.InvalidArgument(
                    f"no trainer serves {requested!r} (served: {served})", field="base_model"
                )
            return requested
        if len(served) == 1:
            return served[0]
        if not served:
            raise errors.Unavailable("no trainer is registered yet", field="base_model")
        raise errors.InvalidArgument(
            f"several base models are served ({served}); name one", field="base_model"
        )

    async def _codec(self, base_model: str) -> tuple[tokenizer.HfCodec, int]:
        """The base model's tokenizer, streamed from a trainer that serves the model (kept
        while that trainer process lives), and the model's positions (the fewest any of its
        trainers has): the controller itself loads nothing by name."""
        trainers = sorted(
            (r for r in await self.host.registry.replicas(TRAINER, base_model) if r.healthy),
            key=lambda r: r.replica_id,
        )
        if not trainers:
            raise errors.Unavailable(f"no trainer of {base_model!r} is up", field="base_model")
        rep = trainers[0]
        source = (rep.replica_id, rep.incarnation)
        known = self._codecs.get(base_model)
        if known is None or known[0] != source:
            files = await self.host.pool.trainer(rep.address).export_tokenizer()
            known = source, await asyncio.to_thread(tokenizer.from_files, files)
            self._codecs[base_model] = known
        return known[1], min(r.max_context_length for r in trainers)

    async def _plan(
        self, kind: JobKind, base_model: str, p: JobParams, stored: dict[str, Any]
    ) -> units.Plan | None:
        if kind == JobKind.SAVE:
            return None
        codec, positions = await self._codec(base_model)
        if kind == JobKind.QA:
            pairs = [data.Pair(q, a) for q, a in stored["pairs"]]
            return await asyncio.to_thread(
                units.qa_plan,
                codec,
                pairs,
                p.validation_split,
                p.seed,
                p.max_train_tokens,
                positions,
            )
        return await asyncio.to_thread(
            units.text_plan,
            codec,
            stored["documents"],
            p.chunk_tokens,
            p.validation_split,
            p.seed,
            p.max_train_tokens,
            positions,
        )

    async def _create_default(self, tenant: str, base_model: str, p: JobParams) -> RegRecord:
        """The tenant's default run: a fresh adapter of the job's shape, or, when the last
        default run was retired (its session timed out), one resumed from its final state."""
        previous = await self.records.default_run(tenant)
        session = await self.host.tenancy.create_session(
            tenant, [JOBS_TAG], {}, "", "", "managed training jobs"
        )
        lora = common_pb2.LoraConfig(
            rank=p.rank,
            alpha=p.alpha,
            dropout=p.dropout,
            seed=p.seed,
            target_modules=p.lora_targets,
            lora_plus_ratio=p.lora_plus_ratio,
        )
        new = NewRegistration(
            tenant=tenant,
            session_id=session,
            model_seq_id=0,
            base_model=base_model,
            lora=lora,
            initial_checkpoint=previous.get("checkpoint", ""),
            # with its Adam moments and step count: giving the slot back between jobs
            # (`_release_default`) changes nothing the next job computes
            initial_with_optimizer=True,
        )
        reg, _ = await self.host.registrations.create(new)
        await self.records.set_default_run(tenant, rid=reg.registration_id, checkpoint="")
        return reg

    # --- execution (leader only) ----------------------------------------------------------
    async def resume(self) -> None:
        """Start a worker for every run with unfinished jobs (after a restart or failover)."""
        self._running = True
        for job_id in await self.records.open_ids():
            with contextlib.suppress(errors.NotFound):
                rec = await self.records.get_any(job_id)
                self._kick(rec.registration_id)

    async def stop(self) -> None:
        self._running = False
        workers = list(self._workers.values())
        self._workers.clear()
        for task in workers:
            task.cancel()
        for task in workers:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def _kick(self, rid: str) -> None:
        if not self._running or not self.host.leading:
            return
        task = self._workers.get(rid)
        if task is None or task.done():
            self._workers[rid] = asyncio.create_task(self._work(rid), name=f"jobs:{rid}")

    async def _work(self, rid: str) -> None:
        while True:
            queue = await self.records.run_queue(rid)
            if not queue:
                return
            try:
                rec = await self.records.get_any(queue[0])
            except errors.NotFound:
                await self.records.drop_from_run(rid, queue[0])
                continue
            try:
                state = await self._execute(rec)
            except asyncio.CancelledError:
                raise
            except StaleEpoch:  # deposed: the new leader resumes the job from its cursor
                log.info("job %s: this controller was deposed, leaving it", rec.job_id)
                return
            except Exception as exc:  # a bug must fail the job, not wedge the run's queue
                log.exception("job %s failed", rec.job_id)
                await self.records.finish(
                    rec, JobState.FAILED, error=job_error(errors.Internal(str(exc)))
                )
                continue
            if state == JobState.SUCCEEDED:
                await self._release_default(rec)

    async def _release_default(self, rec: JobRecord) -> None:
        """Give a tenant's default run's slot back as soon as its last job succeeded.

        Its session belongs to the jobs (nobody else submits to it), and the job's final
        state (weights and optimizer) is the default run's checkpoint, which the next job
        resumes on a fresh run (`_create_default`), so the slot is not held idle until the
        session times out. Only after a success: a cancelled or failed job's partial updates
        are in no checkpoint, so that run keeps its slot until its session times out. Under
        the tenant's lock, so a job created meanwhile either lands on this run (which then
        keeps its slot: the worker goes on to it) or sees it retired and starts the fresh one.
        """
        async with self._tenant_locks.setdefault(rec.tenant, asyncio.Lock()):
            default = await self.records.default_run(rec.tenant)
            if default.get("rid") != rec.registration_id or not default.get("checkpoint"):
                return
            if await self.records.run_queue(rec.registration_id):
                return
            reg = await self.host.registry.get(rec.tenant, rec.registration_id)
            if reg.state != RegState.RETIRED:
                log.info("run %s: its jobs are done, giving its slot back", reg.registration_id)
                await self.host.sessions.finish(rec.tenant, reg.session_id, "jobs done")

    async def _execute(self, rec: JobRecord) -> JobState:
        """Run one job to its end; the state it finished in."""
        kind = JobKind(rec.kind)
        if rec.finished:
            await self.records.finish(rec, rec.state)
            return rec.state
        if rec.cancel_requested and rec.state == JobState.QUEUED:
            await self.records.finish(rec, JobState.CANCELLED)
            return JobState.CANCELLED
        if rec.cursor is None:
            reg = await self.host.registry.get_any(rec.registration_id)
            if reg is None:
                raise errors.NotFound(f"no run {rec.registration_id}", field="registration_id")
            cursor = loop.Cursor(seq=reg.max_seq + 1)
            await self.records.update(
                rec.job_id,
                state=JobState.RUNNING.value,
                started_at=time.time(),
                cursor=cursor.to_dict(),
            )
        else:
            cursor = loop.Cursor.from_dict(rec.cursor)
        p = params.parse(kind, rec.params)
        ex = LedgerExecutor(self, rec, cursor.seq)
        try:
            if kind == JobKind.SAVE:
                path = await ex.save_state(p.name or f"{rec.job_id}-save")
                result: dict[str, Any] = {"checkpoint": path}
            else:
                plan = await self._plan(kind, rec.base_model, p, rec.data)
                assert plan is not None
                cursor = await loop.run(rec.job_id, plan, p, ex, cursor)
                path = await ex.save_state(f"{rec.job_id}-final")
                result = loop.result(kind, plan, cursor, path)
        except (asyncio.CancelledError, StaleEpoch):  # leadership lost: the next leader
            await ex.abandon()  # resumes the job (acknowledging nothing it still needs)
            raise
        except JobCancelled:
            await ex.abandon()
            await ex.ack()
            await self.records.finish(rec, JobState.CANCELLED, cursor=cursor.to_dict())
            return JobState.CANCELLED
        except errors.LorafleetError as exc:
            await ex.abandon()
            await ex.ack()
            await self.records.finish(rec, JobState.FAILED, error=job_error(exc))
            return JobState.FAILED
        await ex.ack()
        await self.records.finish(rec, JobState.SUCCEEDED, result=result, cursor=cursor.to_dict())
        await self.records.set_default_checkpoint(rec.tenant, rec.registration_id, path)
        return JobState.SUCCEEDED
