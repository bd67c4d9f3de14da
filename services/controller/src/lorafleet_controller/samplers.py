"""Samplers and sample operations.

A sampler (`<session>:sample:<n>`) is bound to a published adapter version or to the base
model. SubmitSample stores a SAMPLE operation (idempotent on sampler, seq_id and payload
digest; not seq-ordered) and runs it on the least-loaded healthy rollout replica serving the
base model. Inflight samplers resolve their registration's newest published version when
the sample is dispatched; snapshot samplers keep the version they were created with.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections import Counter
from dataclasses import dataclass

import redis.asyncio as aioredis

from lorafleet import errors
from lorafleet.v1 import common_pb2, controller_pb2, rollout_pb2
from lorafleet_controller import ledger as L
from lorafleet_controller.clients import Pool
from lorafleet_controller.lua import Scripts
from lorafleet_controller.registry import ROLLOUT, Registry
from lorafleet_controller.settings import ControllerSettings

log = logging.getLogger(__name__)


def _s(value: bytes | None, default: str = "") -> str:
    return value.decode() if value is not None else default


def sampler_id_of(session_id: str, seq: int) -> str:
    return f"{session_id}:sample:{seq}"


@dataclass(frozen=True)
class SamplerRecord:
    sampler_id: str
    tenant: str
    base_model: str
    model_path: str
    ref: common_pb2.AdapterRef
    inflight: bool


class Samplers:
    def __init__(
        self,
        client: aioredis.Redis,
        scripts: Scripts,
        ledger: L.Ledger,
        registry: Registry,
        pool: Pool,
        settings: ControllerSettings,
    ) -> None:
        self.r = client
        self.scripts = scripts
        self.ledger = ledger
        self.registry = registry
        self.pool = pool
        self.settings = settings
        self.p = settings.key_prefix
        self._load: Counter[str] = Counter()
        self._tasks: set[asyncio.Task[None]] = set()

    async def record(
        self, *, sampler_id: str, tenant: str, base_model: str, model_path: str,
        ref: common_pb2.AdapterRef, inflight: bool,
    ) -> SamplerRecord:  # fmt: skip
        key = f"{self.p}sampler:{sampler_id}"
        if await self.r.hsetnx(key, "tenant", tenant):
            await self.r.hset(
                key,
                mapping={"base_model": base_model, "model_path": model_path,
                         "rid": ref.registration_id, "version": ref.version,
                         "inflight": "1" if inflight else "0"},
            )  # fmt: skip
            session = sampler_id.rsplit(":sample:", 1)[0]
            await self.r.sadd(f"{self.p}session_samplers:{session}", sampler_id)
        return await self.get(tenant, sampler_id)

    async def get(self, tenant: str, sampler_id: str) -> SamplerRecord:
        raw = await self.r.hgetall(f"{self.p}sampler:{sampler_id}")
        if not raw or _s(raw.get(b"tenant")) != tenant or b"base_model" not in raw:
            raise errors.NotFound(f"no sampler {sampler_id!r}", field="sampler_id")
        return SamplerRecord(
            sampler_id=sampler_id,
            tenant=tenant,
            base_model=_s(raw[b"base_model"]),
            model_path=_s(raw.get(b"model_path")),
            ref=common_pb2.AdapterRef(
                registration_id=_s(raw.get(b"rid")), version=int(raw.get(b"version", b"0"))
            ),
            inflight=raw.get(b"inflight") == b"1",
        )

    async def submit(
        self, tenant: str, req: controller_pb2.SubmitSampleRequest
    ) -> tuple[str, int, bool, list[str]]:
        """(operation_id, state, duplicate, sequence_ids) of a sample request."""
        sampler = await self.get(tenant, req.sampler_id)
        if req.seq_id < 0:
            raise errors.InvalidArgument("seq_id must be >= 0", field="seq_id")
        if not req.prompt_tokens:
            raise errors.InvalidArgument("empty prompt", field="prompt_tokens")
        n = req.num_samples or 1
        if n < 1 or n > 1024:
            raise errors.InvalidArgument("must be in [1, 1024]", field="num_samples")
        body = rollout_pb2.SampleRequest(
            prompt_tokens=req.prompt_tokens, params=req.params, num_samples=n,
            prompt_logprobs=req.prompt_logprobs, topk_prompt_logprobs=req.topk_prompt_logprobs,
        ).SerializeToString(deterministic=True)  # fmt: skip
        if len(body) > self.settings.max_payload_bytes:
            raise errors.InvalidArgument("sample request too large", field="prompt_tokens")
        opid = f"{req.sampler_id}#s{req.seq_id}"
        digest = hashlib.sha256(body).hexdigest()
        s = self.settings
        out = await self.scripts.run(
            "submit_sample", opid, digest, body, self.ledger.clock(), tenant,
            sampler.ref.registration_id, s.max_unacked_results, s.max_pending_global,
        )  # fmt: skip
        code = _s(out[0])
        if code == "not_found":
            raise errors.NotFound(f"no sampler {req.sampler_id!r}", field="sampler_id")
        if code == "conflict":
            raise errors.Conflict(
                f"seq_id {req.seq_id} of {req.sampler_id} was used with another request",
                field="seq_id", reason="PAYLOAD_CONFLICT",
            )  # fmt: skip
        if code == "backpressure":
            raise errors.ResourceExhausted(
                f"too many open operations ({_s(out[1])}); retry", retry_after=1.0,
                reason="BACKPRESSURE",
            )  # fmt: skip
        seq_ids = [f"{opid}:{i}" for i in range(n)]
        if code == "created":
            self.spawn(opid)
        return opid, int(out[1]), code == "duplicate", seq_ids

    def spawn(self, opid: str) -> None:
        task = asyncio.create_task(self._run(opid))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def recover(self) -> None:
        """Re-run samples that were open when the previous controller stopped."""
        for opid in await self.r.smembers(f"{self.p}open_samples"):
            self.spawn(_s(opid))

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _run(self, opid: str) -> None:
        claim = await self.ledger.claim(opid) or await self.ledger.load_claim(opid)
        if claim is None:
            return
        try:
            output = await self._sample(opid, claim)
        except errors.LorafleetError as exc:
            await self.ledger.complete(opid, L.FAILED, error=exc)
        except Exception as exc:
            log.exception("sample %s failed", opid)
            await self.ledger.complete(opid, L.FAILED, error=errors.Internal(str(exc)))
        else:
            result = controller_pb2.OperationResult(sample=output)
            await self.ledger.complete(opid, L.SUCCEEDED, result.SerializeToString())

    async def _sample(self, opid: str, claim: L.Claim) -> common_pb2.SampleOutput:
        sampler_id = opid.rsplit("#s", 1)[0]
        tenant = claim.tenant
        sampler = await self.get(tenant, sampler_id)
        ref = common_pb2.AdapterRef()
        ref.CopyFrom(sampler.ref)
        if sampler.inflight and ref.registration_id:
            reg = await self.registry.get_any(ref.registration_id)
            if reg is not None and reg.published_version:
                ref.version = reg.published_version
        req = rollout_pb2.SampleRequest.FromString(claim.payload)
        req.request_id = opid
        req.adapter.CopyFrom(ref)
        rollouts = [r for r in await self.registry.replicas(ROLLOUT, sampler.base_model)
                    if r.healthy]  # fmt: skip
        if not rollouts:
            raise errors.Unavailable(
                f"no healthy rollout replica serves {sampler.base_model!r}", field="sampler_id"
            )
        chosen = min(rollouts, key=lambda r: (self._load[r.replica_id], r.replica_id))
        self._load[chosen.replica_id] += 1
        try:
            return await self.pool.rollout(chosen.address).sample(req)
        finally:
            self._load[chosen.replica_id] -= 1
