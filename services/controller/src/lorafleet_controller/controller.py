"""The controller: wires the Redis-backed parts together and runs the background loops.

Holds no state that matters only in memory: the ledger, registry, catalog, samplers and
tenancy live in Redis; what is in memory (the long-poll waiters, per-trainer batch queues,
sampler load counters) is rebuilt or re-derived by `start()` after a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from lorafleet import errors, quantize
from lorafleet.v1 import common_pb2, controller_pb2
from lorafleet_controller import metrics, validate
from lorafleet_controller.catalog import SAMPLER, TRAINING, Catalog
from lorafleet_controller.clients import Pool, TrainerClient
from lorafleet_controller.discovery.types import Discovery
from lorafleet_controller.fleet import Fleet
from lorafleet_controller.jobs.runner import JobRunner
from lorafleet_controller.ledger import Admission, Ledger
from lorafleet_controller.loops import raise_if_stopped
from lorafleet_controller.membership import Membership
from lorafleet_controller.notify import Notifier
from lorafleet_controller.paging import Pager
from lorafleet_controller.publish import Publisher
from lorafleet_controller.recovery import Recovery
from lorafleet_controller.registry import (
    ROLLOUT,
    TRAINER,
    Placer,
    Registry,
    RegRecord,
    Replica,
    base_model_name,
)
from lorafleet_controller.samplers import SamplerRecord, Samplers, sampler_id_of
from lorafleet_controller.scheduler import Scheduler
from lorafleet_controller.settings import ControllerSettings
from lorafleet_controller.store import RegState, StaleEpoch, Store, connect
from lorafleet_controller.tenancy import Tenancy
from lorafleet_controller.usage import Usage

log = logging.getLogger(__name__)


class Controller:
    """The controller's parts and loops.

    `start()` makes it answer RPCs; `start_leading()` starts dispatch (scheduler, sweeper,
    discovery). Without leader election both happen at start; with it, the elector calls
    `start_leading` / `stop_leading`, and `is_leader` (the elector's clock-based check) is
    asked again before every claim, dispatch and sweep, so a controller whose lease ran out
    stops writing even before its loops are cancelled.
    """

    def __init__(
        self,
        settings: ControllerSettings,
        clock: Callable[[], float] = time.time,
        discovery: Discovery | None = None,
        is_leader: Callable[[], bool] = lambda: True,
    ):
        self.settings = settings
        self.is_leader = is_leader  # the elector's clock-based check, when electing
        self.store = Store(
            connect(settings.redis_url, cluster=settings.redis_cluster), settings.key_prefix
        )
        # BLPOP holds a connection: the scheduler's intake gets a client of its own.
        self.blocking = connect(settings.redis_url, cluster=settings.redis_cluster)
        self.notifier = Notifier(self.store)
        self.pool = Pool(settings.transport_retry_seconds, settings.rpc_timeout_seconds)
        self.ledger = Ledger(self.store, settings, self.notifier, clock)
        self.registry = Registry(self.store, settings, clock)
        self.catalog = Catalog(self.store, clock)
        self.tenancy = Tenancy(self.store, clock)
        self.usage = Usage(self.store, self.registry)  # per-tenant usage (chargeback)
        self.recovery = Recovery(
            self.store,
            self.catalog.manifest_for,
            self._retire_corrupted,
            self._trainer_of,
        )
        self.placer = Placer(self.registry, self.pool, self._restore, self.fail_run)
        self.pager = Pager(self.registry, self.pool, self.recovery, self.placer, settings, clock)
        self.samplers = Samplers(self.store, self.ledger, self.registry, self.pool, settings)
        self.publisher = Publisher(
            self.store,
            settings.storage_root,
            self.registry,
            self.catalog,
            self.samplers,
            self.pool,
            settings.resident_versions,
            settings.shared_adapter_root,
        )
        self.scheduler = Scheduler(
            self.blocking,
            self.store.keys,
            self.ledger,
            self.registry,
            self.catalog,
            self.pool,
            settings,
            self.publisher.publish,
            self.recovery,
            gate=is_leader,
        )
        self.fleet = Fleet(self.registry, self.ledger, self.pool)
        self.membership: Membership | None = None
        if discovery is not None:
            self.membership = Membership(
                discovery,
                self.registry,
                self.pool,
                self.admit_replica,
                self.lose_replica,
                probe_interval=settings.heartbeat_interval_seconds,
            )
        self.jobs = JobRunner(self)  # managed training jobs (issue 13); run by the leader
        self._loops: list[asyncio.Task[None]] = []
        # Heartbeats go through Redis: after Redis was out of reach (or this process was
        # starved) for longer than a heartbeat interval, replicas get a full heartbeat
        # timeout from then before their silence counts (an outage fails nothing by itself).
        self._swept_at = self._heard_since = time.monotonic()
        # Sessions heartbeat through the gateway and this controller: one that could not reach
        # us (we were down, deposed, starved or cut off from Redis) gets a full session
        # timeout from the moment dispatch resumed before its silence counts.
        self._sessions_heard_since = self._heard_since
        self._side: set[asyncio.Task[None]] = set()
        self._leading = asyncio.Lock()

    # --- lifecycle ------------------------------------------------------------------------
    async def start(self, lead: bool = True) -> None:
        await self.store.ping()
        await self.notifier.start()
        if lead:
            await self.start_leading()

    async def start_leading(self) -> None:
        """Recover what a previous leader left (claims, ready heads) and start dispatching."""
        async with self._leading:
            if self._loops:
                return
            epoch = await self.store.take_epoch()
            self._sessions_heard_since = time.monotonic()
            log.info("dispatching under leader epoch %d", epoch)
            await self.scheduler.recover()
            await self.samplers.recover()
            self._loops = [
                asyncio.create_task(self.scheduler.run(), name="scheduler"),
                asyncio.create_task(self._sweeper(), name="sweeper"),
            ]
            if self.membership is not None:
                self._loops.append(asyncio.create_task(self.membership.run(), name="membership"))
        self._background(self._fill_all())
        await self.jobs.resume()

    async def _fill_all(self) -> None:
        """Place what queued up while no leader acted on it (e.g. a trainer came back)."""
        for base in sorted({r.base_model for r in await self.registry.replicas(TRAINER)}):
            await self.placer.fill(base)

    async def stop_leading(self) -> None:
        """Stop every loop and in-flight dispatch; CLAIMED operations stay for the next leader.

        The next leader re-sends them under the same operation id, and the trainer answers a
        repeated id with its first result, so nothing runs twice.
        """
        async with self._leading:
            await self.jobs.stop()  # jobs resume from their cursors under the next leader
            tasks = [*self._loops, *self._side]
            self._loops = []
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            await self.scheduler.stop()
            await self.samplers.stop()
            self.store.drop_epoch()
            self.usage.forget_tick()

    async def stop(self) -> None:
        await self.stop_leading()
        await self.notifier.stop()
        await self.pool.close()
        await self.blocking.aclose()
        await self.store.close()

    @property
    def leading(self) -> bool:
        """Dispatch loops are running and the lease (if any) is still held."""
        return bool(self._loops) and self.is_leader()

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        if not self.leading:  # a standby changes no placements; the leader re-derives them
            coro.close()
            return
        task = asyncio.create_task(coro)
        self._side.add(task)
        task.add_done_callback(self._side.discard)

    async def _sweeper(self) -> None:
        while self.is_leader():
            try:
                await self.sweep_once()
            except asyncio.CancelledError:
                raise
            except StaleEpoch as exc:  # deposed: a newer leader sweeps now
                log.warning("sweeper stops: %s", exc)
                return
            except Exception:
                log.exception("sweep failed")
            raise_if_stopped()
            await asyncio.sleep(self.settings.sweep_interval_seconds)

    async def sweep_once(self) -> None:
        await self.ledger.sweep()
        await self.catalog.sweep_expired()
        now = time.monotonic()
        if now - self._swept_at > self.settings.heartbeat_interval_seconds:
            self._heard_since = self._sessions_heard_since = now
            # An id popped from a ready list around the outage can be lost with its reply
            # (seen in the chaos test: the head stayed QUEUED, marked pushed, in no list).
            # Queue every head again; a duplicate id is harmless, the claim takes it once.
            for rid in await self.registry.all_ids():
                await self.ledger.repush(rid)
        silence = self.settings.heartbeat_timeout_seconds
        if now - self._heard_since < silence:
            silence = float("inf")
        for rep in await self.registry.silent_replicas(silence):
            await self.lose_replica(
                rep.replica_id,
                f"{rep.kind} replica {rep.replica_id} missed heartbeats for "
                f"{self.settings.heartbeat_timeout_seconds:g}s",
            )
        for rid in await self.registry.binding_ids():
            await self.placer.finish_binding(rid)
        await self.pager.sweep()
        for base in sorted(
            {r.base_model for r in await self.registry.replicas(TRAINER) if r.failed}
        ):
            await self.strand(base)  # a run that started waiting since (a paged run's call)
        timeout = self.settings.session_timeout_seconds
        if timeout and now - self._sessions_heard_since >= timeout:
            for tenant, session_id in await self.tenancy.silent_sessions(timeout):
                log.info("session %s missed heartbeats for %gs: finishing it", session_id, timeout)
                await self.finish_session(tenant, session_id, "heartbeat timeout")
        await self._update_gauges()
        await self.usage.tick()
        self._swept_at = time.monotonic()

    async def lose_replica(self, replica_id: str, reason: str) -> None:
        """A replica is gone: a trainer's registrations become UNAVAILABLE and re-queue."""
        rep = await self.registry.replica(replica_id)
        if rep is None or not rep.healthy:
            return
        await self.registry.replica_lost(rep.replica_id, reason)
        if rep.kind == TRAINER:
            await self.placer.fill(rep.base_model)

    async def replica_failed(self, replica_id: str, reason: str) -> list[str]:
        """A replica's process stays down: its supervisor spent the restart budget
        (`lorafleet up`). Record why (status, the replica table) and lose it; when it was the
        last trainer of its base model, strand the runs waiting on one. Returns those."""
        rep = await self.registry.replica_failed(replica_id, reason)
        return await self.strand(rep.base_model) if rep.kind == TRAINER else []

    async def strand(self, base_model: str) -> list[str]:
        """Fail the open operations of every run waiting for a trainer of `base_model` when
        none is healthy and one is known to have failed for good, with an Unavailable that
        names it, so waiting callers hear it now instead of polling a queue that will not move.
        The sweep calls it again while that lasts: a paged run's next call queues it for a
        slot after the failure, and it must not wait either.

        The runs stay (UNAVAILABLE, with the same reason: later calls are refused with it) and
        are placed, or rebuilt by replay, if a trainer of the model registers again. A trainer
        that is merely lost (restarting, a pod being rescheduled) strands nothing: its runs
        wait for it and are rebuilt exactly, as recovery.py promises.
        """
        trainers = await self.registry.replicas(TRAINER, base_model)
        if any(t.healthy for t in trainers) or not any(t.failed for t in trainers):
            return []
        error = self._no_healthy_trainer(base_model, trainers)
        waiting = await self.registry.get_many(await self.registry.queued(base_model))
        stranded = [  # the sweep repeats this: a run already told, with nothing open, is done
            r.registration_id
            for r in waiting
            if r is not None
            and (
                r.state != RegState.UNAVAILABLE
                or r.pending
                or r.unavailable_reason != error.message
            )
        ]
        for rid in stranded:
            await self.ledger.fence(rid, RegState.UNAVAILABLE, error, error.message)
        if stranded:
            log.warning("%s: %d waiting runs fail their open operations", error, len(stranded))
        return stranded

    def _no_healthy_trainer(self, base_model: str, trainers: list[Replica]) -> errors.Unavailable:
        now = self.registry.clock()
        why = {
            t.replica_id: f"failed: {t.failed}"
            if t.failed
            else f"last seen {now - t.last_seen:.0f}s ago"
            for t in trainers
        }
        down = ", ".join(f"{replica} ({text})" for replica, text in why.items())
        return errors.Unavailable(
            f"no healthy trainer serves base model {base_model!r}: {down} is down; "
            "retry once it is back (`lorafleet status` says why it is down)",
            field="base_model",
            reason="NO_HEALTHY_TRAINER",
        )

    async def _restore(self, trainer: TrainerClient, rec: RegRecord, rep: Replica) -> bool:
        return await self.recovery.restore(trainer, rec, rep.replica_id, rep.incarnation)

    async def _trainer_of(self, rid: str) -> TrainerClient | None:
        """A healthy trainer of the run's base model (the one it was on first), whose storage
        root holds the run's folder; None when there is none now."""
        rec = await self.registry.get_any(rid)
        if rec is None:
            return None
        reps = [r for r in await self.registry.replicas(TRAINER, rec.base_model) if r.healthy]
        reps.sort(key=lambda r: r.replica_id != rec.replica)
        return self.pool.trainer(reps[0].address) if reps else None

    async def _retire_corrupted(self, rid: str, error: errors.LorafleetError) -> None:
        """A run that cannot be rebuilt: fail what it has open, free its slot."""
        await self.ledger.fence(rid, RegState.RETIRED, error, error.message)
        await self.placer.retire(rid)
        await self.recovery.forget(rid)

    async def fail_run(self, rid: str, error: errors.LorafleetError) -> None:
        """A run its trainer refused to bind: it fails with that error (stored first, so a
        submit racing the fence already sees it), its open operations fail, its slot frees."""
        failed = await self.registry.record_failure(rid, error)
        err = failed.failure() if failed is not None else None
        if err is None:
            return
        await self.ledger.fence(rid, RegState.RETIRED, err, err.message)
        await self.placer.retire(rid)
        await self.recovery.forget(rid)

    async def _update_gauges(self) -> None:
        for state, n in (await self.ledger.depth()).items():
            metrics.LEDGER_OPERATIONS.labels(state=state).set(n)
        metrics.GAP_STALLS.set(await self.ledger.gap_stalls())
        queued = 0
        trainers = await self.registry.replicas(TRAINER)
        tables = await self.registry.slot_tables([rep.replica_id for rep in trainers])
        for rep in trainers:
            used = len(tables[rep.replica_id])
            metrics.REGISTRY_SLOTS.labels(replica=rep.replica_id, state="bound").set(used)
            metrics.REGISTRY_SLOTS.labels(replica=rep.replica_id, state="free").set(
                max(0, rep.num_slots - used)
            )
            queued += len(await self.registry.queued(rep.base_model))
        metrics.REGISTRY_QUEUED.set(queued)

    # --- registry -------------------------------------------------------------------------
    async def create_registration(
        self, req: controller_pb2.CreateRegistrationRequest
    ) -> tuple[RegRecord, str]:
        await self.tenancy.check_session(req.tenant, req.session_id)
        if req.model_seq_id < 0:
            raise errors.InvalidArgument("must be >= 0", field="model_seq_id")
        optimizer = req.optimizer or "adamw"
        if optimizer != "adamw":
            raise errors.InvalidArgument("only 'adamw' is supported", field="optimizer")
        lora = common_pb2.LoraConfig()
        lora.CopyFrom(req.lora_config)
        base_model = req.base_model
        load_payload = b""
        if req.initial_checkpoint:
            ckpt = await self.catalog.get(req.tenant, req.initial_checkpoint)
            if ckpt.type != TRAINING:
                raise errors.InvalidArgument(
                    "initial_checkpoint must be a tinker://.../weights/<name> path",
                    field="initial_checkpoint",
                )
            lora.CopyFrom(ckpt.lora)
            base_model = ckpt.base_model
            load_payload = controller_pb2.OperationPayload(
                load_state=controller_pb2.LoadStatePayload(
                    path=req.initial_checkpoint, with_optimizer=req.initial_with_optimizer
                )
            ).SerializeToString()
        trainers = await self.registry.replicas(TRAINER, base_model)
        if not trainers:
            served = sorted({r.base_model for r in await self.registry.replicas(TRAINER)})
            raise errors.InvalidArgument(
                f"no trainer serves base model {base_model!r} (served: {served})",
                field="base_model",
            )
        if not any(t.healthy for t in trainers):
            # A trainer whose restart budget is spent stays down (`lorafleet up`) or a pod
            # crash-loops: a registration queued now would wait forever, so say who is missing.
            raise self._no_healthy_trainer(base_model, trainers)
        # The LoraConfig's rules (contract.check_lora_config) are checked by the gateway and
        # by the trainer at bind; a refused bind fails the run with that error (fail_run).
        rec, created = await self.registry.create(
            req.tenant,
            req.session_id,
            req.model_seq_id,
            base_model,
            lora,
            dict(req.user_metadata),
            optimizer,
            bool(load_payload),
        )
        load_op = ""
        if load_payload:
            load_op = await self.ledger.create_internal(
                rec.registration_id,
                req.tenant,
                0,
                controller_pb2.OPERATION_KIND_LOAD_STATE,
                load_payload,
            )
        placeable = created or rec.state == RegState.QUEUED
        if placeable and (await self.registry.place(rec.registration_id)).code == "placed":
            await self.placer.finish_binding(rec.registration_id)
        rec = await self.registry.get(req.tenant, rec.registration_id)
        if (failure := rec.failure()) is not None:
            raise failure
        return rec, load_op

    async def finish_session(self, tenant: str, session_id: str, reason: str) -> None:
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
            await self.ledger.fence(rid, RegState.RETIRED, finished)
            await self.placer.retire(rid)
            await self.recovery.forget(rid)
        await self.tenancy.finish(tenant, session_id, reason)

    async def revoke_api_key(self, key_id: str) -> None:
        """Revoke a key and finish the live sessions it opened: their clients can no longer
        heartbeat or submit, so their runs' slots go back now rather than after the timeout."""
        await self.tenancy.revoke_key(key_id)
        for tenant, session_id in await self.tenancy.sessions_of_key(key_id):
            await self.finish_session(tenant, session_id, "API key revoked")

    async def delete_registration(self, tenant: str, rid: str) -> None:
        rec = await self.registry.get(tenant, rid)
        if rec.state == RegState.RETIRED:
            return
        retired = errors.FailedPrecondition(
            "registration retired before the operation ran",
            field="registration_id",
            reason="RETIRED",
        )
        await self.ledger.fence(rid, RegState.RETIRED, retired)
        await self.placer.retire(rid)
        await self.recovery.forget(rid)
        await self.publisher.forget(rid, rec.base_model)

    # --- ledger ---------------------------------------------------------------------------
    async def submit_operation(
        self,
        req: controller_pb2.SubmitOperationRequest,
        rejected: errors.LorafleetError | None = None,
    ) -> Admission:
        """Admit an operation. `rejected`: the gateway refused its payload at the edge; the
        seq_id is spent as a FAILED(user) record with that error and nothing runs."""
        if rejected is not None:
            info = req.rejection.SerializeToString(deterministic=True)
            digest = "rejected:" + hashlib.sha256(info).hexdigest()
            unspecified = controller_pb2.OPERATION_KIND_UNSPECIFIED
            return await self.ledger.submit(
                req.tenant, req.registration_id, req.seq_id, unspecified, b"", digest, rejected
            )
        payload = req.payload
        body = payload.SerializeToString(deterministic=True)
        kind = validate.payload_kind(payload)
        rejection = validate.validate(payload)
        admission = await self.ledger.submit(
            req.tenant,
            req.registration_id,
            req.seq_id,
            kind,
            body,
            validate.digest(payload),
            rejection,
        )
        if admission.page_in:  # a paged run has work again: give it a free slot if one is
            self._background(self.placer.fill(admission.page_in))
        return admission

    # --- samplers -------------------------------------------------------------------------
    async def create_sampler(self, req: controller_pb2.CreateSamplerRequest) -> SamplerRecord:
        await self.tenancy.check_session(req.tenant, req.session_id)
        if bool(req.model_path) == bool(req.base_model):
            raise errors.InvalidArgument(
                "exactly one of model_path and base_model is required", field="model_path"
            )
        sampler_id = sampler_id_of(req.session_id, req.sampling_session_seq_id)
        with contextlib.suppress(errors.NotFound):
            return await self.samplers.get(req.tenant, sampler_id)
        if req.base_model:
            if not await self.registry.replicas(ROLLOUT, req.base_model):
                raise errors.InvalidArgument(
                    f"no rollout serves base model {req.base_model!r}", field="base_model"
                )
            return await self.samplers.record(
                sampler_id=sampler_id,
                tenant=req.tenant,
                base_model=req.base_model,
                model_path="",
                ref=common_pb2.AdapterRef(),
                inflight=False,
            )
        ckpt = await self.catalog.get(req.tenant, req.model_path)
        if ckpt.type != SAMPLER:
            return await self.publisher.sampler_from_checkpoint(
                ckpt, sampler_id, req.tenant, req.model_path
            )
        ref = common_pb2.AdapterRef(registration_id=ckpt.training_run_id, version=ckpt.version)
        return await self.samplers.record(
            sampler_id=sampler_id,
            tenant=req.tenant,
            base_model=ckpt.base_model,
            model_path=req.model_path,
            ref=ref,
            inflight=False,
        )

    # --- fleet ----------------------------------------------------------------------------
    async def register_replica(self, req: controller_pb2.RegisterReplicaRequest) -> None:
        kind = {
            controller_pb2.REPLICA_KIND_TRAINER: TRAINER,
            controller_pb2.REPLICA_KIND_ROLLOUT: ROLLOUT,
        }.get(req.kind)
        if kind is None:
            raise errors.InvalidArgument("kind must be TRAINER or ROLLOUT", field="kind")
        for name in ("replica_id", "address", "base_model", "incarnation"):
            if not getattr(req, name):
                raise errors.InvalidArgument(f"{name} is required", field=name)
        if kind == TRAINER and req.num_slots < 1:
            raise errors.InvalidArgument("must be >= 1", field="num_slots")
        quantization = req.quantization or quantize.NONE
        if quantization not in quantize.QUANTIZATIONS:
            raise errors.InvalidArgument(
                f"must be one of {', '.join(quantize.QUANTIZATIONS)}", field="quantization"
            )
        rep = Replica(
            kind=kind,
            replica_id=req.replica_id,
            address=req.address,
            base_model=base_model_name(req.base_model),
            num_slots=req.num_slots,
            incarnation=req.incarnation,
            last_seen=0,
            healthy=True,
            tokenizer_id=req.tokenizer_id,
            max_rank=req.max_rank,
            max_context_length=req.max_context_length,
            arch=req.arch,
            max_num_samples=req.max_num_samples,
            quantization=quantization,
        )
        await self.admit_replica(rep)

    async def admit_replica(self, rep: Replica) -> str:
        """Record a replica (RegisterReplica or discovery) and act on what changed."""
        await self._check_same_base(rep)
        change = await self.registry.register_replica(rep)
        if change == "same":
            return change
        log.info("%s replica %s: %s", rep.kind, rep.replica_id, change)
        if rep.kind == TRAINER:
            self._background(self._trainer_joined(rep))
        else:
            self._background(self.publisher.reconcile(rep))
        return change

    async def _check_same_base(self, rep: Replica) -> None:
        """Refuse a replica that stores its base model otherwise (`lorafleet.quantize`) than a
        healthy replica of the same model: a sampler on other weights than its trainer's gives
        logprobs that drift from the trainer's, and RL's importance ratios pay for it.

        Refused here, when the replica registers, rather than when a run is created: the
        mismatch is a deployment fault no run can fix, it is caught before any tenant's work
        reaches the replica (a refused replica is never recorded, so it gets no traffic), the
        replica's heartbeat log names it, and it is admitted by itself once the replicas it
        disagrees with are gone (changing the quantization is redeploying the model)."""
        for other in await self.registry.replicas():
            if (
                other.healthy
                and other.base_model == rep.base_model
                and other.replica_id != rep.replica_id
                and other.quantization != rep.quantization
            ):
                raise errors.FailedPrecondition(
                    f"{rep.kind} {rep.replica_id} stores base model {rep.base_model!r} with "
                    f"quantization {rep.quantization!r}, but {other.kind} {other.replica_id} "
                    f"serves it with {other.quantization!r}: every trainer and rollout of a "
                    "model must run the same one",
                    field="quantization",
                    reason="QUANTIZATION_MISMATCH",
                )

    async def _trainer_joined(self, rep: Replica) -> None:
        try:
            info = await self.pool.trainer(rep.address).info()
            await self.registry.set_trainer_info(
                rep.replica_id, list(info.loss_fns), list(info.modules), info.vocab_size
            )
        except errors.LorafleetError as exc:
            log.warning("GetTrainerInfo on %s failed: %s", rep.replica_id, exc)
        await self.placer.fill(rep.base_model)
